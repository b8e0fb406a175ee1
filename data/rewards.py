"""GRPO's reward functions, named in the config as ``module:function``: loaded and checked before start, called as
TRL 1.16.0's ``GRPOTrainer._calculate_rewards`` calls them, and the reward metrics it logs.

TRL's contract, which this module keeps: each function is called once per batch with ``prompts``, ``completions``,
``completion_ids``, every dataset column but prompt/completion/completion_ids (one value per completion),
``trainer_state``, ``log_extra`` and ``log_metric``, all by name; it returns one reward per completion, None where
it does not apply (NaN in the [N, F] fp32 rewards); the total is the weighted sum over the functions that applied
(``nansum``), NaN for a completion no function scored. Async functions are awaited together. Stricter than TRL,
each before any step: a signature that cannot take TRL's call, a reward that is no number (TRL's
``torch.tensor`` fails later, or casts), an infinite reward (TRL would zero the group's advantages without a
word), a non-finite weight (a NaN weight drops its function in ``nansum``) and two functions logged under one name.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
import os
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from models.grpo import nanstd, rewards_total

REWARD_FUNCS_KEY = "grpo.reward_funcs"
REWARD_WEIGHTS_KEY = "grpo.reward_weights"
# What GRPOTrainer._calculate_rewards passes every reward function by name, besides the dataset's columns.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # dataset keys TRL does not pass on
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class RewardConfigError(ValueError):
    """Reward functions or weights that cannot be used; the message lists every problem."""


class RewardError(RuntimeError):
    """Reward functions that failed on a batch; the message names each, the completion and the value."""


@dataclass(frozen=True)
class RewardFunc:
    """One loaded reward function: ``where`` names its config entry in messages, ``name`` its metrics."""

    where: str
    func: Callable
    name: str
    is_async: bool
    signature: inspect.Signature


def callable_name(func: Callable) -> str:
    """The name TRL logs a reward function under (trl.trainer.utils.get_callable_name): a partial's function's
    ``__name__``, else the callable's, else its class's."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func: Callable) -> bool:
    """Whether calling ``func`` returns a coroutine (trl.trainer.utils.is_async_callable)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(func.__call__)


def reward_function_problems(specs: list[str], weights: list[float] | None = None) -> list[str]:
    """Every problem of ``grpo.reward_funcs`` and ``grpo.reward_weights``, each with its fix (imports them)."""
    return _load_all(specs, weights)[1]


def load_reward_functions(specs: list[str], weights: list[float] | None = None) -> RewardSet:
    """Import each ``module:function`` of ``specs`` and check it against TRL's call and ``weights`` (None: each
    1.0, as TRL); raise :class:`RewardConfigError` listing every problem."""
    funcs, problems = _load_all(specs, weights)
    if problems:
        raise RewardConfigError("invalid reward functions:\n  " + "\n  ".join(problems))
    return RewardSet(funcs, torch.tensor([1.0] * len(funcs) if weights is None else weights, dtype=torch.float32))


def _load_all(specs: list[str], weights: list[float] | None) -> tuple[list[RewardFunc], list[str]]:
    if not specs:
        return [], [f"{REWARD_FUNCS_KEY} is empty: GRPO needs at least one reward function ('module:function')"]
    funcs, problems = [], []
    for i, spec in enumerate(specs):
        func, found = _load_one(f"{REWARD_FUNCS_KEY}[{i}] {spec!r}", spec)
        problems += found
        funcs += [func] if func else []
    return funcs, problems + _name_clashes(funcs) + weight_problems(weights, len(specs))


def _load_one(where: str, spec: Any) -> tuple[RewardFunc | None, list[str]]:
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and module_name and attr) or ":" in attr:
        return None, [f"{where} is not 'module:function' (e.g. 'my_rewards:format_reward')"]
    obj, problem = _import(where, module_name, attr)
    if problem:
        return None, [problem]
    if not callable(obj):
        return None, [f"{where} is a {type(obj).__name__}, not a function"]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        return None, [
            f"{where}: its signature cannot be read ({e}): define it as def f(prompts, completions, **kwargs)"
        ]
    problems = _signature_problems(where, signature)
    return RewardFunc(where, obj, callable_name(obj), is_async_callable(obj), signature), problems


def _import(where: str, module_name: str, attr: str) -> tuple[Any, str | None]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):
            return None, f"{where} cannot be imported: {e} (add the directory that holds it to PYTHONPATH)"
        return None, f"{where} cannot be imported: importing {module_name!r} raised {e} (install {e.name!r})"
    except Exception as e:  # the user's module failed while running: name what it raised and where
        return None, f"{where} cannot be imported: importing {module_name!r} raised {type(e).__name__}: {e}"
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
            return None, (
                f"{where}: module {module_name!r} ({module.__file__}) has no {attr!r}"
                f" (its functions: {', '.join(defined[:10]) or 'none'})"
            )
        obj = getattr(obj, part)
    return obj, None


def _signature_problems(where: str, signature: inspect.Signature) -> list[str]:
    params = signature.parameters.values()
    problems = []
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        problems.append(
            f"{where} takes {', '.join(positional)} only by position, but TRL passes every argument by name:"
            " remove the '/' from its parameters"
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        lacking = [n for n in TRL_ARGUMENTS if n not in {p.name for p in params if p.kind in _NAMED}]
        if lacking:
            problems.append(
                f"{where} has no **kwargs and does not take {', '.join(lacking)}, which TRL's GRPOTrainer passes"
                " every reward function by name with each dataset column: add **kwargs to its parameters"
            )
    return problems


def _name_clashes(funcs: list[RewardFunc]) -> list[str]:
    first: dict[str, RewardFunc] = {}
    problems = []
    for f in funcs:
        if f.name in first:
            problems.append(
                f"{first[f.name].where} and {f.where} both log as rewards/{f.name}/mean (TRL names a reward by its"
                " function's __name__): rename one of them"
            )
        first.setdefault(f.name, f)
    return problems


def weight_problems(weights: list[float] | None, count: int) -> list[str]:
    """``grpo.reward_weights``: none (each 1.0) or one finite number per reward function."""
    if weights is None:
        return []
    problems = []
    if len(weights) != count:
        problems.append(
            f"{REWARD_WEIGHTS_KEY} has {len(weights)} weights for {count} reward functions in {REWARD_FUNCS_KEY}:"
            " give one weight per function, in order, or none (each 1.0)"
        )
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            problems.append(f"{REWARD_WEIGHTS_KEY}[{i}] is {w!r}: a weight must be a finite number")
    return problems


@dataclass
class RewardSet:
    """The loaded reward functions and their fp32 weights [F]. ``logged_metrics`` and ``logged_extra`` collect
    what the functions pass to ``log_metric`` and ``log_extra`` (as TRL's ``_pending_metrics`` and
    ``_pending_extra_logs``) until the caller logs them."""

    funcs: list[RewardFunc]
    weights: torch.Tensor
    logged_metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    logged_extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.funcs]

    def score(
        self, prompts: list, completions: list, completion_ids: list, columns: dict[str, list], trainer_state=None
    ) -> torch.Tensor:
        """The rewards [N, F], fp32, NaN where a function returned None; :class:`RewardError` lists every function
        that failed. ``columns``: the dataset's columns, one value per completion (prompt/completion/completion_ids
        are dropped, as TRL does); ``trainer_state``: what the functions see as TRL's (default a fresh
        ``transformers.TrainerState``)."""
        rewards, problems = self._score(prompts, completions, completion_ids, columns, trainer_state)
        if problems:
            raise RewardError("reward functions failed:\n  " + "\n  ".join(problems))
        return rewards

    def total(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards_total(rewards, self.weights)

    def metrics(self, rewards: torch.Tensor) -> dict[str, float]:
        return reward_metrics(rewards, self.weights, self.names)

    def dry_run(self, rows: list[dict], completions: list | None = None) -> tuple[list[str], list[str]]:
        """(problems, warnings) of calling each function once on dataset ``rows`` (each with its ``prompt``) and
        ``completions`` (default: empty ones, in the prompts' format)."""
        prompts = [row["prompt"] for row in rows]
        if completions is None:
            completions = [[{"role": "assistant", "content": ""}] if isinstance(p, list) else "" for p in prompts]
        columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in NOT_COLUMNS}
        rewards, problems = self._score(prompts, completions, [[] for _ in rows], columns, None)
        warning = None if problems else unscorable_warning(rewards, prompts)
        return problems, [warning] if warning else []

    def _score(self, prompts, completions, completion_ids, columns, trainer_state) -> tuple[torch.Tensor, list[str]]:
        columns = {k: v for k, v in columns.items() if k not in NOT_COLUMNS}
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        kwargs.update(trainer_state=_state(trainer_state), log_extra=self._log_extra, log_metric=self._log_metric)
        problems = [
            f"the data's column {c!r} clashes with the argument TRL passes by that name: rename the column"
            for c in TRL_ARGUMENTS
            if c in columns
        ]
        for f in self.funcs:
            problems += _call_problems(f, kwargs, list(columns))
        if problems:
            return torch.zeros(len(prompts), len(self.funcs)), problems
        outputs = _call_all(self.funcs, kwargs)
        rewards = torch.zeros(len(prompts), len(self.funcs), dtype=torch.float32)
        for i, (f, out) in enumerate(zip(self.funcs, outputs, strict=True)):
            values, problem = _rewards_of(f, out, prompts)
            problems += [problem] if problem else []
            if values is not None:
                rewards[:, i] = torch.tensor(values, dtype=torch.float32)
        return rewards, problems

    def _log_extra(self, column: str, values: list) -> None:
        self.logged_extra[column].extend(values)

    def _log_metric(self, name: str, value: float) -> None:
        self.logged_metrics[name].append(value)


