"""Checkpoints at scale: starting a run from a Hugging Face directory (model_name_or_path=HF_DIR) against
converting it first; with --save, saving at once against in the background (save_async).

    python benchmarks/bench_hf_start.py                 # 345 M parameters, bf16 safetensors, pipe 4 on 4 CPU ranks
    python benchmarks/bench_hf_start.py --stages 2      # pipe 2 x data 2
    python benchmarks/bench_hf_start.py --quick         # a tiny model on 2 ranks (the smoke test)
    python benchmarks/bench_hf_start.py --save          # save_async=false vs true, a checkpoint every 2 steps

A random Llama (defaults: hidden 1024, 24 layers, GQA 16/8 heads, intermediate 2816, vocabulary 32000: 345 M
parameters) is saved with ``save_pretrained(max_shard_size=--shard)`` in ``--dtype``; then, ``--repeat`` rounds of:

1. ``convert2ckpt.py --input HF --output CKPT`` (timed; its peak RSS);
2. train.py from HF (``model_name_or_path=HF``) for one step, and train.py from CKPT the same, in turn first.

Each train.py run is launched with DeepSpeed's runner, its ranks running train.py through ``--time-rank`` (this
script), which notes when each rank's first step starts and ends. The table gives, per way of starting: the seconds
from the launch to the start of the first step and to its end (the slowest rank's; the median over the rounds, each
round's in brackets), plus the conversion's (median) for convert-then-train; the disk the model takes (the HF
directory alone, or it and the layer files); and per rank, from train.py's load report line of the first round, the
MiB read, the seconds, the peak RSS at load, what loading added to the RSS before the stage was built, and the stage's
parameters. Both train.py runs find their files in the page cache (just written): the figures compare the reads'
work, not a cold disk. Each run's output directory (its final checkpoint) is removed once measured.

--save: train.py from the HF directory for --save-steps-total steps with a checkpoint every 2 (the last step's is
written at once either way, and not counted), save_async false and true in turn, --repeat rounds. Per way of saving:
the seconds training stopped per save (the slowest rank's gap from the end of a saving step to the start of the next,
less the median gap after steps without a save), the step time of the step after a save against the other steps (the
slowest rank's), the checkpoint's size on disk, and per rank the peak RSS of the run (train.py's final figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

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
    r"rank (\d+): stage \d+ .*?\| loaded ([\d.]+) MiB from .*? in ([\d.]+) s \| peak RSS at load (\d+) MiB "
    r"\(before building the stage (\d+) MiB, stage parameters (\d+) MiB\)"
)
QUICK = dict(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=176, vocab=512, seq=32, gpus=2, stages=2, repeat=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=int, default=4, help="num_stages (data parallel: the rest)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="of the safetensors files")
    p.add_argument("--shard", default="500MB", help="max_shard_size of save_pretrained")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="train.py's")
    p.add_argument("--ds", default="zero1")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2, help="rounds (conversion and both starts)")
    p.add_argument("--quick", action="store_true", help="a tiny model on 2 ranks (smoke test)")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    p.add_argument("--save", action="store_true", help="measure saves (save_async false vs true) instead of starts")
    p.add_argument("--save-steps-total", type=int, default=9, help="--save: steps per run (a checkpoint every 2)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.steps = args.save_steps_total if args.save else 1  # --save: the run; else the time to the first step
    return args


def make_hf_dir(args, work: str) -> str:
    """The random model in ``work/hf``, sharded, with a tokenizer (a side file only: the data are token ids)."""
    import torch

    from models.families import family_of
    from models.tiny import tiny_config, train_tokenizer

    hf = os.path.join(work, "hf")
    config = tiny_config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.seq),
    )
    torch.manual_seed(0)
    model = family_of(config).causal_lm(config).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    model.save_pretrained(hf, max_shard_size=args.shard)
    del model
    train_tokenizer(hf, vocab_size=512)
    return hf


def disk_mib(path: str) -> float:
    """Bytes of the files under ``path``, in MiB."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 2**20


# Runs convert2ckpt.py's main, then prints the process's peak RSS (VmHWM, kB): this program's own peak, where
# getrusage's ru_maxrss would also count what the process held before its exec (a fork of this script).
CONVERT = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    assert not e.code, e.code\n"
    "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0])"
)


def convert(hf: str, ckpt: str) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of ``convert2ckpt.py --input hf --output ckpt`` (--overwrite: each round)."""
    argv = [os.path.join(ROOT, "convert2ckpt.py"), "--input", hf, "--output", ckpt, "--overwrite"]
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT, *argv],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return time.time() - start, int(proc.stdout.split()[-1]) / 1024


def time_rank(out_dir: str, train_argv: list[str]) -> None:
    """Inside a rank: run train.py, noting the wall-clock times at the start and the end of each step
    (``out_dir/rank<R>.json``)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    steps: list[tuple[float, float]] = []
    train_batch = PipelineEngine.train_batch

    def timed_train_batch(self, *a, **k):
        start = time.time()
        try:
            return train_batch(self, *a, **k)
        finally:
            steps.append((start, time.time()))

    PipelineEngine.train_batch = timed_train_batch
    run_train_recording(out_dir, train_argv, steps)


