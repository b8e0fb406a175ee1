"""Tokenize once, store on disk, memory-map when training.

A cache entry is a directory named by a key: the SHA-256 of the data's bytes (every file a directory, a
glob or a saved dataset holds), of the tokenizer's
files and of the data settings (and of this module's format version). A changed file, tokenizer or
setting gives a new key, hence a rebuild; the same inputs reuse the entry. Entries are written to a
temporary directory and renamed, so a crash never leaves a half-written entry that looks complete.

    <cache_dir>/<key>/meta.json         settings, counts, shape
    <cache_dir>/<key>/input_ids.bin     int32 [N, seq_len]
    <cache_dir>/<key>/labels.bin        int32 [N, seq_len]
    <cache_dir>/<key>/position_ids.bin  int32 [N, seq_len]
    <cache_dir>/<key>/num_tokens.bin    int32 [N]           real (non-padding) tokens per row

A row with no label token (it can only arise from one-token documents) is dropped and counted: every
row trains something, so no micro-batch, and no optimizer step, has zero label tokens to divide by.

Ranks open the files with ``np.memmap``: pages are shared through the OS page cache, so the data
does not multiply with the number of ranks on a node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from data.packing import Row, pack_rows, pad_rows
from data.render import examples_of
from data.sources import (
    DataError,
    SourceStats,
    is_prepared,
    read_records,
    source_bytes,
    source_digest_files,
)
from models.files.pipeline_dir import TOKENIZER_FILES
from models.loss import IGNORE_INDEX

CACHE_VERSION = 3  # bump when the on-disk layout or the tokenization rules change (3: ShareGPT rows read)
ARRAYS = ("input_ids", "labels", "position_ids")  # int32 [N, seq_len] each
NUM_TOKENS = "num_tokens"  # int32 [N]
WRITE_ROWS = 1024  # rows buffered before a write
PROGRESS_EVERY_S = 5.0  # seconds between progress lines while tokenizing
HASH_CHUNK = 1 << 24  # 16 MiB reads while hashing


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Everything besides the file and the tokenizer that changes the tokenized result."""

    format: str
    max_seq_length: int
    packing: bool
    skip_bad_lines: bool
    pad_id: int
    vocab_size: int
    fields: tuple[tuple[str, str], ...] = ()  # data.fields: (our name, the source's column) pairs, sorted


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_key(path: str, settings: DataSettings, tokenizer_dir: str | None) -> str:
    """The entry's name: the source's bytes (every file it names, by name and content), the settings, the
    tokenizer's files and the format version."""
    h = hashlib.sha256()
    h.update(f"v{CACHE_VERSION}|{json.dumps(dataclasses.asdict(settings), sort_keys=True)}|".encode())
    files = source_digest_files(path)
    for f in files:
        h.update((os.path.relpath(f, path) if len(files) > 1 else "").encode() + file_sha256(f).encode())
    if settings.format != "tokens" and tokenizer_dir is not None:
        h.update(tokenizer_digest(tokenizer_dir).encode())
    return h.hexdigest()[:24]


def tokenizer_digest(tokenizer_dir: str) -> str:
    """SHA-256 over the tokenizer's files (names and bytes): what a prepared directory records."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            h.update(name.encode() + file_sha256(p).encode())
    return h.hexdigest()


def load_tokenizer(settings: DataSettings, tokenizer_dir: str | None):
    """The tokenizer a format needs (None for ``tokens``), checked against the model's embedding size."""
    if settings.format == "tokens":
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    problem = vocab_problem(len(tokenizer), settings.vocab_size, tokenizer_dir)
    if problem:
        raise DataError(problem)
    return tokenizer


