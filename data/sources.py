"""Finding and reading training sources: the files ``data.train_file`` (or a mixture's entry) names (a file, a
directory, a glob, a saved dataset, a prepared directory), their records streamed with where each came from
(``FILE:LINE``, ``FILE row N``), and the problems found before start (nothing there, an empty file, columns a
format cannot read). Turning records into token rows is data/render.py's job.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from data.records import DataError, SourceStats, WholeFileError


def read_records(
    spec: str,
    fmt: str,
    skip_bad_lines: bool,
    stats: SourceStats,
    fields: dict[str, str] | None = None,
    part: Part | None = None,
) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of every file ``spec`` names (:func:`source_files`): a parsed JSON
    object or a dataset row (a dict), or a document string for .txt; ``where`` is ``FILE:LINE`` (JSONL,
    .txt) or ``FILE row N`` (parquet, arrow, JSON, a saved dataset). ``fields`` renames columns: ``{"text":
    "content"}`` reads a row's ``content`` as its ``text`` (data.text_field=content). ``part``: only that
    piece of ``spec`` (data/prepare.py's pieces)."""
    rename = _renames(fields)
    if part is not None and spec.endswith(".jsonl") and part.end >= 0:
        records = _jsonl_or_txt_records(spec, fmt, skip_bad_lines, stats, part)
    else:
        records = _raw_records(spec, fmt, skip_bad_lines, stats, rename, rows=part)
    for where, record in records:
        if rename and isinstance(record, dict):
            record = {rename.get(k, k): v for k, v in record.items() if _kept(k, rename)}
        yield where, record


def _renames(fields: dict[str, str] | None) -> dict[str, str]:
    """The source's column -> the field it holds, for the columns ``fields`` names otherwise."""
    return {theirs: ours for ours, theirs in (fields or {}).items() if theirs != ours}


def _kept(column: str, rename: dict[str, str]) -> bool:
    """Whether a column is read: not one named like a field that ``rename`` reads from another column (with
    data.text_field=body a 'text' column is never the text, whatever the column order)."""
    return column in rename or column not in rename.values()


def _raw_records(
    spec: str, fmt: str, skip_bad_lines: bool, stats: SourceStats, rename, rows: Part | None = None
) -> Iterator[tuple[str, object]]:
    if is_saved_dataset(spec):
        dataset = saved_dataset(spec)
        _check_columns(spec, dataset.column_names, fmt, rename)
        start = 0
        if rows is not None and rows.end >= 0:
            start, dataset = rows.start, dataset.select(range(rows.start, rows.end))
        for i, row in enumerate(dataset, start):
            yield f"{spec} row {i}", row
        return
    for path in source_files(spec):
        if path.endswith((".jsonl", ".txt")):
            yield from _jsonl_or_txt_records(path, fmt, skip_bad_lines, stats)
        else:
            yield from _dataset_file_records(path, fmt, rename)


def _jsonl_or_txt_records(
    path: str, fmt: str, skip_bad_lines: bool, stats: SourceStats, part: Part | None = None
) -> Iterator[tuple[str, object]]:
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty")
    with open(path, "rb") as f:
        if path.endswith(".txt"):
            if fmt != "text":
                raise WholeFileError(_txt_problem(path, fmt))
            yield from _txt_documents(path, f, skip_bad_lines, stats)
            return
        lines = f
        if part is not None:  # a byte range of whole lines (data/prepare.py's units)
            f.seek(part.start)
            lines = iter(lambda: f.readline() if f.tell() < part.end else b"", b"")
        for lineno, raw in enumerate(lines, part.first_line if part else 1):
            stats.bytes_read += len(raw)
            if not raw.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(_decode(path, lineno, raw))
            except DataError as e:
                bad_line(e, skip_bad_lines, stats)
            except json.JSONDecodeError as e:
                error = DataError(f"{path}:{lineno}: malformed JSON ({e.msg}, column {e.colno})")
                bad_line(error, skip_bad_lines, stats)


