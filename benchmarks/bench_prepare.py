"""Offline tokenization throughput, and start-up of a training job on a prepared corpus as it grows.

    python benchmarks/bench_prepare.py                       # both parts, about 2 minutes on 2 cores
    python benchmarks/bench_prepare.py --part tokenize --mb 200 --workers 1,2,8

tokenize: a text corpus of --mb MiB (Python's bundled docs, repeated with a counter so no two documents are
equal) tokenized with the tiny model's tokenizer, rows of 512, packed, by scripts/prepare_data.py's code
(data/prepare.py) with each --workers count, and by ``datasets``: ``load_dataset("json")`` then
``map(batched=True, num_proc=N)`` with the same tokenizer, in the same run. Wall time of the whole job each
(reading, tokenizing, writing), and tokens/s.

startup: prepared directories of 10^7 and 10^9 tokens written directly (synthetic rows, sparse files: nothing is
tokenized), then ``train.py max_steps=1`` on 4 ranks (pipe 4, the tiny model) on each: the seconds from
launch to exit (one step), and every rank's peak RSS after data set-up. Flat is the target: middle stages
read nothing, reading ranks memory-map, and the sampler holds 8 bytes per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.launch import deepspeed_command  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402

RSS = re.compile(r"rank (\d+): data (.+?) \| peak RSS after data (\d+) MiB")
SEQ = 512


def write_corpus(path: str, mb: int) -> None:
    from models.tiny import corpus_documents

    docs, size, i = corpus_documents(), 0, 0
    with open(path, "w") as f:
        while size < mb * 2**20:
            line = json.dumps({"text": f"{i}: {docs[i % len(docs)]}"}) + "\n"
            f.write(line)
            size, i = size + len(line), i + 1


def bench_tokenize(args, work: str, ckpt: str) -> None:
    from data.cache import DataSettings
    from data.prepare import prepare

    corpus = os.path.join(work, "corpus.jsonl")
    write_corpus(corpus, args.mb)
    settings = DataSettings(
        format="text", max_seq_length=SEQ, packing=True, skip_bad_lines=False, pad_id=0, vocab_size=512
    )
    rows = []
    for n in (int(w) for w in args.workers.split(",")):
        out = os.path.join(work, f"prepared-{n}")
        start = time.time()
        meta = prepare(corpus, settings, ckpt, out, n, log=lambda m: print(f"[bench_prepare] {m}", file=sys.stderr))
        rows.append((f"prepare_data.py, {n} worker(s)", time.time() - start, meta["tokens"]))
    for n in (int(w) for w in args.workers.split(",")):
        rows.append((f"datasets map(batched=True, num_proc={n})", *datasets_map(corpus, ckpt, n, work)))
    print(f"corpus: {args.mb} MiB of JSONL text ({os.path.getsize(corpus) / 2**20:.0f} MiB), rows of {SEQ}")
    print("| tokenizer | wall s | tokens | tokens/s |\n|---|---|---|---|")
    for name, seconds, tokens in rows:
        print(f"| {name} | {seconds:.1f} | {tokens} | {tokens / seconds:,.0f} |")


def datasets_map(corpus: str, tokenizer_dir: str, num_proc: int, work: str) -> tuple[float, int]:
    """load_dataset("json") + map(batched) with the same tokenizer, caching in its own directory (timed whole)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    start = time.time()
    ds = load_dataset("json", data_files=corpus, split="train", cache_dir=os.path.join(work, f"hf-cache-{num_proc}"))
    ids = ds.map(
        lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]},
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
    )
    seconds = time.time() - start
    tokens = sum(len(x) for batch in ids.iter(batch_size=10_000) for x in batch["input_ids"])
    return seconds, tokens + 2 * len(ids)  # BOS and EOS per document, as ours counts them


def synthetic_prepared(out: str, tokens: int, vocab: int) -> None:
    """A prepared directory of ``tokens`` tokens in rows of SEQ (sparse files of zeros with a token per row set,
    one shard), as data/prepare.py writes it; nothing is tokenized."""
    from data.cache import ARRAYS, NUM_TOKENS, DataSettings

    rows = tokens // SEQ
    shard = os.path.join(out, "shard-00000")
    os.makedirs(shard)
    for name in ARRAYS:
        with open(os.path.join(shard, f"{name}.bin"), "wb") as f:
            f.truncate(rows * SEQ * 4)  # sparse: zeros on read, no disk
    positions = np.memmap(os.path.join(shard, "position_ids.bin"), dtype=np.int32, mode="r+", shape=(rows, SEQ))
    positions[:8] = np.arange(SEQ)  # the rows the first step reads (shuffle off) are one document each
    positions.flush()
    np.full(rows, SEQ, dtype=np.int32).tofile(os.path.join(shard, f"{NUM_TOKENS}.bin"))
    settings = DataSettings(
        format="tokens", max_seq_length=SEQ, packing=False, skip_bad_lines=False, pad_id=0, vocab_size=vocab
    )
    meta = {
        "prepared": 1,
        "source": "synthetic",
        "settings": dataclasses.asdict(settings),
        "tokenizer": None,
        "seq_len": SEQ,
        "num_samples": rows,
        "tokens": rows * SEQ,
        "shards": [{"dir": "shard-00000", "num_samples": rows}],
    }
    with open(os.path.join(shard, "meta.json"), "w") as f:
        json.dump({"num_samples": rows, "seq_len": SEQ}, f)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)


def bench_startup(work: str, ckpt: str) -> None:
    table = []
    for tokens in (10**7, 10**9):
        data = os.path.join(work, f"prepared-{tokens:.0e}")
        synthetic_prepared(data, tokens, vocab=512)
        out = os.path.join(work, f"run-{tokens:.0e}")
        # fmt: skip
        train_args = [
            f"model_name_or_path={ckpt}",
            f"data.train_file={data}",
            f"data.max_seq_length={SEQ}",
            "num_stages=4",
            "max_steps=1",
            "data.shuffle=false",
            "precision=fp32",
            f"output_dir={out}",
            "save_steps=0",
            "min_free_disk_gb=0",
        ]
        cmd = deepspeed_command(4, "train.py", train_args, port=free_port())
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            sys.exit(f"train.py on {data} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        ready = next((line for line in proc.stdout.splitlines() if "peak RSS after data" in line), None)
        total = time.time() - start
        rss = {int(r): (role, int(mib)) for r, role, mib in RSS.findall(proc.stdout)}
        table.append((tokens, tokens // SEQ, total, rss, ready is not None))
    print(f"train.py max_steps=1 on 4 ranks (pipe 4: ranks 1 and 2 are middle stages, tiny model), rows of {SEQ}")
    print("| corpus tokens | rows | launch to exit (s) | peak RSS after data per rank (MiB): role |\n|---|---|---|---|")
    for tokens, rows, seconds, rss, _ in table:
        per_rank = ", ".join(f"{r}: {mib} ({role})" for r, (role, mib) in sorted(rss.items()))
        print(f"| {tokens:.0e} | {rows} | {seconds:.1f} | {per_rank} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("tokenize", "startup", "both"), default="both")
    p.add_argument("--mb", type=int, default=64, help="corpus size for the tokenize part")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    from models.tiny import converted_random_model

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_prepare-")
    ckpt = converted_random_model(os.path.join(work, "model"), num_hidden_layers=4)
    if args.part in ("tokenize", "both"):
        bench_tokenize(args, work, ckpt)
    if args.part in ("startup", "both"):
        bench_startup(work, ckpt)


if __name__ == "__main__":
    main()
