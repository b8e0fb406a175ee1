"""The rules of the ``data.*`` settings, beside the code that reads the data: checked before start, with
every other problem, by ``training.configuration.validate.resolve``."""

from __future__ import annotations

import os

from data.sources import FIELD_NAMES, SourceRef, first_record_problems, source_problems

LOADABLE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # either lets AutoTokenizer load a tokenizer


def packs(data, fmt: str) -> bool:
    """Whether a source of format ``fmt`` is packed: ``data.packing``, or its default: packing for raw text, one
    example per row otherwise."""
    return data.packing if data.packing is not None else fmt == "text"


def default_packing(data) -> bool:
    """Whether every training row is packed (each source by its own format's default, :func:`packs`)."""
    return all(packs(data, fmt) for _, fmt in source_formats(data, evals=False))


def source_formats(data, evals: bool = True) -> list[tuple[str, str]]:
    """(where, format) of each source the run reads (``evals``: eval sources too): data.format for
    data.train_file and data.eval_file (where ""), each mixture source's own format (where ``data.sources[i]
    (path)``); a rule on data.format holds for each of them."""
    keys = ("sources", "eval_sources") if evals else ("sources",)
    return [("", str(data.format))] * (not data.sources) + [
        (f"data.{key}[{i}] ({source.path})", str(source.format or data.format))
        for key in keys
        for i, source in enumerate(getattr(data, key))
    ]


def field_names(data) -> dict[str, str]:
    """Each field the formats read -> the source's column holding it (``data.<field>_field``)."""
    return {name: getattr(data, f"{name}_field") for name in FIELD_NAMES if name != "conversations"}


def usable_source_problems(path: str, fmt: str, fields: dict[str, str], source: SourceRef | None = None) -> list[str]:
    """A source that names no data, or whose first record cannot be read as ``fmt`` (``source``: a mixture's)."""
    return source_problems(path) or first_record_problems(path, fmt, fields, source)


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
            fmt, ref = str(source.format or d.format), SourceRef(source.path, source.format is not None)
            problems += [f"{where} {p}" for p in usable_source_problems(source.path, fmt, fields, ref)]
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
    """The data settings' problems (``cfg``: training.configuration.schema.TrainConfig), named with the fix."""
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
    tokenized = [(where, fmt) for where, fmt in source_formats(d) if fmt != "tokens"]
    if (
        tokenized
        and cfg.model_name_or_path
        and not any(os.path.isfile(os.path.join(model_dir, f)) for f in LOADABLE_TOKENIZER_FILES)
    ):
        which = ", ".join(f"{where} format {fmt}" if where else f"data.format={fmt}" for where, fmt in tokenized)
        problems.append(
            f"{which} {'tokenizes' if len(tokenized) == 1 else 'tokenize'} with the model's tokenizer, but "
            f"{model_dir} has none ({' or '.join(LOADABLE_TOKENIZER_FILES)}): copy the tokenizer files there"
        )
    return problems
