"""The float keys of the training config: each one a finite number, checked in one walk of the dataclasses before any
rule reads them (none documents infinity as a meaning). NaN compares false with everything, so a rule's ``x < 0`` lets
it through, and infinity passes every lower bound: ``mfu_peak_tflops=inf`` logged an MFU of 0.0% each step, ``nan``
dropped it without a word. Each key's range (``FLOAT_RANGES``, said in its line of docs/configuration.md) is checked by
the rule beside what the key drives: resolve's range checks, data/checks.py, models/lora_rules.py, ..."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing

# Every float key -> the range its rule holds it to, as the key's comment in training/configuration/schema.py says it (a
# test checks both); a list's items and a list of sources' fields by the key without the index. An Optional[float]
# is one (None passes); grpo.reward_weights, an optional list, is data/rewards.py's weight_problems' to check.
FLOAT_RANGES = {
    "optim.lr": "in (0, 1]",
    "optim.betas": "in [0, 1)",
    "optim.eps": "in (0, 1)",
    "optim.weight_decay": ">= 0 (and optim.lr x it < 1)",
    "optim.max_grad_norm": ">= 0",
    "optim.min_lr": "in [0, optim.lr]",
    "num_epochs": ">= 0",
    "save_every_minutes": ">= 0",
    "preempt_grace_s": ">= 1",
    "hang_timeout_s": "to 0 or >= 5",
    "min_free_disk_gb": "to -1, 0 or > 0",
    "mfu_peak_tflops": "to 0 or in [0.01, 100000]",
    "data.eval_fraction": "in [0, 1)",
    "data.sources.weight": "> 0",
    "data.eval_sources.weight": "to any finite number (eval sources' weights are unused)",
    "peft.alpha": "> 0",
    "peft.dropout": "in [0, 1)",
    "dpo.beta": "> 0",
    "dpo.label_smoothing": "in [0, 0.5)",
    "grpo.temperature": "> 0",
    "grpo.top_p": "in (0, 1]",
    "grpo.beta": ">= 0",
    "grpo.epsilon": "> 0",
    "grpo.epsilon_high": ">= 0; None: = grpo.epsilon",
    "moe.bias_update_speed": ">= 0",
    "moe.sequence_balance_coef": ">= 0",
}


def float_leaves(node, prefix: str = "") -> typing.Iterator[tuple[str, object, str | int]]:
    """(dotted key, its container, attribute name or list index) of every float of a config dataclass: its nested
    dataclasses, lists of floats (``optim.betas[1]``) and lists of dataclasses (``data.sources[0].weight``) included."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, hint, key = getattr(node, f.name), hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from float_leaves(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    yield from float_leaves(item, f"{key}[{i}].")
                elif typing.get_args(hint) == (float,):
                    yield f"{key}[{i}]", value, i
        elif hint in (float, typing.Optional[float]):
            yield key, node, f.name


def range_key(key: str) -> str:
    """The FLOAT_RANGES key of a leaf: ``data.sources[2].weight`` -> ``data.sources.weight``."""
    return re.sub(r"\[\d+\]", "", key)


def _finite(value) -> bool:
    """A finite number, or a value of another type (Hydra refuses those; a rule says what is wrong with it)."""
    return not isinstance(value, (int, float)) or math.isfinite(value)


def _get(owner, name: str | int):
    return owner[name] if isinstance(name, int) else getattr(owner, name)


def _set(owner, name: str | int, value) -> None:
    if isinstance(name, int):
        owner[name] = value
    else:
        setattr(owner, name, value)


def nonfinite_problems(cfg):
    """(one line per float key that is NaN or infinite, ``cfg`` for the other rules): with such keys a copy holding
    the defaults there, so that no rule reports the same key again (or fails computing with it); the run never
    starts from the copy, as the lines refuse it."""
    bad = [key for key, owner, name in float_leaves(cfg) if not _finite(_get(owner, name))]
    if not bad:
        return [], cfg
    checked = copy.deepcopy(cfg)
    defaults = {key: _get(owner, name) for key, owner, name in float_leaves(type(cfg)())}
    problems = []
    for key, owner, name in float_leaves(checked):
        if key in bad:
            value = _get(owner, name)
            problems.append(f"{key} {value} is not a finite number: set {key} {FLOAT_RANGES[range_key(key)]}")
            # a list item past the default list's: its first item's default; a source's field: its class's default
            default = defaults.get(key, defaults.get(re.sub(r"\[\d+\]$", "[0]", key)))
            _set(owner, name, getattr(type(owner)(), name) if default is None else default)
    return problems, checked
