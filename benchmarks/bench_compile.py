"""compile=true against eager: the same model, layout, data and steps through train.py, one table.

    python benchmarks/bench_compile.py                      # CPU: 4 ranks, pipe 2 x data 2, fp32, 8 layers, hidden 512
    python benchmarks/bench_compile.py --gpus 8 --stages 4 --precision bf16 --hidden-size 4096 ...   # a GPU node

A random Llama of the given shape is written and converted once (defaults: 41 M parameters); train.py then runs it
eager and with compile=true (each layer of a stage torch.compile'd through DeepSpeed's engine.compile(), backend
inductor: training/compile.py) on fixed-length rows of random tokens, each rank one CPU thread on CPU. Per case the
table gives the median step time after --warmup steps and real tokens per second, the first step's time (compiling
happens there), train.py's own compile figures (seconds compiling, the slowest rank; graphs recompiled after the
first step: metrics.jsonl's compile_s and recompiles) and the last loss; under it, the largest relative difference
of the two runs' losses over every step (fp32: the same numbers; the script fails above --loss-tol).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_pipeline_args, bench_model, measure_train, run_overrides  # noqa: E402

CASES = {"eager": [], "compiled": ["compile=true"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_args(p)
    p.set_defaults(steps=10, warmup=2)
    p.add_argument("--loss-tol", type=float, default=1e-5, help="largest relative loss difference accepted")
    return p.parse_args(argv)


def run_case(args, name: str, ckpt: str, data: str, work: str) -> dict:
    out = os.path.join(work, name)
    overrides = run_overrides(args, ckpt, data, work, out) + CASES[name]
    overrides += [f"num_stages={args.stages}", f"gradient_accumulation_steps={args.grad_accum}", "data.shuffle=false"]
    result = measure_train(args.gpus, overrides, out, args.warmup, name)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    return {
        **result,
        "losses": [r["loss"] for r in steps],
        "first_s": steps[0]["step_s"],
        "compile_s": steps[-1].get("compile_s"),
        "recompiles": steps[-1].get("recompiles"),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    from models.tiny import write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_compile-")
    ckpt = bench_model(args, work)
    data = os.path.join(work, "train.jsonl")
    samples = args.steps * args.micro_batch * args.grad_accum * (args.gpus // args.stages)
    write_random_tokens(data, samples, args.seq, vocab_size=args.vocab_size)
    results = {name: run_case(args, name, ckpt, data, work) for name in CASES}
    eager, compiled = results["eager"], results["compiled"]
    print(
        f"pipe {args.stages} x data {args.gpus // args.stages}, ds={args.ds}, {args.precision}, hidden "
        f"{args.hidden_size}, {args.num_hidden_layers} layers, vocab {args.vocab_size}, seq {args.seq}, micro "
        f"{args.micro_batch} x grad_acc {args.grad_accum}, {args.steps} steps (median after {args.warmup})"
    )
    print("| case | s/step | tokens/s | first step (s) | compile (s) | recompiles | last loss |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        recompiles = "-" if r["recompiles"] is None else str(r["recompiles"])
        print(
            f"| {name} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {r['first_s']:.1f} | {compile_s} | {recompiles} | "
            f"{r['losses'][-1]:.6f} |"
        )
    diffs = [abs(c - e) / abs(e) for c, e in zip(compiled["losses"], eager["losses"])]
    print(
        f"compiled / eager: step time {compiled['step_s'] / eager['step_s']:.2f}, tokens/s "
        f"{compiled['tokens_s'] / eager['tokens_s']:.2f}; losses over {len(diffs)} steps: largest relative "
        f"difference {max(diffs):.1e}"
    )
    if len(compiled["losses"]) != len(eager["losses"]) or max(diffs) > args.loss_tol:
        raise SystemExit(f"the compiled run's losses differ from eager's by more than {args.loss_tol:g}")


if __name__ == "__main__":
    main()
