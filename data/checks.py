"""The rules of the ``data.*`` settings, beside the code that reads the data: checked before start, with
every other problem, by ``training.config.resolve``."""

from __future__ import annotations

import os

from data.sources import FIELD_NAMES, first_record_problems, source_problems

LOADABLE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # either lets AutoTokenizer load a tokenizer


def default_packing(data) -> bool:
    """``data.packing``, or its default: packing for raw text, one example per row otherwise."""
    return data.packing if data.packing is not None else data.format == "text"


def field_names(data) -> dict[str, str]:
    """Each field the formats read -> the source's column holding it (``data.<field>_field``)."""
    return {name: getattr(data, f"{name}_field") for name in FIELD_NAMES if name != "conversations"}


def usable_source_problems(path: str, fmt: str, fields: dict[str, str]) -> list[str]:
    """A source that names no data, or whose first record cannot be read as ``fmt``."""
    return source_problems(path) or first_record_problems(path, fmt, fields)


def mixture_problems(d, fields: dict[str, str]) -> list[str]:
    """data.sources and data.eval_sources: every source usable, weights > 0, names distinct, and no other
    eval setting beside eval_sources."""
    problems = []
    for key, sources in (("sources", d.sources), ("eval_sources", d.eval_sources)):
        names = []
        for i, source in enumerate(sources):
            where = f"data.{key}[{i}]"
            if not source.path:
                problems.append(f"{where} has no path: give each source its path (a file, directory, glob or dataset)")
                continue
            names.append(source.name or os.path.basename(source.path.rstrip("/")) or source.path)
            problems += [f"{where} {p}" for p in usable_source_problems(source.path, source.format or d.format, fields)]
            if key == "sources" and not source.weight > 0:
                problems.append(
                    f"{where} ({names[-1]}) has weight {source.weight}: weights must be > 0 (drop the source)"
                )
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"data.{key}: the name(s) {', '.join(twice)} name several sources: give each a name")
    if d.eval_sources and (d.eval_file or d.eval_fraction > 0):
        problems.append("data.eval_sources with data.eval_file or data.eval_fraction: use one way to name eval data")
    if d.sources and d.eval_fraction > 0:
        problems.append(
            "data.eval_fraction splits data.train_file, not a mixture: name eval data with data.eval_sources"
        )
    return problems


def data_problems(cfg) -> list[str]:
    """The data settings' problems (``cfg``: training.config.TrainConfig), named with the fix."""
    d, problems = cfg.data, []
    fields = field_names(d)
    if not d.train_file and not d.sources:
        problems.append("data.train_file is not set: set data.train_file=PATH (or a mixture: data.sources=[...])")
    if d.train_file and d.sources:
        problems.append("data.train_file and data.sources are both set: use one (a mixture lists every file)")
    for key in ("train_file", "eval_file"):
        path = getattr(d, key)
        if path:
            problems += [f"data.{key} {p}" for p in usable_source_problems(path, d.format, fields)]
    problems += mixture_problems(d, fields)
    empty = [f"data.{ours}_field" for ours, theirs in fields.items() if not theirs.strip()]
    if empty:
        problems.append(f"{', '.join(empty)} empty: set each to the source's column name (or leave its default)")
    taken = [theirs for theirs in fields.values() if list(fields.values()).count(theirs) > 1]
    if taken:
        problems.append(
            f"data.*_field: the column {taken[0]!r} is named for two fields: "
            + ", ".join(f"data.{ours}_field={theirs}" for ours, theirs in fields.items())
        )
    if not 0.0 <= d.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction {d.eval_fraction} must be in [0, 1)")
    if d.eval_fraction > 0 and d.eval_file:
        problems.append("data.eval_file and data.eval_fraction are both set: use one (set the other to its default)")
    if d.pad_to_multiple_of < 0:
        problems.append(
            f"data.pad_to_multiple_of {d.pad_to_multiple_of} < 0: set it to 8 or 64 (each micro-batch padded to its "
            "longest row, rounded up), or 0 (every row max_seq_length long)"
        )
    if d.order_check_steps < 0:
        problems.append(f"data.order_check_steps {d.order_check_steps} < 0: set it >= 0 (0 = off)")
    model_dir = cfg.model_name_or_path or cfg.model.tokenizer  # the tokenizer the run loads
    if (
        d.format in ("text", "sft")
        and cfg.model_name_or_path
        and not any(os.path.isfile(os.path.join(model_dir, f)) for f in LOADABLE_TOKENIZER_FILES)
    ):
        problems.append(
            f"data.format={d.format} tokenizes with the model's tokenizer, but {model_dir} has none "
            f"({' or '.join(LOADABLE_TOKENIZER_FILES)}): copy the tokenizer files there"
        )
    return problems
