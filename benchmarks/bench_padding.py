"""Compute that follows real tokens: unpacked chat SFT fed as whole rows, cut per micro-batch, and grouped by length.

    python benchmarks/bench_padding.py                  # CPU: 4 ranks, pipe 2 x data 2, seq 512, about 3 minutes
    python benchmarks/bench_padding.py --gpus 8 --precision bf16 --seq 4096 --hidden-size 4096 ...

Writes prompt/response pairs of real text (Python's bundled docs) whose lengths follow a long-tailed,
chat-like distribution (log-normal: most exchanges short, a few as long as the row), then trains the same
random model on the same data and layout three times through train.py: ``data.pad_to_multiple_of=0`` (every
row fed whole, max_seq_length tokens: the behaviour before micro-batches were cut), ``8`` (each micro-batch
cut to its longest row), and ``8`` with ``data.group_by_length=true``. The table gives the median step time
after --warmup steps, real (non-padding) tokens per second, the share of padding in what was computed, and
the last loss (whole rows and cut rows see the same samples: their losses agree).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_run_args, bench_model, measure_train, run_overrides  # noqa: E402
from parallel.layout import count_arg  # noqa: E402

CASES = {
    "whole rows (pad_to_multiple_of=0)": ["data.pad_to_multiple_of=0"],
    "cut to the longest row (8)": ["data.pad_to_multiple_of=8"],
    "cut + group_by_length": ["data.pad_to_multiple_of=8", "data.group_by_length=true"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, seq=512, micro_batch=2, global_batch=16, steps=8)
    p.add_argument("--stages", type=count_arg(1), default=2)
    p.add_argument("--median-words", type=count_arg(1), default=60, help="median words of an exchange")
    return p.parse_args(argv)


def write_chat_sft(path: str, num_examples: int, median_words: int, seed: int = 0) -> None:
    """Prompt/response pairs of real text with log-normal lengths (sigma 1: a quarter of the exchanges under
    half the median, one in twenty over five times it)."""
    from models.tiny import corpus_documents

    words = " ".join(corpus_documents()).split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_examples):
            n = max(4, int(rng.lognormvariate(0.0, 1.0) * median_words))
            start = rng.randrange(len(words) - n)
            cut = max(1, n // 4)  # a short question, a longer answer
            prompt, response = " ".join(words[start : start + cut]), " ".join(words[start + cut : start + n])
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    dp = args.gpus // args.stages
    if args.gpus % args.stages or args.global_batch % (args.micro_batch * dp):
        raise SystemExit(
            f"bench_padding.py: error: --stages {args.stages} must divide --gpus {args.gpus}, and micro "
            f"{args.micro_batch} x dp {dp} must divide --global-batch {args.global_batch}"
        )
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_padding-")
    ckpt = bench_model(args, work)
    data = os.path.join(work, "chat.jsonl")
    write_chat_sft(data, args.steps * args.global_batch, args.median_words)
    results = {}
    for name, case in CASES.items():
        out = os.path.join(work, "run")
        overrides = run_overrides(args, ckpt, data, work, out) + [
            "data.format=sft",
            "data.packing=false",
            "data.shuffle=false",
            f"num_stages={args.stages}",
            f"gradient_accumulation_steps={args.global_batch // (args.micro_batch * dp)}",
            *case,
        ]
        results[name] = measure_train(args.gpus, overrides, out, args.warmup, name)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
        results[name]["padding"] = statistics.median(r["padding"] for r in steps)
        print(f"[bench_padding] {name}: {results[name]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    print(
        f"{args.gpus} ranks (pipe {args.stages} x data {dp}), ds={args.ds}, {args.precision}, hidden "
        f"{args.hidden_size}, {args.num_hidden_layers} layers, vocab {args.vocab_size}; unpacked chat SFT, rows of "
        f"{args.seq}, median exchange {args.median_words} words; global batch {args.global_batch} (micro "
        f"{args.micro_batch}), {args.steps} steps (median after {args.warmup})"
    )
    base = next(iter(results.values()))
    print("| rows fed | s/step | real tokens/s | x whole rows | padding computed | last loss |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {r['tokens_s'] / base['tokens_s']:.2f} | "
            f"{100 * r['padding']:.1f}% | {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
