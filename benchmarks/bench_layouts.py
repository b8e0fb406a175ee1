"""One model, one global batch, several pipe x tensor x data layouts of the same ranks, through train.py.

    python benchmarks/bench_layouts.py                      # CPU: 4 ranks, pipe 4 | pipe 2 x tensor 2 | tensor 4 | data
    4 python benchmarks/bench_layouts.py --gpus 8 --layouts 8x1,4x2,2x4,1x8 --precision bf16 --hidden-size 4096 ...

A random Llama of the given shape is written and converted once; each layout ``STAGESxTP`` runs train.py on
``--gpus`` ranks (data parallel over the rest) with the same global batch (``--global-batch`` samples of
``--seq`` tokens; grad_acc = global batch / (micro x dp)), each rank one CPU thread on CPU. Per layout the table
gives the median step time after --warmup steps, real tokens per second, and per rank the model-state bytes
train.py measures (weights + gradients + optimizer states) and its peak memory (host RSS on CPU, the GPU
allocator's peak on a GPU), plus the step's last loss (the same model and batches: the layouts agree).
``--schedule dualpipev`` runs the pipelines of two stages or more with DualPipeV, rows fed whole (train.py
refuses it with tensor parallelism).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_run_args, bench_model, measure_train, run_overrides  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, seq=256, micro_batch=1, global_batch=8, steps=8)
    p.add_argument("--layouts", default="4x1,2x2,1x4,1x1", help="comma-separated STAGESxTP (data parallel: the rest)")
    p.add_argument(
        "--schedule",
        choices=("1f1b", "dualpipev"),
        default="1f1b",
        help="train.py's pipeline_schedule for every layout",
    )
    return p.parse_args(argv)


def layouts(args) -> list[tuple[int, int, int]]:
    """(stages, tp, dp) of each --layouts entry, refused with the arithmetic that fails."""
    out = []
    for entry in args.layouts.split(","):
        try:
            stages, tp = (int(v) for v in entry.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bench_layouts.py: error: --layouts entry {entry!r}: write STAGESxTP, e.g. 2x2")
        dp, rest = divmod(args.gpus, stages * tp) if stages >= 1 and tp >= 1 else (0, 1)
        if rest or not dp or args.global_batch % (args.micro_batch * dp):
            raise SystemExit(
                f"bench_layouts.py: error: --layouts {entry}: {stages} stages x tensor {tp} must divide --gpus "
                f"{args.gpus}, and micro {args.micro_batch} x dp must divide --global-batch {args.global_batch}"
            )
        out.append((stages, tp, dp))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = layouts(args)
    from models.tiny import write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_layouts-")
    ckpt = bench_model(args, work)
    data = os.path.join(work, "train.jsonl")
    write_random_tokens(data, args.steps * args.global_batch, args.seq, vocab_size=args.vocab_size)
    results = {}
    for stages, tp, dp in cases:
        name = f"pipe {stages} x tensor {tp} x data {dp}"
        out = os.path.join(work, f"{stages}x{tp}")
        schedule = args.schedule if stages > 1 else "1f1b"  # one stage has no pipeline schedule
        overrides = run_overrides(args, ckpt, data, work, out) + [
            "data.shuffle=false",
            f"num_stages={stages}",
            f"pipeline_schedule={schedule}",
            *(["data.pad_to_multiple_of=0"] if schedule == "dualpipev" else []),  # DualPipeV's shapes are fixed
            f"tensor_parallel={tp}",
            f"gradient_accumulation_steps={args.global_batch // (args.micro_batch * dp)}",
        ]
        results[name] = {**measure_train(args.gpus, overrides, out, args.warmup, name), "schedule": schedule}
        print(f"[bench_layouts] {name}: {results[name]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    print(
        f"{args.gpus} ranks, ds={args.ds}, {args.precision}, hidden {args.hidden_size}, {args.num_hidden_layers} "
        f"layers, vocab {args.vocab_size}, seq {args.seq}, global batch {args.global_batch} (micro "
        f"{args.micro_batch}), {args.steps} steps (median after {args.warmup})"
    )
    kind = next(iter(results.values()))["peak_kind"]
    print(
        f"| layout | schedule | s/step | tokens/s | model states per rank (MiB) | peak {kind} per rank (MiB) "
        "| last loss |\n|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        states = ", ".join(f"{v:.1f}" for v in r["states"])
        peak = ", ".join(f"{v:.0f}" for v in r["peak"])
        print(
            f"| {name} | {r['schedule']} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {states} | {peak} "
            f"| {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