def timed_run(args, model: str, data: str, work: str, name: str, overrides: list[str]) -> tuple[dict, list[list], str]:
    """train.py from ``model`` with ``overrides`` (after the shared ones: later ones win), each rank timed by
    ``--time-rank``: (measure_train's figures and the launch time, per rank the (start, end) of every step, the
    output directory)."""
    out, timing = os.path.join(work, name), os.path.join(work, f"{name}_steps")
    shutil.rmtree(timing, ignore_errors=True)
    os.makedirs(timing)
    given = {o.split("=")[0] for o in overrides}
    shared = [o for o in run_overrides(args, model, data, work, out) if o.split("=")[0] not in given]
    layout = [f"num_stages={args.stages}", "gradient_accumulation_steps=4", "data.shuffle=false"]
    launched = time.time()
    r = measure_train(
        args.gpus, shared + layout + overrides, out, 0, name, ["benchmarks/bench_hf_start.py", "--time-rank", timing]
    )
    r["launched"] = launched
    steps = []
    for file in sorted(os.listdir(timing)):
        with open(os.path.join(timing, file)) as f:
            steps.append(json.load(f))
    return r, steps, out


def run(args, model: str, data: str, work: str, name: str) -> dict:
    """One train.py run of one step from ``model``: seconds from the launch to the first step's start and end (the
    slowest rank's), and each rank's load report."""
    r, steps, out = timed_run(args, model, data, work, name, [])
    start = r["launched"]
    first = [rank[0] for rank in steps]
    loads = {int(m[1]): m.groups()[1:] for m in LOAD.finditer(r["log"])}
    if len(loads) != args.gpus:
        raise SystemExit(f"{name}: {len(loads)} load reports in train.py's log, expected {args.gpus}")
    shutil.rmtree(out, ignore_errors=True)  # its final checkpoint: GBs at the default size
    return {
        "startup_s": max(begin for begin, _ in first) - start,
        "first_step_s": max(end for _, end in first) - start,
        "loss": r["loss"],
        "load": [tuple(float(v) for v in loads[rank]) for rank in sorted(loads)],  # MiB read, s, peak, before, params
    }


def save_run(args, hf: str, data: str, work: str, background: bool) -> dict:
    """One train.py run from ``hf`` saving every 2 steps, ``background``: save_async. Per rank the (start, end) of
    every step; the intermediate checkpoints' step numbers; the size of one; the run's peak RSS per rank."""
    name = "save_async" if background else "save_sync"
    r, steps, out = timed_run(args, hf, data, work, name, ["save_steps=2", f"save_async={str(background).lower()}"])
    saves = list(range(2, args.steps, 2))  # the last step's save is at once in both: not counted
    size = disk_mib(os.path.join(out, "global_step2"))
    shutil.rmtree(out, ignore_errors=True)
    return {"steps": steps, "saves": saves, "size_mib": size, "peak": r["peak"], "log": r["log"]}


def save_figures(run: dict) -> dict:
    """Seconds training stopped per save, and step times after a save and elsewhere (slowest rank; steps 1-based)."""
    n = len(run["steps"][0])
    gap = [max(rank[k][0] - rank[k - 1][1] for rank in run["steps"]) for k in range(1, n)]  # [n-1]: after step k
    took = [max(rank[k][1] - rank[k][0] for rank in run["steps"]) for k in range(n)]  # [n]: step k + 1
    saved = set(run["saves"])
    baseline = statistics.median(g for k, g in enumerate(gap, 1) if k not in saved and k > 1)
    after = [took[k] for k in saved if k < n]  # the step after each save (index k = step k + 1)
    others = [took[k] for k in range(2, n) if k not in saved]
    return {
        "stopped": [gap[k - 1] - baseline for k in sorted(saved)],
        "after": statistics.median(after),
        "others": statistics.median(others),
    }