def _dataset_file_records(path: str, fmt: str, rename, source: SourceRef | None = None) -> Iterator[tuple[str, dict]]:
    """Rows of a parquet, arrow or JSON file through Hugging Face ``datasets``, streamed (nothing converted
    or cached on disk, nothing held whole in memory)."""
    from datasets import load_dataset

    kind = DATASET_SUFFIXES[os.path.splitext(path)[1]]
    try:
        rows = load_dataset(kind, data_files=[path], split="train", streaming=True)
        first = True
        for i, row in enumerate(rows):
            if first:
                _check_columns(path, list(row), fmt, rename, source=source)
                first = False
            yield f"{path} row {i}", row
    except (DataError, GeneratorExit):
        raise
    except Exception as e:  # pyarrow's and datasets' own errors name neither the file nor the cause plainly
        raise WholeFileError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {first_line(e)})") from None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


# data.<name>_field
FIELD_NAMES = ("text", "prompt", "response", "messages", "conversations", "input_ids", "chosen", "rejected")
# The fields each format reads (sft: one of the layouts), for the column check of dataset sources.
FORMAT_FIELDS = {
    "tokens": ("input_ids",),
    "text": ("text",),
    "sft": ("prompt", "messages", "conversations"),
    "dpo": ("chosen",),
    "grpo": ("prompt",),  # text or messages; the other columns go to the reward functions (data/prompts.py)
}


@dataclass(frozen=True)
class SourceRef:
    """A source of a mixture (an entry of data.sources or data.eval_sources), for advice that concerns that
    source alone: ``path`` as written, and whether it sets its own ``format`` (else data.format is its)."""

    path: str
    own_format: bool = False

    def format_fix(self, fmt: str) -> str:
        return f"give this source its own format ({{path: {self.path}, format: {fmt}}})"


def _check_columns(
    where: str,
    columns: list[str],
    fmt: str,
    rename: dict[str, str],
    found: str = "its columns are",
    source: SourceRef | None = None,
) -> None:
    """A dataset source whose columns lack a column a data.<field>_field names, or hold none of the format's
    fields, is refused before any row is read. ``source``: a mixture's source (the fix is its own format)."""
    missing = _missing_named_fields(columns, fmt, rename)
    if missing:
        names = ", ".join(f"data.{ours}_field={theirs}" for ours, theirs in missing)
        fixes = " and ".join(
            f"data.{ours}_field to the column holding the {ours}"
            + (f" (or drop it to read '{ours}')" if ours in columns else "")
            for ours, _ in missing
        )
        it = "names a column that is" if len(missing) == 1 else "name columns that are"
        raise WholeFileError(f"{where}: {names} {it} not there ({found} {', '.join(columns)}): set {fixes}")
    ours = {rename.get(c, c) for c in columns if _kept(c, rename)}
    if not ours & set(FORMAT_FIELDS[fmt]):
        mapped = {v: k for k, v in rename.items()}
        wanted = " or ".join(f"'{mapped.get(f, f)}'" for f in FORMAT_FIELDS[fmt])
        other = next((f for f, names in FORMAT_FIELDS.items() if f != fmt and ours & set(names)), None)
        field = f"data.{FORMAT_FIELDS[fmt][0]}_field"
        rename_fix = f"name the column with {field} (e.g. {field}={columns[0]})"
        if source and other:  # its own format; data.*_field and data.format hold for every source
            fix = source.format_fix(other)
        elif source:
            fix = f"{rename_fix}, which names it in every source"
        else:
            fix = f"set data.format={other}, or {rename_fix}" if other else rename_fix
        setting = f"its format {fmt}" if source and source.own_format else f"data.format={fmt}"
        raise WholeFileError(f"{where}: {setting} reads a {wanted} column, and {found} {', '.join(columns)}: {fix}")


# The fields each format reads from a row (sft: those of the row's layout, :func:`_missing_named_fields`).
FORMAT_READS = {
    "tokens": ("input_ids",),
    "text": ("text",),
    "dpo": ("prompt", "chosen", "rejected"),
    "grpo": ("prompt",),
}


