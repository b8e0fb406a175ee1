"""``save_async: true``: at a save each rank copies its checkpoint files to host memory, and a thread writes them while
training goes on (training/checkpoints/save_restore.py says when the checkpoint becomes ``latest``).

Every file of a checkpoint (the pipeline's layer files, their tensor- and expert-parallel pieces, LoRA adapters,
DeepSpeed's engine and optimizer-state files, the expert moments, the data-parallel engine's layer files) is written
through the engine's ``checkpoint_engine``: :class:`CheckpointEngine` is that engine, and while it captures, ``save``
keeps a host copy of what it is given instead of writing it. So ``engine.save_checkpoint`` and its collectives (the
tensor- and expert-parallel gathers, ZeRO-3's) run as always on the main thread; only the writing moves to
:class:`BackgroundWriter`, which never touches a process group.

Written here rather than with DeepSpeed's checkpoint writers (``"checkpoint": {"writer": ...}``): its decoupled
engine hands the live tensors to a child process and relies on a ``commit`` the pipeline engine never calls (the
next step changes what is still to be written: a torn checkpoint), its data-parallel writer factory fails on the
data-parallel engine, and ranks without a writer drop their files (docs/checkpoints.md#saving-in-the-background).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from models.files.pipeline_dir import load_deepspeed_file
from training.resilience.all_ranks import WriteFailed, writing


def host_copy(item):
    """``item`` with every tensor in it copied to host memory, containers rebuilt with their own types: what the
    file will hold, whatever the training changes afterwards (a torch optimizer's ``state_dict`` hands out its live
    per-parameter dicts, a step counter that ``step`` updates in place among them)."""
    if torch.is_tensor(item):
        copy = item.detach().to("cpu", copy=True)  # [same shape], its own storage (a view of a flat buffer: its part)
        if isinstance(item, torch.nn.Parameter):  # saved as it would have been: a Parameter, requires_grad
            return torch.nn.Parameter(copy, requires_grad=item.requires_grad)
        return copy.requires_grad_(item.requires_grad)
    if isinstance(item, dict):
        return type(item)((k, host_copy(v)) for k, v in item.items())
    if isinstance(item, list):
        return [host_copy(v) for v in item]
    if isinstance(item, tuple) and not isinstance(item, torch.Size):
        values = [host_copy(v) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    return item  # numbers, strings, torch.Size, DeepSpeed's enums: immutable


class CheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with :func:`load_deepspeed_file` (weights only: a tampered file is
    refused, not run), and saving either at once (as DeepSpeed's) or, inside :meth:`capturing`, into a list of
    (path, host copy) for :class:`BackgroundWriter`."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.captured: list[tuple[str, object]] | None = None

    def load(self, path: str, map_location=None):
        return load_deepspeed_file(path, map_location)

    def save(self, state_dict, path: str):
        if self.captured is None:
            with writing(path):
                super().save(state_dict, path)
        else:
            self.captured.append((path, host_copy(state_dict)))

    def preserves_storage_sharing(self):
        # DeepSpeed clones a layer file's tensors before saving when this is True; host_copy already copies them.
        return self.captured is None

    def write(self, obj, path: str) -> None:
        """One captured file, written as ``save`` outside a capture writes it."""
        with writing(path):
            super().save(obj, path)

    @contextlib.contextmanager
    def capturing(self):
        """Within: every ``save`` is kept as (path, host copy), in the list yielded."""
        self.captured = []
        try:
            yield self.captured
        finally:
            self.captured = None


def write_file(engine: CheckpointEngine, path: str, obj) -> None:
    """The writer thread's one file (the fault tests slow it down: tests/ds_scripts/train_faults.py)."""
    engine.write(obj, path)


class BackgroundWriter:
    """One rank's writer: one checkpoint at a time, written by a daemon thread (it dies with the process: a rank
    killed or exiting at once leaves the checkpoint unfinished, never ``latest``)."""

    def __init__(self):
        self.tag: str | None = None  # the checkpoint being written, or written and not yet published
        self.captured_s = 0.0  # the host copy's seconds: what the save stopped training for
        self.started = 0.0
        self.written_s: float | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self, tag: str, files: list[tuple[str, object]], engine: CheckpointEngine, captured_s: float) -> None:
        assert self.tag is None, f"checkpoint {self.tag} is still pending"
        self.tag, self.captured_s, self.started, self.written_s, self.error = tag, captured_s, time.time(), None, None
        self._thread = threading.Thread(
            target=self._write, args=(files, engine), daemon=True, name=f"checkpoint-writer-{tag}"
        )
        self._thread.start()

    def _write(self, files: list[tuple[str, object]], engine: CheckpointEngine) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # Linux: this thread only, below training
        except (AttributeError, OSError):
            pass
        try:
            while files:
                path, obj = files.pop(0)  # each host copy freed once written
                write_file(engine, path, obj)
        except Exception as e:  # noqa: BLE001 (reported on every rank at the next agreement: run_checkpoints.publish)
            self.error = e.what if isinstance(e, WriteFailed) else f"{type(e).__name__}: {e}"
        self.written_s = time.time() - self.started

    @property
    def busy(self) -> bool:
        """Still writing."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Block until the files are written; returns the seconds waited."""
        start = time.time()
        if self._thread is not None:
            self._thread.join()
        return time.time() - start

    def done(self) -> None:
        """The pending checkpoint is published (or abandoned): the writer takes the next."""
        self.tag, self._thread = None, None
