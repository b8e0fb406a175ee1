"""Host memory of first, middle and last stage ranks against dataset size, and tokenization speed.

    python benchmarks/bench_data.py [--docs 1000,100000] [--work work/bench_data]

For each size: writes a JSONL corpus of that many documents (slices of Python's bundled docs), then
runs `deepspeed --num_gpus 4 train.py num_stages=4 max_steps=0 data.format=text` on the tiny model
with a fresh cache: rank 0 tokenizes and reads, ranks 1-2 are middle stages (placeholder), rank 3
reads. Prints each rank's peak RSS after data set-up, and the cache build's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.launch import deepspeed_command  # noqa: E402

RSS = re.compile(r"rank (\d+): data (.+?) \| peak RSS after data (\d+) MiB")
BUILD = re.compile(
    r"tokenized .*?: (\d+) records -> \d+ examples, (\d+) tokens -> (\d+) samples .* in ([\d.]+) s \((\d+) tokens/s\)"
)


def write_corpus(path: str, num_docs: int) -> int:
    from models.tiny import corpus_documents

    docs, rng = corpus_documents(), random.Random(0)
    with open(path, "w") as f:
        for _ in range(num_docs):
            doc = rng.choice(docs)
            start = rng.randrange(max(1, len(doc) - 2000))
            f.write(json.dumps({"text": doc[start : start + rng.randint(200, 2000)]}) + "\n")
    return os.path.getsize(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", default="1000,100000", help="comma-separated corpus sizes (documents)")
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_data"))
    args = p.parse_args()

    from models.files.hf_convert import hf_to_stages
    from models.tiny import save_random_model, tiny_config, train_tokenizer

    os.makedirs(args.work, exist_ok=True)
    hf, ckpt = os.path.join(args.work, "hf"), os.path.join(args.work, "ckpt")
    if not os.path.isfile(os.path.join(ckpt, "latest")):
        train_tokenizer(hf, 512)
        save_random_model(tiny_config(), hf)
        hf_to_stages(hf, ckpt, overwrite=True)

    rows = []
    for n in (int(x) for x in args.docs.split(",")):
        corpus, cache = os.path.join(args.work, f"corpus_{n}.jsonl"), os.path.join(args.work, f"cache_{n}")
        size = write_corpus(corpus, n)
        shutil.rmtree(cache, ignore_errors=True)
        train_args = [
            f"model_name_or_path={ckpt}",
            "num_stages=4",
            "max_steps=0",
            f"data.train_file={corpus}",
            "data.format=text",
            "data.max_seq_length=256",
            f"data.cache_dir={cache}",
            "gradient_accumulation_steps=4",
            "precision=fp32",
            f"output_dir={os.path.join(args.work, 'out')}",
        ]
        cmd = deepspeed_command(4, "train.py", train_args)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"{n} documents failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        records, tokens, samples, seconds, rate = BUILD.search(proc.stdout).groups()
        rss = {int(r): (role, int(mib)) for r, role, mib in RSS.findall(proc.stdout)}
        rows.append((n, size, int(tokens), int(samples), float(seconds), int(rate), rss))

    print(
        "| documents | corpus (MiB) | tokens | samples | cache build (s) | tokens/s | "
        "rank 0 first (MiB) | rank 1 middle (MiB) | rank 2 middle (MiB) | rank 3 last (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, size, tokens, samples, seconds, rate, rss in rows:
        print(
            f"| {n} | {size / 2**20:.1f} | {tokens} | {samples} | {seconds:.1f} | {rate} | "
            + " | ".join(f"{rss[r][1]}" for r in range(4))
            + " |"
        )


if __name__ == "__main__":
    main()
