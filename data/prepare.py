"""Offline tokenization (scripts/prepare_data.py): a source -> a prepared directory, tokenized by N worker processes.

    OUT/meta.json          {"prepared": 1, source, settings, tokenizer (SHA-256 of its files), shards, totals}
    OUT/shard-00000/       one cache entry (data/cache.py's files and meta) per piece of the source
    ...

The source is cut into pieces that do not depend on the number of workers: one per file, a JSONL file into
whole-line byte ranges of ``PIECE_BYTES``, a saved dataset into runs of ``PIECE_ROWS`` rows. Each worker
tokenizes whole pieces into shards; packing works within a piece (at most one partly filled row per shard).
The result is therefore the same with 1 or 16 workers. A training run pointed at OUT (``data.train_file=OUT``)
reads the shards as they are and refuses them if they were made with other data settings or another tokenizer
(data.cache.check_prepared).

Written here rather than with ``datasets.map(num_proc=N)``: that builds Arrow files of Python lists (several
times our int32 rows), keyed by a fingerprint of the function rather than the tokenizer's files, and cannot
pack across examples; the reading and tokenizing are the same code as the in-job cache (data/sources.py,
data/render.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable

from data.cache import PROGRESS_EVERY_S, load_tokenizer, tokenized_rows, tokenizer_digest, write_rows
from data.sources import (
    DataError,
    Part,
    SourceStats,
    is_saved_dataset,
    read_records,
    saved_dataset,
    source_files,
)

PIECE_BYTES = 16 * 2**20  # a JSONL file is cut into whole-line ranges of about this many bytes
PIECE_ROWS = 100_000  # a saved dataset into runs of this many rows
SCAN_CHUNK = 16 * 2**20


def pieces(spec: str, piece_bytes: int | None = None, piece_rows: int | None = None) -> list[Part]:
    """The pieces of ``spec``, in the source's order (sizes: ``PIECE_BYTES`` and ``PIECE_ROWS`` by default)."""
    piece_bytes, piece_rows = piece_bytes or PIECE_BYTES, piece_rows or PIECE_ROWS
    if is_saved_dataset(spec):
        n = len(saved_dataset(spec))
        return [Part(spec, start, min(start + piece_rows, n)) for start in range(0, n, piece_rows)]
    out = []
    for path in source_files(spec):
        out += _line_ranges(path, piece_bytes) if path.endswith(".jsonl") else [Part(path)]
    return out


def _line_ranges(path: str, piece_bytes: int) -> list[Part]:
    """Whole-line byte ranges of about ``piece_bytes`` each, with the line number each starts at."""
    size, cuts = os.path.getsize(path), [0]
    with open(path, "rb") as f:
        while cuts[-1] + piece_bytes < size:
            f.seek(cuts[-1] + piece_bytes)
            f.readline()  # to the end of the line the target falls in
            if f.tell() >= size:
                break
            cuts.append(f.tell())
        cuts.append(size)
        f.seek(0)
        parts, lines = [], 0
        for a, b in zip(cuts, cuts[1:]):
            parts.append(Part(path, a, b, lines + 1))
            while a < b:  # count the range's lines: the next range's first line number
                chunk = f.read(min(SCAN_CHUNK, b - a))
                lines, a = lines + chunk.count(b"\n"), a + len(chunk)
    return parts


def weight(part: Part) -> int:
    """A piece's share of the work, for the progress line: bytes, or rows of a saved dataset."""
    return part.end - part.start if part.end >= 0 else os.path.getsize(part.path)


@functools.lru_cache(maxsize=1)
def _tokenizer(settings, tokenizer_dir: str | None):
    """A worker's tokenizer, loaded once for all the pieces it tokenizes."""
    return load_tokenizer(settings, tokenizer_dir)


def _prepare_piece(task: tuple) -> dict:
    """Worker: tokenize one piece into OUT/shard-<index>; returns its row count and statistics."""
    index, part, settings, tokenizer_dir, out = task
    tokenizer = _tokenizer(settings, tokenizer_dir)
    stats = SourceStats()
    records = read_records(part.path, settings.format, settings.skip_bad_lines, stats, dict(settings.fields), part)
    name = f"shard-{index:05d}"
    directory = os.path.join(out, name)
    os.makedirs(directory, exist_ok=True)
    count = write_rows(directory, tokenized_rows(records, settings, tokenizer, stats), stats, lambda rows: None)
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump({"num_samples": count, "seq_len": settings.max_seq_length}, f)
    if count == 0:
        shutil.rmtree(directory)
    stats_dict = {k: v for k, v in dataclasses.asdict(stats).items() if k != "bytes_read"}
    return {"dir": name, "num_samples": count, "stats": stats_dict}


def prepare(
    spec: str, settings, tokenizer_dir: str | None, out: str, workers: int, log: Callable[[str], None] = print
) -> dict:
    """Tokenize ``spec`` into ``out`` with ``workers`` processes; returns the written meta. ``out`` is written
    under a temporary name and renamed at the end: an interrupted run leaves no directory that looks complete."""
    if os.path.exists(out):
        raise DataError(f"{out} exists: remove it, or choose another output directory")
    load_tokenizer(settings, tokenizer_dir)  # a tokenizer that cannot work fails here, once, not in every worker
    parts = pieces(spec)
    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    start, done, tokens, shards = time.time(), 0, 0, []
    total, last = sum(map(weight, parts)), start
    tasks = [(i, part, settings, tokenizer_dir, tmp) for i, part in enumerate(parts)]
    try:
        # spawn: a forked copy of a parent that already ran the (multi-threaded) Rust tokenizer can deadlock
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_quiet_worker) if workers > 1 else None
        with pool or contextlib.nullcontext():
            for result in pool.imap(_prepare_piece, tasks) if pool else map(_prepare_piece, tasks):
                shards.append(result)
                done += weight(parts[len(shards) - 1])
                tokens += result["stats"]["tokens"]
                now = time.time()
                if now - last >= PROGRESS_EVERY_S or len(shards) == len(parts):
                    last, rate = now, tokens / max(now - start, 1e-9)
                    eta = (now - start) / max(done, 1) * (total - done)
                    log(
                        f"prepared {len(shards)}/{len(parts)} pieces | {100 * done / max(total, 1):.1f}% | "
                        f"{tokens} tokens | {rate:,.0f} tokens/s | ETA {eta:.0f} s"
                    )
        kept = [s for s in shards if s["num_samples"]]
        if not kept:
            raise DataError(f"{spec}: no usable example in {len(parts)} pieces")
        totals = {k: sum(s["stats"][k] for s in shards) for k in shards[0]["stats"] if k != "bad_line_examples"}
        elapsed = time.time() - start
        meta = {
            "prepared": 1,
            "source": os.path.abspath(spec),
            "settings": dataclasses.asdict(settings),
            "tokenizer": tokenizer_digest(tokenizer_dir) if settings.format != "tokens" else None,
            "seq_len": settings.max_seq_length,
            "num_samples": sum(s["num_samples"] for s in kept),
            "tokens": totals["tokens"],
            "shards": [{"dir": s["dir"], "num_samples": s["num_samples"]} for s in kept],
            "stats": totals,
            "workers": workers,
            "build_s": round(elapsed, 2),
            "tokens_per_s": round(totals["tokens"] / max(elapsed, 1e-9)),
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _quiet_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
