"""Measured model-state memory of one rank: the bytes of the tensors that hold its weights,
gradients and optimizer states, for comparison with the planner (parallel/memory_plan.py).

Host RSS cannot show this on CPU: the framework's ~380 MiB per rank dwarfs a tiny model's states.
Instead the census walks what the engine holds (the module's parameters and gradients, ZeRO-3's
partitions, and every tensor reachable from DeepSpeed's optimizer wrapper: fp32 master copies,
Adam moments, flat gradient buffers) and adds up each distinct storage once (flat buffers and the
views into them count once).

It runs just before the second optimizer step (``CensusAtStep``): gradients are populated then, and
Adam has created its moments during the first step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

WALK_DEPTH = 4  # optimizer wrapper -> inner optimizer -> state dict -> per-parameter dict -> tensor


def _tensors(obj, depth: int, visited: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through lists, tuples, dicts and plain objects' attributes.

    Modules are not entered (the module's parameters are counted separately), nor is anything
    already visited (DeepSpeed objects point back at each other)."""
    if id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if hasattr(obj, "ds_tensor"):  # a ZeRO-3 parameter: its data is empty, its partition is here
            yield obj.ds_tensor
        return
    if depth == 0 or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type)) or obj is None:
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
        children = list(vars(obj).values())  # DeepSpeed optimizer wrappers and torch optimizers only
    else:
        return
    for child in children:
        yield from _tensors(child, depth - 1, visited)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage address, storage bytes) of a materialised tensor, None for empty or meta ones."""
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def census(module: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds as weights, gradients and optimizer-side tensors (each storage once)."""
    seen: set[int] = set()
    out = {"weights": 0, "grads": 0, "optimizer": 0}

    def add(role: str, tensors) -> None:
        for t in tensors:
            s = _storage(t)
            if s is not None and s[0] not in seen:
                seen.add(s[0])
                out[role] += s[1]

    params = list(module.parameters())
    add("weights", [getattr(p, "ds_tensor", p) for p in params] + params)
    add("grads", [p.grad for p in params if p.grad is not None])
    add("optimizer", _tensors(optimizer, WALK_DEPTH, set()))
    out["total"] = sum(out.values())
    return out


class CensusAtStep:
    """Takes the census once, just before optimizer step number ``at`` (1-based) on this rank."""

    def __init__(self, engine, at: int = 2):
        self.result: dict[str, int] | None = None
        self._calls = 0
        optimizer = engine.optimizer
        step = optimizer.step

        def counted_step(*args, **kwargs):
            self._calls += 1
            if self._calls == at:
                self.result = census(engine.module, optimizer)
            return step(*args, **kwargs)

        optimizer.step = counted_step


def _counted(t) -> bool:
    """Whether ``t`` has storage of its own to count: a wrapper subclass (torchao's float8 tensors) has none, the
    tensors it wraps pass through the mode as they are made."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and not is_traceable_wrapper_subclass(t)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while it is active and still alive, and their peak: what a
    GPU's caching allocator counts as allocated, on any device. Every operator's outputs pass through
    it; a storage counts from its first sight until Python's last reference to it goes. (The CPU has no
    allocator statistics; its RSS misses untouched pages of zero-filled tensors, and torch.profiler's
    memory timeline holds tensors alive through record_shapes.)"""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.ref] = {}  # storage address -> weak reference to it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Inputs first: a storage that existed before (a weight) is not new when an op returns a view of it.
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if _counted(t):
                self._see(t.untyped_storage(), new=False)
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if _counted(t):
                self._see(t.untyped_storage(), new=True)
        return out

    def _see(self, storage, new: bool) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive:
            return
        size = size if new else 0  # an older storage is followed only to know when its address is free again
        self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._gone(key, size))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _gone(self, key: int, size: int) -> None:
        self._alive.pop(key, None)
        self.live -= size


class StepPeak:
    """Peak of allocated tensor bytes during training step ``at`` above its start, on this rank: what the
    step allocates and frees (gradients, saved activations of the micro-batches in flight, the loss
    buffer, temporaries), as opposed to the model states it starts with. GPU: the allocator's peak;
    CPU (``count_cpu``): :class:`LiveTensorBytes` around the step."""

    def __init__(self, at: int = 2, count_cpu: bool = False):
        self.at = at
        self.result_mib: float | None = None
        self._count_cpu = count_cpu and not torch.cuda.is_available()
        self._counter: LiveTensorBytes | None = None
        self._start = 0

    def before(self, step: int) -> None:
        if step != self.at:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        elif self._count_cpu:
            self._counter = LiveTensorBytes()
            self._counter.__enter__()

    def after(self, step: int) -> None:
        if step != self.at:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.result_mib = (torch.cuda.max_memory_allocated() - self._start) / 2**20
        elif self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.result_mib = self._counter.peak / 2**20
            self._counter = None
