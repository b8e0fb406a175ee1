"""The keys a user set: Hydra overrides and composed config keys that TrainConfig does not have (each with the
nearest valid key), and entries of a ``data.sources`` override that are not sources."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import fields

from hydra.core.override_parser.overrides_parser import OverridesParser

from training.config import MODEL_CONF_DIR, DataFormat, SourceConfig, TrainConfig, leaf_keys


def given_keys(overrides: list[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (``++data.pad_to_multiple_of=8`` -> data.pad_to_multiple_of)."""
    return {arg.split("=", 1)[0].lstrip("+~") for arg in overrides if "=" in arg}


def unknown_key_problems(given: dict, schema: type | None = None, prefix: str = "") -> list[str]:
    """Keys of the composed config that TrainConfig does not have (``+key=value`` adds them past Hydra's
    own check, and OmegaConf.to_object drops them silently), each with the nearest valid key."""
    defaults = (schema or TrainConfig)()
    problems = []
    for key, value in given.items():
        if not hasattr(defaults, key):
            near = difflib.get_close_matches(
                f"{prefix}{key}", leaf_keys(dataclasses.asdict(TrainConfig())), n=1, cutoff=0.6
            )
            hint = f": did you mean {near[0]}?" if near else ": `python train.py --cfg job` lists the keys"
            problems.append(f"unknown key {prefix}{key}{hint}")
        elif dataclasses.is_dataclass(getattr(defaults, key)) and isinstance(value, dict):
            problems += unknown_key_problems(value, type(getattr(defaults, key)), f"{prefix}{key}.")
    return problems


def override_key_problems(overrides: list[str]) -> list[str]:
    """Command-line ``key=value`` overrides whose key TrainConfig does not have, found before Hydra
    composes the config (Hydra's own error would suggest adding the typo with ``+``), in
    ``unknown_key_problems``' words. Groups (``model=``, ``ds=``, ``data=``), Hydra's own keys and
    ``+``/``~`` overrides are left to Hydra and to ``unknown_key_problems``."""
    groups = {d for d in os.listdir(os.path.dirname(MODEL_CONF_DIR)) if not d.endswith(".yaml")}
    given, sources = {}, []
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if "=" not in arg or arg.startswith(("-", "+", "~")) or key in groups or key.split(".")[0] == "hydra":
            continue
        node, parts = TrainConfig(), key.split(".")
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node) or not hasattr(node, part):
                break
            node = getattr(node, part)
        else:
            if key in ("data.sources", "data.eval_sources"):
                sources += source_override_problems(key, arg.split("=", 1)[1])
            continue
        if not dataclasses.is_dataclass(node) and depth > 0 and parts[depth - 1] == "architecture":
            continue  # below model.architecture: a Hugging Face config field, checked when the config is built
        tree = given
        for part in parts[:-1]:
            tree = tree.setdefault(part, {})
        tree[parts[-1]] = None
    return unknown_key_problems(given) + sources


def source_override_problems(key: str, value: str) -> list[str]:
    """Entries of a data.sources / data.eval_sources override that are not sources (a mistyped key, a format
    no reader knows, a weight that is no number, a bare path), each named with a source's keys: Hydra would
    advise ``+data.sources`` or say only that it could not merge the override."""
    try:
        entries = OverridesParser.create().parse_override(f"{key}={value}").value()
    except Exception:  # not parsable: Hydra's message names where
        return []
    keys = [f.name for f in fields(SourceConfig)]
    valid = f"a source's keys are {', '.join(keys)}"
    if not isinstance(entries, list):
        return [f"{key} is a list of sources, e.g. {key}='[{{path: a.jsonl, weight: 3}}]' ({valid})"]
    problems = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} {entry!r} is not a source: write it as {{path: {entry}}} ({valid})")
            continue
        for name in entry:
            if name not in keys:
                near = difflib.get_close_matches(str(name), keys, n=1, cutoff=0.6)
                hint = f": did you mean {near[0]}?" if near else ""
                problems.append(f"unknown key {name} in {where}{hint} ({valid})")
        fmt = entry.get("format")
        if fmt is not None and fmt not in [f.value for f in DataFormat]:
            problems.append(
                f"{where} format {fmt!r}: set one of {', '.join(f.value for f in DataFormat)}, or leave it out "
                "(the source then has data.format)"
            )
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            problems.append(f"{where} weight {weight!r} is not a number: set e.g. weight: 3")
    return problems
