"""1F1B against DualPipeV (pipeline_schedule), side by side on the same ranks, and simulated for longer pipelines.

    python benchmarks/bench_schedule.py --rounds 2               # CPU: pipe 2 on 2 ranks, 4, 8 and 16 micro-batches
    python benchmarks/bench_schedule.py --micro-batches 8 --rounds 3 --hidden-size 1024 ...

A random Llama of the given shape is written and converted once; for each micro-batch count (gradient
accumulation; micro-batches of ``--micro-batch`` rows of ``--seq`` tokens) train.py runs pipe 2 on 2 ranks (one
CPU thread each) under each schedule, ``--rounds`` times interleaved (machine drift hits both alike). Every
rank's pipeline instructions are timed (benchmarks/harness.py ``profile_rank``). Per run the table gives the
median step time and real tokens/s after ``--warmup`` steps, and the measured bubble: per rank, the share of the
pipelined part of the step spent outside the forward, backward, weight-gradient and load instructions (waiting
for a peer, or sending), averaged over the ranks. The pipelined part is the step (``train_batch``) less the
gradient reduction and optimizer step of the rank that reached them last: the others wait there for it (the
gradient norm crosses the stages), which is the pipeline's drain.

The simulated table replays the instruction streams (DeepSpeed's ``TrainSchedule`` and ``DualPipeVSchedule``,
and train.py's zero-bubble DualPipeV, parallel/dualpipev.py) for pipe 4, 8 and 16 (parallel/schedule_sim.py)
with the whole model's forward and backward seconds per micro-batch measured by the 1F1B runs and the weight
gradients' share of the backward measured by the DualPipeV runs, split evenly over the pieces, communication
free: the bubble a longer pipeline of the same model would have, and 1F1B's closed form (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import (  # noqa: E402
    add_model_args,
    bench_model,
    measure_train,
    profile_rank,
    run_as_rank,
    run_overrides,
)
from parallel.layout import PIPELINE_SCHEDULES  # noqa: E402

COMPUTE = ("_exec_forward_pass", "_exec_backward_pass", "_exec_weight_pass", "_exec_load_micro_batch")
OUTSIDE_PIPELINE = ("_exec_reduce_grads", "_exec_reduce_tied_grads", "_exec_optimizer_step")


def parse_args(argv=None) -> argparse.Namespace:
    from parallel.layout import count_arg

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    # 16 layers and a small vocabulary: both schedules' default splits come within 6% of even ranks, so the
    # bubble measured is the schedule's, not the partition's
    p.set_defaults(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=2048,
    )
    p.add_argument("--micro-batches", default="4,8,16", help="comma-separated gradient accumulation steps")
    p.add_argument("--micro-batch", type=count_arg(1), default=1, help="rows per micro-batch")
    p.add_argument("--seq", type=count_arg(2), default=256)
    p.add_argument("--steps", type=count_arg(1), default=5)
    p.add_argument("--warmup", type=count_arg(0), default=2, help="steps left out of the medians")
    p.add_argument("--rounds", type=count_arg(1), default=1, help="interleaved repetitions of every run")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero1")
    p.add_argument("--simulate", default="4,8,16", help="pipeline sizes of the simulated table")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    args = p.parse_args(argv)
    try:
        args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
        args.simulate = [int(p) for p in args.simulate.split(",")]
    except ValueError:
        raise SystemExit("bench_schedule.py: error: --micro-batches and --simulate take comma-separated integers")
    if min(args.micro_batches) < 4:
        raise SystemExit("bench_schedule.py: error: --micro-batches: DualPipeV on pipe 2 needs 4 or more")
    return args


def bubble(prof_dir: str, warmup: int) -> dict:
    """Medians over the steps after ``warmup``: the measured bubble averaged over the ranks; per micro-batch and
    piece (1F1B: a stage), the forward and backward seconds averaged over the ranks; a WeightPass's seconds
    (DualPipeV's deferred weight gradients of one backward pass; 0 where none ran)."""
    shares, forward, backward, weight = [], [], [], []
    ranks = []
    for name in sorted(os.listdir(prof_dir)):
        with open(os.path.join(prof_dir, name)) as f:
            ranks.append(json.load(f))
    for step in zip(*(r[warmup:] or r for r in ranks)):
        seconds = lambda rec, names: sum(rec.get(n, [0, 0.0])[1] for n in names)  # noqa: E731
        # The gradient reduction and the optimizer step wait for the last rank to finish its backward passes (the
        # step's gradient norm crosses the stages): only the rank that arrived last spent them computing.
        outside = min(seconds(rec, OUTSIDE_PIPELINE) for rec in step)
        pipelined = step[0]["train_batch"][1] - outside
        shares.append(statistics.mean(1 - seconds(rec, COMPUTE) / pipelined for rec in step))
        calls = sum(r["_exec_forward_pass"][0] for r in step)  # micro-batches x pieces
        forward.append(sum(r["_exec_forward_pass"][1] for r in step) / calls)
        backward.append(sum(r["_exec_backward_pass"][1] for r in step) / calls)
        passes = sum(r.get("_exec_weight_pass", [0, 0.0])[0] for r in step)
        weight.append(sum(r.get("_exec_weight_pass", [0, 0.0])[1] for r in step) / passes if passes else 0.0)
    columns = {"bubble": shares, "forward": forward, "backward": backward, "weight": weight}
    return {name: statistics.median(values) for name, values in columns.items()}


def run(args, ckpt: str, data: str, work: str, schedule: str, micro_batches: int, round_: int) -> dict:
    out = os.path.join(work, f"{schedule}_m{micro_batches}_r{round_}")
    prof = out + "_profile"
    os.makedirs(prof, exist_ok=True)
    for f in os.listdir(prof):
        os.remove(os.path.join(prof, f))
    overrides = run_overrides(args, ckpt, data, work, out) + [
        "num_stages=2",
        f"pipeline_schedule={schedule}",
        f"gradient_accumulation_steps={micro_batches}",
        "data.pad_to_multiple_of=0",
        "log_steps=1",
    ]
    result = measure_train(
        2,
        overrides,
        out,
        args.warmup,
        f"{schedule} m={micro_batches}",
        ["benchmarks/bench_schedule.py", "--profile-rank", prof],
    )
    return {**result, **bubble(prof, args.warmup)}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_as_rank(argv, "--profile-rank", profile_rank):  # inside a rank
        return
    args = parse_args(argv)
    from models.tiny import write_random_tokens
    from parallel.schedule_sim import simulate

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_schedule-")
    ckpt = bench_model(args, work)
    data = os.path.join(work, "train.jsonl")
    rows = args.steps * max(args.micro_batches) * args.micro_batch
    write_random_tokens(data, rows, args.seq, vocab_size=args.vocab_size)

    results: dict = {}
    for round_ in range(args.rounds):
        for m in args.micro_batches:
            for schedule in PIPELINE_SCHEDULES:
                r = run(args, ckpt, data, work, schedule, m, round_)
                results.setdefault((schedule, m), []).append(r)
                print(
                    f"[bench] round {round_ + 1} {schedule} m={m}: {r['step_s']:.3f} s/step, bubble {r['bubble']:.1%}"
                )

    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    print(
        f"\nmodel: {args.num_hidden_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}; micro-batches "
        f"of {args.micro_batch} x {args.seq} tokens; {args.precision}, ds={args.ds}; pipe 2 on 2 ranks, one thread "
        f"each; medians of {args.rounds} round(s), steps after {args.warmup}\n"
    )
    print("| micro-batches | schedule | s/step | tokens/s | measured bubble | 1F1B theory | DualPipeV / 1F1B bubble |")
    print("|---|---|---|---|---|---|---|")
    for m in args.micro_batches:
        base = med(results[("1f1b", m)], "bubble")
        for schedule in PIPELINE_SCHEDULES:
            runs = results[(schedule, m)]
            theory = f"{1 / (m + 1):.1%}" if schedule == "1f1b" else ""
            ratio = f"{med(runs, 'bubble') / base:.2f}" if schedule == "dualpipev" and base > 0 else ""
            print(
                f"| {m} | {schedule} | {med(runs, 'step_s'):.3f} | {med(runs, 'tokens_s'):.0f} | "
                f"{med(runs, 'bubble'):.1%} | {theory} | {ratio} |"
            )

    one_f = [r for m in args.micro_batches for r in results[("1f1b", m)]]
    dual = [r for m in args.micro_batches for r in results[("dualpipev", m)]]
    forward, backward = med(one_f, "forward") * 2, med(one_f, "backward") * 2  # the two stages': the model's
    # a WeightPass of DualPipeV computes a quarter of the model's weights (one of 4 pieces)
    weight_share = med(dual, "weight") * 4 / backward
    print(
        f"\nsimulated (parallel/schedule_sim.py): the model's measured forward {forward * 1e3:.1f} ms and backward "
        f"{backward * 1e3:.1f} ms per micro-batch, {weight_share:.0%} of it weight gradients (DualPipeV's WeightPass), "
        "split evenly over the pieces, communication free; DualPipeV as DeepSpeed ships it (weight gradients inside "
        "each backward) and as train.py runs it (zero bubble)\n"
    )
    print(
        "| pipe | micro-batches | 1F1B | 1F1B closed form | DualPipeV (DeepSpeed's) | DualPipeV zero bubble "
        "(train.py) | zero bubble / 1F1B |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in args.simulate:
        n = 2 * p
        for m in (2 * p, 4 * p):
            one = simulate("1f1b", p, m, [forward / p] * p, [backward / p] * p).idle_share
            plain = simulate("dualpipev", p, m, [forward / n] * n, [backward / n] * n).idle_share
            split = [weight_share * backward / n] * n
            zero = simulate("dualpipev", p, m, [forward / n] * n, [backward / n] * n, split).idle_share
            print(
                f"| {p} | {m} | {one:.1%} | {(p - 1) / (m + p - 1):.1%} | {plain:.1%} | {zero:.1%} | {zero / one:.2f} |"
            )


if __name__ == "__main__":
    main()