def _state(trainer_state):
    if trainer_state is not None:
        return trainer_state
    from transformers import TrainerState  # transformers.trainer is slow to import: only when no state is given

    return TrainerState()


def _call_problems(f: RewardFunc, kwargs: dict, columns: list[str]) -> list[str]:
    params = f.signature.parameters.values()
    problems = []
    missing = [p.name for p in params if p.kind in _NAMED and p.default is p.empty and p.name not in kwargs]
    if missing:
        problems.append(
            f"{f.where} needs {', '.join(map(repr, missing))}, which the data has no column for (its columns:"
            f" {', '.join(map(repr, columns)) or 'none'}): add the column or give the parameter a default"
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unexpected = [c for c in columns if c not in {p.name for p in params if p.kind in _NAMED}]
        if unexpected:
            problems.append(
                f"{f.where} has no **kwargs and does not take the data's column(s) {', '.join(map(repr, unexpected))},"
                " which TRL passes by name: add **kwargs to its parameters"
            )
    return problems


def _call_all(funcs: list[RewardFunc], kwargs: dict) -> list[Any]:
    """Each function's output, or the exception it raised; async functions run together (as TRL gathers them)."""
    outputs: list[Any] = []
    for f in funcs:
        if f.is_async:
            outputs.append(None)
            continue
        try:
            outputs.append(f.func(**kwargs))
        except Exception as e:  # reported with the function's name, with every other failure
            outputs.append(e)
    waiting = [i for i, f in enumerate(funcs) if f.is_async]
    if waiting:

        async def gather():
            return await asyncio.gather(*(funcs[i].func(**kwargs) for i in waiting), return_exceptions=True)

        for i, out in zip(waiting, asyncio.run(gather()), strict=True):
            outputs[i] = out
    return outputs


def _rewards_of(f: RewardFunc, out: Any, prompts: list) -> tuple[list[float] | None, str | None]:
    """The rewards of one function's output (None -> NaN, as TRL), or the problem with it."""
    n = len(prompts)
    if isinstance(out, Exception):
        frame = traceback.extract_tb(out.__traceback__)[-1]
        return None, (
            f"{f.where} raised {type(out).__name__}: {out} (at {os.path.basename(frame.filename)}:{frame.lineno})"
            f" on a batch of {n} completions, the first prompt {_short(prompts[0])}"
        )
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return None, f"{f.where} returned {_shown(out)} ({type(out).__name__}), not a list of {n} rewards"
    values = list(out)
    if len(values) != n:
        return None, (
            f"{f.where} returned {len(values)} rewards for {n} completions: one per completion, in order"
            " (None where it does not apply)"
        )
    floats = [_as_float(v) for v in values]
    for j, (v, x) in enumerate(zip(values, floats, strict=True)):
        if x is None or math.isinf(x):
            need = "a number" if x is None else "finite"
            return None, (
                f"{f.where} returned {_shown(v)} ({type(v).__name__}) for completion {j} (prompt"
                f" {_short(prompts[j])}): a reward must be {need}, or None where it does not apply"
            )
    return floats, None


def _as_float(value: Any) -> float | None:
    """A reward as TRL's ``torch.tensor(..., dtype=float32)`` reads it (None -> NaN); None if it is no number."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _short(value: Any, limit: int = 60) -> str:
    """A prompt or value for a message: a conversation's last message, whitespace collapsed, cut to ``limit``."""
    if isinstance(value, list) and value and isinstance(value[-1], dict) and "content" in value[-1]:
        value = value[-1]["content"]
    text = " ".join(str(value).split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unscorable_warning(rewards: torch.Tensor, prompts: list) -> str | None:
    """A warning when every function returned None for some completion (TRL logs one too): its advantage is 0."""
    rows = torch.isnan(rewards).all(dim=1).nonzero(as_tuple=True)[0].tolist()
    if not rows:
        return None
    return (
        f"every reward function returned None for {len(rows)} of {len(prompts)} completions (the first: completion"
        f" {rows[0]}, prompt {_short(prompts[rows[0]])}): they get advantage 0; make some reward function score them"
    )


def reward_metrics(rewards: torch.Tensor, weights: torch.Tensor, names: list[str]) -> dict[str, float]:
    """What GRPOTrainer logs of one batch's rewards [N, F] (after its gather across ranks): per function the
    NaN-aware mean and unbiased std of the completions it scored, and those of the weighted total."""
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards[:, i]).item()
    total = rewards_total(rewards, weights)
    metrics["reward"] = torch.nanmean(total).item()
    metrics["reward_std"] = nanstd(total).item()
    return metrics
