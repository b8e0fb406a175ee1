"""Mixture of Experts: one model trained with expert_parallel 1, 2 and 4 on the same ranks, through train.py.

    python benchmarks/bench_moe.py                  # CPU: 4 ranks, num_stages=1 (data 4), expert_parallel 1,2,4
    python benchmarks/bench_moe.py --stages 2 --eps 1,2     # pipe 2 x data 2
    python benchmarks/bench_moe.py --quick          # a tiny model on 2 ranks, expert_parallel 1,2, 2 steps (the test's)

A random Qwen3-MoE whose routed experts hold most of its weights (defaults: hidden 256, 4 layers, 16 experts of
512, top 2, vocabulary 4096: 27.4 M parameters, 25.2 M of them experts) is written and converted once; train.py
then runs it on ``--gpus`` ranks with each ``--eps`` value (``--precision`` and ``--ds``, default fp32 and ZeRO-0; the
same data, global batch and steps), each rank one CPU thread on CPU. Per run the table gives:

- the median step time after ``--warmup`` steps and real tokens per second;
- each rank's routed-expert parameters (the model's / expert_parallel; train.py's ``experts:`` line where it prints
  one) and parameters (its load report);
- each rank's model states (train.py's census: weights + gradients + Adam states,
training/observation/memory_census.py);
- each rank's peak RSS at load, and what loading added to the RSS before the stage was built, against the rank's
  parameter bytes; and the saving at load against expert_parallel 1, against the expert bytes it no longer holds;
- each rank's peak host RSS after its last step (the training's), and over the whole run: train.py's final figure,
  which includes the checkpoint saved at the end (with expert_parallel > 1 it gathers the experts' weights and Adam
  moments over the expert group);
- the time each rank spends per step inside the all-to-alls (``torch.distributed.all_to_all_single``: the dispatch,
  the return and their gradients, waiting for the group's other ranks included), the mean over ranks of the median
  step after the warm-up: every rank runs train.py through ``--time-rank`` (this script), which times the calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import (  # noqa: E402
    measure_train,
    per_rank_text,
    run_as_rank,
    run_overrides,
    run_train_recording,
)

# train.py's load report, one per rank (training/observation/announce.py rank_lines)
LOAD = re.compile(
    r"rank (\d+): stage \d+ .*?\(\d+ specs, ([\d.]+) M params\).*peak RSS at load (\d+) MiB "
    r"\(before building the stage (\d+) MiB, stage parameters (\d+) MiB\)"
)
# parallel/expert_parallel.py's line (expert_parallel > 1 only)
EXPERTS = re.compile(r"experts: \d+ per MoE layer over expert_parallel \d+ .*?expert parameters per rank ([^)]*)\)")
QUICK = dict(
    hidden=64,
    layers=2,
    experts=8,
    moe_intermediate=64,
    vocab=512,
    seq=32,
    steps=2,
    warmup=1,
    eps="1,2",
    grad_accum=1,
    gpus=2,  # data 2: expert_parallel 2 needs no more
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=int, default=1, help="num_stages (data parallel: the rest)")
    p.add_argument("--eps", default="1,2,4", help="comma-separated expert_parallel values")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero0", choices=("zero0", "zero1"), help="the ZeRO config (conf/ds)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the median")
    p.add_argument(
        "--quick", action="store_true", help="a tiny model on 2 ranks, expert_parallel 1,2, 2 steps (smoke test)"
    )
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (a --work-dir is always kept)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def moe_config(args):
    from models.tiny import tiny_config

    heads = max(1, args.hidden // 64)
    return tiny_config(
        "qwen3_moe",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.seq),
    )


def make_checkpoint(config, work: str) -> str:
    """The random model of ``config`` in ``work/hf``, converted to layer files in ``work/ckpt`` (once)."""
    from models.files.hf_convert import hf_to_stages
    from models.tiny import save_random_model, train_tokenizer

    hf, ckpt = os.path.join(work, "hf"), os.path.join(work, "ckpt")
    if not os.path.isdir(ckpt):
        save_random_model(config, hf)
        train_tokenizer(hf, vocab_size=512)  # a side file only: the data are token ids
        hf_to_stages(hf, ckpt)
    return ckpt


def time_rank(out_dir: str, train_argv: list[str]) -> None:
    """Inside a rank: run train.py with every ``all_to_all_single`` timed; per step (train_batch), the seconds spent in
    them and the rank's peak RSS so far (the training's, before the final checkpoint), written to
    ``out_dir/rank<R>.json`` at exit."""
    import time

    import torch.distributed as dist
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from models.host_memory import peak_rss_mb

    steps: list[dict] = []
    spent = [0.0]
    all_to_all, train_batch = dist.all_to_all_single, PipelineEngine.train_batch

    def timed_all_to_all(*a, **k):
        t = time.perf_counter()
        try:
            return all_to_all(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    def timed_train_batch(self, *a, **k):
        spent[0] = 0.0
        try:
            return train_batch(self, *a, **k)
        finally:
            steps.append({"all_to_all_s": spent[0], "peak_rss_mib": peak_rss_mb()})

    dist.all_to_all_single, PipelineEngine.train_batch = timed_all_to_all, timed_train_batch
    run_train_recording(out_dir, train_argv, steps)


def rank_timings(timing_dir: str, warmup: int) -> dict:
    """From ``time_rank``'s files: the mean over ranks of each rank's median seconds per step in all-to-alls (steps
    after ``warmup``), and each rank's peak RSS after its last step (MiB)."""
    ranks = sorted(os.listdir(timing_dir), key=lambda name: int(name[4:-5]))
    per_rank = []
    for name in ranks:
        with open(os.path.join(timing_dir, name)) as f:
            per_rank.append(json.load(f))
    return {
        "all_to_all_s": statistics.mean(
            statistics.median(s["all_to_all_s"] for s in (r[warmup:] or r)) for r in per_rank
        ),
        "train_peak": [r[-1]["peak_rss_mib"] for r in per_rank],
    }