def vocab_limit(tokens: int) -> int:
    """The most embedding rows a vocabulary chosen for a tokenizer of ``tokens`` tokens may have: its length rounded
    up to a multiple of 256, or a quarter more (Qwen's 151936 rows for 151665 tokens), whichever is larger."""
    return max(-(-tokens // 256) * 256, tokens + tokens // 4)


def vocab_problem(tokens: int, vocab_size: int, tokenizer_dir: str | None, where: str = "") -> str:
    """The model's embedding rows against its tokenizer's ``tokens``, "" when they fit: fewer rows than tokens (ids
    past the embedding); and where the vocabulary is chosen for the tokenizer (``where``: model.architecture, from
    scratch), many more (rows no token reads, each in every softmax of the loss and in the memory)."""
    if vocab_size < tokens:
        if where:
            return (
                f"{where}: vocab_size {vocab_size} is less than the {tokens} tokens of the tokenizer in "
                f"{tokenizer_dir}: set model.architecture.vocab_size={tokens} (or up to {vocab_limit(tokens)})"
            )
        return (
            f"the tokenizer in {tokenizer_dir} has {tokens} tokens but the model's embedding has {vocab_size} rows: "
            "use the model's own tokenizer, or resize the model"
        )
    if where and vocab_size > vocab_limit(tokens):
        return (
            f"{where}: vocab_size {vocab_size} is {vocab_size / tokens:.3g} x the {tokens} tokens of the tokenizer in "
            f"{tokenizer_dir}: the rows no token reads are trained towards zero probability in every softmax and "
            f"held in memory; set model.architecture.vocab_size={tokens}, or padded up to {vocab_limit(tokens)} (a "
            "multiple of 64 to 256 above it), or give the model's own tokenizer in model.tokenizer"
        )
    return ""


def tokenized_rows(records: Iterator, settings: DataSettings, tokenizer, stats: SourceStats) -> Iterator[Row]:
    """``(where, record)`` pairs (data.sources.read_records) -> the training rows of ``settings``."""
    examples = examples_of(
        records,
        settings.format,
        tokenizer,
        settings.max_seq_length,
        settings.vocab_size,
        settings.skip_bad_lines,
        stats,
    )
    return rows_of(examples, settings, stats)


def rows_of(examples: Iterator, settings: DataSettings, stats: SourceStats) -> Iterator[Row]:
    """Examples -> rows of ``max_seq_length``: packed (text documents may continue in the next row) or one each."""
    if settings.packing:
        return pack_rows(examples, settings.max_seq_length, settings.pad_id, settings.format == "text", stats)
    return pad_rows(examples, settings.max_seq_length, settings.pad_id, stats)


def build_or_reuse(
    path: str, settings: DataSettings, tokenizer_dir: str | None, cache_dir: str, log
) -> tuple[str, dict]:
    """(entry directory, meta) for ``path``; tokenizes only if no entry with this key exists."""
    start = time.time()
    if is_prepared(path):
        return path, check_prepared(path, settings, tokenizer_dir, log)
    entry = os.path.join(cache_dir, cache_key(path, settings, tokenizer_dir))
    if os.path.isfile(os.path.join(entry, "meta.json")):
        with open(os.path.join(entry, "meta.json")) as f:
            meta = json.load(f)
        log(
            f"reusing tokenized cache {entry} for {path} ({meta['num_samples']} samples; key took "
            f"{time.time() - start:.1f} s)"
        )
        return entry, meta

    tokenizer = load_tokenizer(settings, tokenizer_dir)
    stats = SourceStats()
    records = read_records(path, settings.format, settings.skip_bad_lines, stats, dict(settings.fields))
    rows = tokenized_rows(records, settings, tokenizer, stats)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{entry}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        num = write_rows(tmp, rows, stats, _progress(path, stats, log))
        if num == 0:
            raise DataError(_nothing_left(path, stats))
        elapsed = time.time() - start
        meta = {
            "source": os.path.abspath(path),
            "settings": dataclasses.asdict(settings),
            "num_samples": num,
            "seq_len": settings.max_seq_length,
            "stats": {k: v for k, v in dataclasses.asdict(stats).items() if k != "bytes_read"},
            "build_s": round(elapsed, 2),
            "tokens_per_s": round(stats.tokens / max(elapsed, 1e-9)),
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            named_write_errors(f, lambda: (f.write(json.dumps(meta, indent=2)), f.flush()))
        try:
            os.rename(tmp, entry)
        except OSError:  # another node's builder published the same entry first: identical content
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(
        f"tokenized {path}: {stats.lines} records -> {stats.examples} examples, {stats.tokens} tokens -> "
        f"{num} samples of {settings.max_seq_length} in {meta['build_s']:.1f} s ({meta['tokens_per_s']} tokens/s); "
        f"skipped bad lines {stats.skipped_bad_lines}, dropped without trainable tokens {stats.dropped_no_trainable}, "
        f"truncated {stats.truncated}, rows without a label token dropped {stats.rows_without_labels}"
    )
    for message in stats.bad_line_examples:
        log(f"  skipped: {message}")
    return entry, meta


def check_prepared(path: str, settings: DataSettings, tokenizer_dir: str | None, log) -> dict:
    """The meta of a directory made by scripts/prepare_data.py, refused (DataError) when it was made with other
    settings or another tokenizer than this run's, each difference named (:func:`prepared_mismatch`)."""
    meta, mismatch = prepared_mismatch(path, settings, tokenizer_dir)
    if mismatch:
        raise DataError(mismatch)
    log(
        f"reading prepared data {path}: {meta['num_samples']} samples of {meta['seq_len']} in {len(meta['shards'])} "
        f"shards, {meta['tokens']} tokens (no tokenizing)"
    )
    return meta


def prepared_mismatch(path: str, settings: DataSettings, tokenizer_dir: str | None) -> tuple[dict, str]:
    """(meta of a directory made by scripts/prepare_data.py, why this run cannot read it: "" when its settings and
    tokenizer are this run's). The one rule: train.py's config check (data.tokenize_settings.prepared_problems, so the
    preflight says it too) and the opening of the data (check_prepared) both ask it."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    made, wanted = meta["settings"], dataclasses.asdict(settings)
    wanted["fields"] = [list(f) for f in wanted["fields"]]  # as JSON holds it
    differ = [
        f"{PREPARED_KNOBS.get(k, k)} {made.get(k)!r} there, {wanted[k]!r} here"
        for k in wanted
        if k != "skip_bad_lines" and made.get(k) != wanted[k]
    ]
    if (
        settings.format != "tokens"
        and tokenizer_dir is not None
        and meta["tokenizer"] != tokenizer_digest(tokenizer_dir)
    ):
        differ.append(f"the tokenizer ({tokenizer_dir} here: other files)")
    if not differ:
        return meta, ""
    return meta, (
        f"{path} was prepared for another run: " + "; ".join(differ) + ". Prepare it again with this run's "
        "settings (python scripts/prepare_data.py with the same overrides), or set these to the prepared ones"
    )


# What each setting is called in the config, for the refusal of a prepared directory.
PREPARED_KNOBS = {
    "format": "data.format",
    "max_seq_length": "data.max_seq_length",
    "packing": "data.packing",
    "pad_id": "the pad id (the model's pad_token_id)",
    "vocab_size": "the model's vocab_size",
    "fields": "data.*_field",
}


def _nothing_left(path: str, stats: SourceStats) -> str:
    # The first skipped line's reason: without it, "every line skipped" hides why.
    first = f"; first skipped: {stats.bad_line_examples[0]}" if stats.bad_line_examples else ""
    return (
        f"{path}: no usable example ({stats.lines} records read, {stats.skipped_bad_lines} bad lines skipped, "
        f"{stats.dropped_no_trainable} dropped for having no trainable token, {stats.rows_without_labels} rows "
        f"without a label token dropped){first}"
    )


def _progress(path: str, stats: SourceStats, log):
    total = source_bytes(path)  # 0 for a saved dataset; dataset files are not counted in bytes
    state = {"last": time.time(), "start": time.time()}

    def report(rows: int) -> None:
        now = time.time()
        if now - state["last"] >= PROGRESS_EVERY_S:
            state["last"] = now
            rate = stats.tokens / (now - state["start"])
            done = f"{100 * stats.bytes_read / total:.1f}% | " if stats.bytes_read and total else ""
            log(
                f"tokenizing {os.path.basename(path)}: {done}{stats.lines} records | "
                f"{stats.tokens} tokens | {rows} samples | {rate:,.0f} tokens/s"
            )

    return report


def write_rows(directory: str, rows: Iterator[Row], stats: SourceStats, progress) -> int:
    files = {name: open(os.path.join(directory, f"{name}.bin"), "wb") for name in (*ARRAYS, NUM_TOKENS)}
    count, buffer = 0, []
    try:
        for row in rows:
            if all(label == IGNORE_INDEX for label in row[1][1:]):  # position 0 is never a target
                stats.rows_without_labels += 1
                continue
            buffer.append(row)
            if len(buffer) == WRITE_ROWS:
                count += _flush(files, buffer)
                progress(count)
        count += _flush(files, buffer)
    finally:
        for f in files.values():
            named_write_errors(f, f.close)
    return count


def named_write_errors(f, write) -> None:
    """``write()`` to file ``f``, whose failure (a full disk) names the file: a file object's error names none, and
    train.py's message names it (training/resilience/all_ranks.py's failure_text)."""
    try:
        write()
    except OSError as e:
        raise OSError(e.errno, e.strerror, f.name) from e


def _flush(files, buffer: list[Row]) -> int:
    if not buffer:
        return 0
    block = np.asarray([row[:3] for row in buffer], dtype=np.int32)  # [rows, 3, seq_len]
    for i, name in enumerate(ARRAYS):
        named_write_errors(files[name], lambda: files[name].write(block[:, i, :].tobytes()))
    counts = np.asarray([row[3] for row in buffer], dtype=np.int32).tobytes()
    named_write_errors(files[NUM_TOKENS], lambda: files[NUM_TOKENS].write(counts))
    n = len(buffer)
    buffer.clear()
    return n


class TokenBlocks(Dataset):
    """A cache entry, or a prepared directory of such entries (shards, scripts/prepare_data.py), memory-mapped;
    optionally a subset of its rows (an eval split). Rows are numbered across the shards in their order."""

    def __init__(self, entry: str, indices: np.ndarray | None = None):
        self.entry = entry
        with open(os.path.join(entry, "meta.json")) as f:
            self.meta = json.load(f)
        damaged = entry_files_problem(entry, self.meta)
        if damaged:
            raise DataError(damaged)
        shards = [os.path.join(entry, s["dir"]) for s in self.meta["shards"]] if "shards" in self.meta else [entry]
        self.shards = [_open_entry(d, self.meta["seq_len"]) for d in shards]
        self.offsets = np.cumsum([0] + [len(nt) for _, nt in self.shards])  # first row of each shard, then the end
        self.indices = indices

    @property
    def arrays(self) -> dict[str, np.memmap]:
        """The one shard's arrays (a cache entry; a prepared directory has one set per shard)."""
        if len(self.shards) != 1:
            raise ValueError(f"{self.entry} holds {len(self.shards)} shards: index rows instead")
        return self.shards[0][0]

    def subset(self, indices: np.ndarray) -> TokenBlocks:
        """The same entry restricted to ``indices`` (rows of the whole entry)."""
        return TokenBlocks(self.entry, indices)

    def __len__(self) -> int:
        return int(self.offsets[-1]) if self.indices is None else len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(i if self.indices is None else self.indices[i])
        shard = int(np.searchsorted(self.offsets, row, side="right")) - 1
        arrays, num_tokens = self.shards[shard]
        row -= int(self.offsets[shard])
        sample = {n: torch.from_numpy(a[row].astype(np.int64)) for n, a in arrays.items()}  # each [S]
        return {**sample, NUM_TOKENS: int(num_tokens[row])}

    def lengths(self) -> np.ndarray:
        """Real (non-padding) tokens of each of these rows, int32 [N] (data.group_by_length sorts by it)."""
        every = np.concatenate([np.asarray(nt) for _, nt in self.shards])
        return every if self.indices is None else every[self.indices]

    def total_tokens(self) -> int:
        """Real (non-padding) tokens in these rows."""
        return int(self.lengths().sum(dtype=np.int64))


def entry_files_problem(entry: str, meta: dict) -> str:
    """Why the files of a cache entry or a prepared directory (``meta``: its meta.json) do not hold the rows its
    meta.json counts: "" when every .bin file is there with its size (rows x seq_len x 4 bytes; num_tokens rows x 4).
    A cut file would otherwise be read as fewer rows (num_tokens) or fail when mapped, naming no file."""
    prepared = "shards" in meta
    fix = (
        "prepare the data again (python scripts/prepare_data.py)"
        if prepared
        else f"delete the cache entry {entry} (train.py tokenizes the data again)"
    )
    where = os.path.join(entry, "meta.json")
    seq_len = meta.get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        return f"{where} is damaged: seq_len is {seq_len!r}, not a positive whole number: {fix}"
    if prepared:
        shards = meta["shards"]
        if not isinstance(shards, list) or not all(isinstance(s, dict) and "dir" in s for s in shards):
            return f"{where} is damaged: its shards list is not a list of {{dir, num_samples}}: {fix}"
        parts = [
            (os.path.join(entry, s["dir"]), s.get("num_samples"), f"shard {s['dir']}'s num_samples") for s in shards
        ]
        total = meta.get("num_samples")
        if not isinstance(total, int) or isinstance(total, bool):
            return f"{where} is damaged: num_samples is {total!r}, not a whole number: {fix}"
    else:
        parts = [(entry, meta.get("num_samples"), "num_samples")]
    for directory, rows, what in parts:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            return f"{where} is damaged: {what} is {rows!r}, not a whole number: {fix}"
        if not os.path.isdir(directory):
            return f"{directory} is missing ({where} lists it): {fix}"
        for name, size in [(n, rows * seq_len * 4) for n in ARRAYS] + [(NUM_TOKENS, rows * 4)]:
            path = os.path.join(directory, f"{name}.bin")
            if not os.path.isfile(path):
                return f"{path} is missing ({where} counts {rows} rows there): {fix}"
            have = os.path.getsize(path)
            if have != size:
                return (
                    f"{path} holds {have} bytes, and {where} implies {size} ({rows} rows"
                    + (f" x {seq_len}" if name != NUM_TOKENS else "")
                    + f" x 4 bytes): the file is cut or damaged: {fix}"
                )
    return ""


def _open_entry(directory: str, seq_len: int) -> tuple[dict[str, np.memmap], np.memmap]:
    """One cache entry's arrays, mapped: (input_ids, labels, position_ids [N, seq_len]), num_tokens [N]."""
    num_tokens = np.memmap(os.path.join(directory, f"{NUM_TOKENS}.bin"), dtype=np.int32, mode="r")
    shape = (len(num_tokens), seq_len)
    arrays = {n: np.memmap(os.path.join(directory, f"{n}.bin"), dtype=np.int32, mode="r", shape=shape) for n in ARRAYS}
    return arrays, num_tokens
