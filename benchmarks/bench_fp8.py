"""FP8 against bf16: the demo's tiny Llama and corpus, 50 steps, the same seed and data order, three ways.

    python benchmarks/bench_fp8.py                     # CPU: 4 ranks, pipe 2 x data 2 (the demo's), about 3 minutes
    python benchmarks/bench_fp8.py --gpus 8 --stages 2 --steps 200 --json work/bench_fp8/gpu.json

The model (models/tiny.py's ``tiny_config``, seed 0: what scripts/make_tiny_model.py writes) and the raw-text corpus
are built once; train.py then runs ``precision=bf16`` with ``fp8=null``, ``fp8=rowwise`` and ``fp8=tensorwise`` with
the demo's optimizer settings. Per run the table gives the loss at steps 1, 10, 25 and the last, the largest
``|loss_fp8 - loss_bf16| / loss_bf16`` over all steps and over the last 10, and the median s/step after --warmup.
On CPU torchao emulates the float8 matmuls (casts and scaled matmuls in eager ops): slower than bf16 there, so the
s/step column says nothing of a GPU's gain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import measure_train, run_overrides  # noqa: E402
from parallel.layout import count_arg  # noqa: E402

CASES = {"bf16": "null", "bf16 + fp8=rowwise": "rowwise", "bf16 + fp8=tensorwise": "tensorwise"}
SHOWN_STEPS = (1, 10, 25)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=count_arg(1), default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=count_arg(1), default=2)
    p.add_argument("--ds", default="zero1")
    p.add_argument("--seq", type=count_arg(2), default=128)
    p.add_argument("--micro-batch", type=count_arg(1), default=4)
    p.add_argument("--grad-accum", type=count_arg(1), default=4)
    p.add_argument("--steps", type=count_arg(10), default=50)
    p.add_argument("--warmup", type=count_arg(0), default=2, help="steps left out of the median s/step")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the figures and every step's loss here")
    args = p.parse_args(argv)
    args.precision = "bf16"
    if args.gpus % args.stages:
        p.error(f"--stages {args.stages} must divide --gpus {args.gpus}")
    return args


def losses(output_dir: str) -> list[float]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def main(argv=None) -> None:
    args = parse_args(argv)
    from models.tiny import converted_random_model, write_text_corpus

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_fp8-")
    ckpt = converted_random_model(work)  # tiny_config()'s shape, seed 0: the demo's model
    data = os.path.join(work, "corpus.jsonl")
    write_text_corpus(data)
    results = {}
    for name, recipe in CASES.items():
        out = os.path.join(work, "run-" + recipe)
        overrides = ["data=text", *run_overrides(args, ckpt, data, work, out)] + [
            f"num_stages={args.stages}",
            f"gradient_accumulation_steps={args.grad_accum}",
            f"fp8={recipe}",
            "eval_steps=0",
            "log_steps=10",
            "optim.lr=3e-3",
            "optim.warmup_steps=10",
            "optim.scheduler=cosine",
            "optim.min_lr=3e-4",
        ]
        r = measure_train(args.gpus, overrides, out, args.warmup, name)
        r.pop("log")
        r["losses"] = losses(out)
        results[name] = r
        print(f"[bench_fp8] {name}: {r['step_s']:.3f} s/step, last loss {r['loss']:.4f}", file=sys.stderr, flush=True)
    base = results["bf16"]["losses"]
    for r in results.values():
        rel = [abs(a - b) / b for a, b in zip(r["losses"], base)]
        r["max_rel"], r["max_rel_last10"] = max(rel), max(rel[-10:])
    n = len(base)
    print(
        f"{args.gpus} CPU ranks (pipe {args.stages} x data {args.gpus // args.stages}), ds={args.ds}, bf16; the demo's "
        f"tiny Llama and corpus (data=text, seq {args.seq}, micro {args.micro_batch} x grad_acc {args.grad_accum}), "
        f"lr 3e-3 cosine; {n} steps, s/step the median after {args.warmup} (CPU emulates float8: slower)"
    )
    shown = [s for s in SHOWN_STEPS if s < n] + [n]
    print("| run | " + " | ".join(f"loss @{s}" for s in shown) + " | max rel. diff (all) | (last 10) | s/step |")
    print("|---" * (len(shown) + 4) + "|")
    for name, r in results.items():
        cells = " | ".join(f"{r['losses'][s - 1]:.4f}" for s in shown)
        diff = "- | -" if name == "bf16" else f"{100 * r['max_rel']:.2f}% | {100 * r['max_rel_last10']:.2f}%"
        print(f"| {name} | {cells} | {diff} | {r['step_s']:.3f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