def run_ep(args, ep: int, ckpt: str, data: str, work: str) -> dict:
    out = os.path.join(work, f"ep{ep}")
    timing = out + "_all_to_all"
    shutil.rmtree(timing, ignore_errors=True)
    os.makedirs(timing)
    overrides = run_overrides(args, ckpt, data, work, out) + [
        "data.shuffle=false",
        f"num_stages={args.stages}",
        f"gradient_accumulation_steps={args.grad_accum}",
        f"expert_parallel={ep}",
        "log_steps=1",
    ]
    r = measure_train(
        args.gpus,
        overrides,
        out,
        args.warmup,
        f"expert_parallel {ep}",
        ["benchmarks/bench_moe.py", "--time-rank", timing],
    )
    loads = {int(m[1]): (float(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in LOAD.finditer(r["log"])}
    if len(loads) != args.gpus:
        raise SystemExit(f"expert_parallel {ep}: {len(loads)} load reports in train.py's log, expected {args.gpus}")
    experts = EXPERTS.search(r["log"])
    return {
        **r,
        "load": [loads[rank] for rank in sorted(loads)],  # (M params, peak at load, before stage, param MiB)
        "logged_experts_m": [float(v.split()[0]) for v in experts[1].split(", ")] if experts else None,
        **rank_timings(timing, args.warmup),
    }


def print_table(args, config, results: dict[int, dict]) -> None:
    from models.moe_counts import parameter_split

    routed, rest = parameter_split(config)
    dp = args.gpus // args.stages
    print(
        f"qwen3_moe: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of {args.moe_intermediate} "
        f"(top {args.top_k}), vocab {args.vocab}: {(routed + rest) / 1e6:.2f} M parameters, {routed / 1e6:.2f} M "
        f"routed experts ({routed / (routed + rest):.0%}); {args.gpus} ranks, pipe {args.stages} x data {dp}, "
        f"{args.precision}, ds={args.ds}; seq {args.seq}, micro {args.micro_batch} x grad_acc {args.grad_accum} "
        f"x dp {dp}; {args.steps} steps (median after {args.warmup})"
    )
    print(
        "| expert_parallel | s/step | tokens/s | in all-to-all s/step | expert params per rank | model states per "
        "rank (MiB, census) | peak RSS at load per rank (MiB) | load's RSS rise / rank's param MiB | saved at load vs "
        "ep 1 / expert MiB dropped | peak RSS per rank, training (MiB) | peak RSS per rank, with the final save "
        "(MiB) | last loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = results.get(1)
    for ep, r in results.items():
        experts_m = r["logged_experts_m"] or [routed / args.stages / ep / 1e6] * args.gpus
        peaks = [peak for _, peak, _, _ in r["load"]]
        rises = [f"{peak - before} / {mib}" for _, peak, before, mib in r["load"]]
        saved = ""
        if base is not None and ep != 1:
            measured = statistics.mean(b[1] for b in base["load"]) - statistics.mean(peaks)
            dropped = routed / args.stages * (1 - 1 / ep) * 4 / 2**20
            saved = f"{round(measured)} / {dropped:.0f}"
        experts = per_rank_text([f"{m:.2f} M ({m * 4e6 / 2**20:.0f} MiB)" for m in experts_m], "{}")
        print(
            f"| {ep} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | {r['all_to_all_s']:.3f} | {experts} | "
            f"{per_rank_text(r['states'], '{:.1f}')} | {per_rank_text(peaks)} | {per_rank_text(rises, '{}')} | "
            f"{saved} | {per_rank_text(r['train_peak'])} | {per_rank_text(r['peak'])} | {r['loss']:.4f} |"
        )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_as_rank(argv, "--time-rank", time_rank):  # inside a rank
        return
    args = parse_args(argv)
    from models.tiny import write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_moe-")
    try:
        config = moe_config(args)
        ckpt = make_checkpoint(config, work)
        data = os.path.join(work, "train.jsonl")
        rows = args.steps * args.micro_batch * args.grad_accum * (args.gpus // args.stages)
        write_random_tokens(data, rows, args.seq, vocab_size=args.vocab)
        results = {}
        for ep in (int(v) for v in args.eps.split(",")):
            results[ep] = run_ep(args, ep, ckpt, data, work)
            print(f"[bench_moe] expert_parallel {ep}: {results[ep]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
        print_table(args, config, results)
    finally:
        if args.work_dir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"[bench_moe] kept {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