def print_save_table(args, results: dict) -> None:
    print(
        f"saves every 2 steps of {args.steps} (the last step's not counted: written at once either way); "
        f"{args.gpus} ranks, pipe {args.stages} x data {args.gpus // args.stages}, train.py {args.precision} "
        f"ds={args.ds}; per save the slowest rank's gap from the saving step's end to the next step's start, less "
        f"the median gap after a step without a save; {args.repeat} rounds, each figure in brackets"
    )
    print(
        "| saving | checkpoint MiB | training stopped per save, s | step after a save, s | other steps, s | "
        "peak RSS per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        figures = [save_figures(r) for r in runs]
        stopped = [s for f in figures for s in f["stopped"]]
        after, others = [f["after"] for f in figures], [f["others"] for f in figures]
        print(
            f"| {name} | {runs[0]['size_mib']:.0f} | {median_of(stopped)} | {median_of(after)} | {median_of(others)} "
            f"| {', '.join(f'{p:.0f}' for p in runs[-1]['peak'])} |"
        )


def median_of(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def median_and_each(runs: list[dict], key: str) -> str:
    return f"{statistics.median(r[key] for r in runs):.1f} ({', '.join(f'{r[key]:.1f}' for r in runs)})"


def print_table(args, hf_mib: float, ckpt_mib: float, conversions: list[float], peak: float, results: dict) -> None:
    kv = args.hidden // args.heads * args.kv_heads
    layer = 2 * args.hidden * (args.hidden + kv) + 3 * args.hidden * args.intermediate + 2 * args.hidden
    params = 2 * args.vocab * args.hidden + args.hidden + args.layers * layer
    dp = args.gpus // args.stages
    print(
        f"llama: hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, intermediate "
        f"{args.intermediate}, vocab {args.vocab}: {params / 1e6:.1f} M parameters, {args.dtype} safetensors in "
        f"shards of {args.shard}; {args.gpus} ranks, pipe {args.stages} x data {dp}, train.py {args.precision} "
        f"ds={args.ds}, seq {args.seq}; convert2ckpt.py {statistics.median(conversions):.1f} s "
        f"({', '.join(f'{c:.1f}' for c in conversions)}), its peak RSS {peak:.0f} MiB"
    )
    print(
        "| start | conversion s | launch to start of step 1, s | launch to end of step 1, s | total to end of step 1, "
        "s | disk MiB | read per rank (MiB) | load s per rank | peak RSS at load per rank (MiB) | load's RSS rise per "
        "rank (MiB) | stage parameters per rank (MiB) | loss step 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, convert_s, disk in (
        ("HF directory", 0.0, hf_mib),
        ("convert, then layer files", statistics.median(conversions), hf_mib + ckpt_mib),
    ):
        runs = results[name]
        load = runs[0]["load"]
        print(
            f"| {name} | {convert_s:.1f} | {median_and_each(runs, 'startup_s')} | "
            f"{median_and_each(runs, 'first_step_s')} | "
            f"{convert_s + statistics.median(r['first_step_s'] for r in runs):.1f} | {disk:.0f} | "
            f"{per_rank_text([x[0] for x in load])} | {per_rank_text([x[1] for x in load], '{:.2f}')} | "
            f"{per_rank_text([x[2] for x in load])} | {per_rank_text([x[2] - x[3] for x in load])} | "
            f"{per_rank_text([x[4] for x in load])} | {runs[0]['loss']:.6f} |"
        )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_as_rank(argv, "--time-rank", time_rank):  # inside a rank
        return
    args = parse_args(argv)
    from models.tiny import write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_hf_start-")
    try:
        hf = make_hf_dir(args, work)
        ckpt = os.path.join(work, "ckpt")
        data = os.path.join(work, "train.jsonl")
        write_random_tokens(data, 4 * args.micro_batch * (args.gpus // args.stages), args.seq, vocab_size=args.vocab)
        if args.save:
            results = {"at once (save_async=false)": [], "in the background (save_async=true)": []}
            for round_ in range(args.repeat):
                for name in list(results) if round_ % 2 == 0 else list(results)[::-1]:
                    r = save_run(args, hf, data, work, background="background" in name)
                    results[name].append(r)
                    print(f"[bench_hf_start] {name}: stopped {save_figures(r)['stopped']}", file=sys.stderr)
            print_save_table(args, results)
            return
        starts = [("HF directory", hf, "from_hf"), ("convert, then layer files", ckpt, "from_ckpt")]
        conversions, peak, results = [], 0.0, {name: [] for name, _, _ in starts}
        for round_ in range(args.repeat):
            seconds, convert_peak = convert(hf, ckpt)
            conversions.append(seconds)
            peak = max(peak, convert_peak)
            print(f"[bench_hf_start] converted in {seconds:.1f} s", file=sys.stderr, flush=True)
            for name, model, out in starts if round_ % 2 == 0 else starts[::-1]:
                r = run(args, model, data, work, out)
                results[name].append(r)
                print(
                    f"[bench_hf_start] {name}: step 1 {r['startup_s']:.1f}-{r['first_step_s']:.1f} s", file=sys.stderr
                )
        print_table(args, disk_mib(hf), disk_mib(ckpt), conversions, peak, results)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