def _missing_named_fields(columns: list[str], fmt: str, rename: dict[str, str]) -> list[tuple[str, str]]:
    """(field, column) of each data.<field>_field=column the user set, read by ``fmt``, and not among
    ``columns``: never read as the field's default column instead. An SFT row's layout decides which of its
    fields are read: a chat (messages, conversations) or a prompt/response pair."""
    named = {ours: theirs for theirs, ours in rename.items()}
    reads = FORMAT_READS.get(fmt, ())
    if fmt == "sft":
        if {named.get("messages", "messages"), "conversations"} & set(columns):
            reads = ()  # a chat: found
        elif {named.get("prompt", "prompt"), named.get("response", "response")} & set(columns):
            reads = ("prompt", "response")
        else:
            reads = ("prompt", "response", "messages")
    return [(ours, named[ours]) for ours in reads if ours in named and named[ours] not in columns]


DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
DATA_SUFFIXES = (".jsonl", ".txt", *DATASET_SUFFIXES)


def saved_dataset(spec: str):
    """The ``datasets.Dataset`` a ``save_to_disk`` directory holds, memory-mapped (a DatasetDict's train split)."""
    from datasets import load_from_disk

    dataset = load_from_disk(spec)
    if hasattr(dataset, "keys"):
        if "train" not in dataset:
            raise WholeFileError(f"{spec}: a saved DatasetDict without a 'train' split (it has {list(dataset)})")
        dataset = dataset["train"]
    return dataset


def _prepared_meta(spec: str) -> dict:
    """A prepared directory's ``meta.json``; one that is not a JSON object raises ValueError naming it."""
    path = os.path.join(spec, "meta.json")
    with open(path) as f:
        try:
            meta = json.load(f)
        except ValueError as e:
            raise ValueError(
                f"{path}: not valid JSON ({e}): copy the prepared directory again, or prepare it again "
                "(scripts/prepare_data.py)"
            ) from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object: copy the prepared directory again, or prepare it again")
    return meta


def is_prepared(spec: str) -> bool:
    """A directory made by scripts/prepare_data.py (data/prepare.py): tokenized shards, read as they are."""
    meta = os.path.join(spec, "meta.json")
    if not os.path.isfile(meta):
        return False
    return bool(_prepared_meta(spec).get("prepared"))


def is_saved_dataset(spec: str) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return os.path.isdir(spec) and any(
        os.path.isfile(os.path.join(spec, f)) for f in ("state.json", "dataset_dict.json")
    )


def source_files(spec: str) -> list[str]:
    """The data files ``data.train_file`` names, sorted: a file, a directory's files (.jsonl, .txt, .json,
    .parquet, .arrow; not its subdirectories), or a glob's matches; DataError when it names none."""
    if os.path.isfile(spec):
        return [spec]
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(DATA_SUFFIXES))
        if not files:
            if any(f.startswith("shard-") and os.path.isdir(os.path.join(spec, f)) for f in os.listdir(spec)):
                raise WholeFileError(
                    f"{spec}: looks like a directory made by scripts/prepare_data.py (it has shard-* directories) "
                    "missing its meta.json: prepare the data again (python scripts/prepare_data.py)"
                )
            raise WholeFileError(f"{spec}: a directory without data files ({', '.join(DATA_SUFFIXES)})")
        return files
    if glob.has_magic(spec):
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
        if not files:
            raise WholeFileError(f"{spec}: the pattern matches no file")
        return files
    raise WholeFileError(f"{spec} does not exist")


def source_problems(spec: str) -> list[str]:
    """What is wrong with a ``data.train_file``/``eval_file`` before anything is read: nothing there, or
    files of a kind no format reads (named with the kinds that are read)."""
    if is_saved_dataset(spec) or (os.path.isdir(spec) and is_prepared(spec)):
        return []
    try:
        files = source_files(spec)
    except DataError as e:
        return [str(e)]
    odd = [f for f in files if not f.endswith(DATA_SUFFIXES)]
    if odd:
        return [f"{odd[0]}: not a data file this reads ({', '.join(DATA_SUFFIXES)}, or a saved dataset directory)"]
    return []


