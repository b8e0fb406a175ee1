"""Tokenize once, store on disk, memory-map when training.

A cache entry is a directory named by a key: the SHA-256 of the data file's bytes, of the tokenizer's
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
from data.sources import DataError, SourceStats, read_examples
from models.layer_files import TOKENIZER_FILES
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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_key(path: str, settings: DataSettings, tokenizer_dir: str | None) -> str:
    h = hashlib.sha256()
    h.update(f"v{CACHE_VERSION}|{json.dumps(dataclasses.asdict(settings), sort_keys=True)}|".encode())
    h.update(file_sha256(path).encode())
    if settings.format != "tokens" and tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            p = os.path.join(tokenizer_dir, name)
            if os.path.isfile(p):
                h.update(name.encode() + file_sha256(p).encode())
    return h.hexdigest()[:24]


def build_or_reuse(
    path: str, settings: DataSettings, tokenizer_dir: str | None, cache_dir: str, log
) -> tuple[str, dict]:
    """(entry directory, meta) for ``path``; tokenizes only if no entry with this key exists."""
    start = time.time()
    entry = os.path.join(cache_dir, cache_key(path, settings, tokenizer_dir))
    if os.path.isfile(os.path.join(entry, "meta.json")):
        with open(os.path.join(entry, "meta.json")) as f:
            meta = json.load(f)
        log(
            f"reusing tokenized cache {entry} for {path} ({meta['num_samples']} samples; key took "
            f"{time.time() - start:.1f} s)"
        )
        return entry, meta

    tokenizer = None
    if settings.format != "tokens":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(tokenizer) > settings.vocab_size:
            raise DataError(
                f"the tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens but the model's embedding has "
                f"{settings.vocab_size} rows: use the model's own tokenizer, or resize the model"
            )
    stats = SourceStats()
    examples = read_examples(
        path, settings.format, tokenizer, settings.max_seq_length, settings.vocab_size, settings.skip_bad_lines, stats
    )
    if settings.packing:
        rows = pack_rows(
            examples, settings.max_seq_length, settings.pad_id, split=settings.format == "text", stats=stats
        )
    else:
        rows = pad_rows(examples, settings.max_seq_length, settings.pad_id, stats)

    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{entry}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        num = _write_rows(tmp, rows, stats, _progress(path, stats, log))
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
            json.dump(meta, f, indent=2)
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


def _nothing_left(path: str, stats: SourceStats) -> str:
    # The first skipped line's reason: without it, "every line skipped" hides why.
    first = f"; first skipped: {stats.bad_line_examples[0]}" if stats.bad_line_examples else ""
    return (
        f"{path}: no usable example ({stats.lines} records read, {stats.skipped_bad_lines} bad lines skipped, "
        f"{stats.dropped_no_trainable} dropped for having no trainable token, {stats.rows_without_labels} rows "
        f"without a label token dropped){first}"
    )


def _progress(path: str, stats: SourceStats, log):
    total = max(os.path.getsize(path), 1)
    state = {"last": time.time(), "start": time.time()}

    def report(rows: int) -> None:
        now = time.time()
        if now - state["last"] >= PROGRESS_EVERY_S:
            state["last"] = now
            rate = stats.tokens / (now - state["start"])
            log(
                f"tokenizing {os.path.basename(path)}: {100 * stats.bytes_read / total:.1f}% | {stats.lines} records | "
                f"{stats.tokens} tokens | {rows} samples | {rate:,.0f} tokens/s"
            )

    return report


def _write_rows(directory: str, rows: Iterator[Row], stats: SourceStats, progress) -> int:
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
            f.close()
    return count


def _flush(files, buffer: list[Row]) -> int:
    if not buffer:
        return 0
    block = np.asarray([row[:3] for row in buffer], dtype=np.int32)  # [rows, 3, seq_len]
    for i, name in enumerate(ARRAYS):
        files[name].write(block[:, i, :].tobytes())
    files[NUM_TOKENS].write(np.asarray([row[3] for row in buffer], dtype=np.int32).tobytes())
    n = len(buffer)
    buffer.clear()
    return n


class TokenBlocks(Dataset):
    """A cache entry, memory-mapped; optionally a subset of its rows (an eval split)."""

    def __init__(self, entry: str, indices: np.ndarray | None = None):
        self.entry = entry
        with open(os.path.join(entry, "meta.json")) as f:
            self.meta = json.load(f)
        shape = (self.meta["num_samples"], self.meta["seq_len"])
        self.arrays = {
            n: np.memmap(os.path.join(entry, f"{n}.bin"), dtype=np.int32, mode="r", shape=shape) for n in ARRAYS
        }
        self.num_tokens = np.memmap(os.path.join(entry, f"{NUM_TOKENS}.bin"), dtype=np.int32, mode="r", shape=shape[:1])
        self.indices = indices

    def subset(self, indices: np.ndarray) -> TokenBlocks:
        """The same entry restricted to ``indices`` (rows of the whole entry)."""
        return TokenBlocks(self.entry, indices)

    def __len__(self) -> int:
        return self.meta["num_samples"] if self.indices is None else len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(i if self.indices is None else self.indices[i])
        sample = {n: torch.from_numpy(a[row].astype(np.int64)) for n, a in self.arrays.items()}  # each [S]
        return {**sample, NUM_TOKENS: int(self.num_tokens[row])}

    def total_tokens(self) -> int:
        """Real (non-padding) tokens in these rows."""
        rows = self.num_tokens if self.indices is None else self.num_tokens[self.indices]
        return int(rows.sum(dtype=np.int64))