def first_record_problems(
    spec: str, fmt: str, fields: dict[str, str] | None = None, source: SourceRef | None = None
) -> list[str]:
    """A source whose first file is empty or a .txt file of another format than text, or whose first record (a
    dataset's columns) lacks a column a data.<field>_field names or holds none of the format's fields: found
    before start by reading one record, not after tokenizing on one rank. For a source :func:`source_problems`
    accepts; ``source``: a mixture's, whose fixes are its own."""
    rename = _renames(fields)
    if is_prepared(spec):
        return _prepared_format_problems(spec, fmt, source)  # read as it is: its other settings checked at start
    try:
        if is_saved_dataset(spec):
            _check_columns(spec, saved_dataset(spec).column_names, fmt, rename, source=source)
            return []
        path = source_files(spec)[0]
        if os.path.getsize(path) == 0:
            return [f"{path}: file is empty"]
        if path.endswith(".txt"):
            return [] if fmt == "text" else [_txt_problem(path, fmt, source)]
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                line = next((raw for raw in f if raw.strip()), b"")
            if not line:
                return [f"{path}: holds no record (only blank lines)"]
            try:
                record = json.loads(line)
            except ValueError:
                return []  # a malformed line: the reader names it with its line number
            if isinstance(record, dict):
                _check_columns(path, list(record), fmt, rename, "its first record's keys are", source)
            return []
        next(iter(_dataset_file_records(path, fmt, rename, source)), None)
    except WholeFileError as e:
        return [str(e)]
    return []


def _prepared_format_problems(spec: str, fmt: str, source: SourceRef | None) -> list[str]:
    """A prepared directory (data/prepare.py) of another format than the one it is read as."""
    made = _prepared_meta(spec).get("settings", {}).get("format")
    if made in (None, fmt):
        return []
    setting, fix = (
        ("this source's format", source.format_fix(made)) if source else ("data.format", f"set data.format={made}")
    )
    return [f"{spec}: prepared as format {made}, and {setting} is {fmt}: {fix}, or prepare it again as {fmt}"]


def _txt_problem(path: str, fmt: str, source: SourceRef | None = None) -> str:
    if source:
        return f"{path}: .txt files hold raw text, and this source's format is {fmt}: {source.format_fix('text')}"
    return f"{path}: .txt files hold raw text; use data.format=text or a .jsonl file"


def source_bytes(spec: str) -> int:
    """Bytes of the files ``spec`` names (progress through the JSONL and .txt ones is counted in bytes)."""
    if is_saved_dataset(spec):
        return 0
    return sum(os.path.getsize(f) for f in source_files(spec))


def source_digest_files(spec: str) -> list[str]:
    """Every file whose bytes make the source: the cache key hashes them."""
    if is_saved_dataset(spec):
        return sorted(os.path.join(root, f) for root, _, names in os.walk(spec) for f in names)
    return source_files(spec)


def _decode(path: str, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        ) from None


def _txt_documents(path: str, f, skip_bad_lines: bool, stats: SourceStats) -> Iterator[tuple[str, str]]:
    """Documents of a .txt file: runs of non-empty lines, separated by blank lines."""
    lines, start = [], 0
    for lineno, raw in enumerate(f, 1):
        stats.bytes_read += len(raw)
        try:
            text = _decode(path, lineno, raw)
        except DataError as e:
            bad_line(e, skip_bad_lines, stats)
            continue
        if text.strip():
            if not lines:
                start = lineno
            lines.append(text)
        elif lines:
            yield f"{path}:{start}", "".join(lines).strip("\n")
            lines = []
    if lines:
        yield f"{path}:{start}", "".join(lines).strip("\n")


def bad_line(error: DataError, skip: bool, stats: SourceStats) -> None:
    """A bad record (data/render.py's rows too): raised with the data.skip_bad_lines hint, or with ``skip``
    counted; a WholeFileError is raised whatever ``skip`` says."""
    if isinstance(error, WholeFileError):
        raise error
    message = str(error)
    if not skip:
        raise DataError(message + " (set data.skip_bad_lines=true to skip and count such lines)") from None
    stats.skipped_bad_lines += 1
    if len(stats.bad_line_examples) < 5:
        stats.bad_line_examples.append(message)


@dataclass(frozen=True)
class Part:
    """A piece of a source that one tokenizing worker reads (data/prepare.py): a JSONL file's lines from byte
    ``start`` (line ``first_line``) to byte ``end``, a saved dataset's rows ``start``..``end``, or a whole file
    (``end`` -1)."""

    path: str
    start: int = 0
    end: int = -1
    first_line: int = 1
