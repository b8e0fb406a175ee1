"""Per-rank peak host memory when train.py loads a model for ZeRO-3, before and after zero.Init.

    python benchmarks/bench_zero3_load.py [--hidden 2048 --layers 5 --vocab 32000] [--ranks 4] [--work DIR]

Builds a random fp32 Llama of that shape (1.5 GB at the defaults), converts it to layer files, then
launches `deepspeed --num_gpus 4 train.py num_stages=1 ds=<config> max_steps=0 precision=fp32`:

- after, for ds=zero3 and ds=zero3_offload: the model is built under deepspeed.zero.Init and each rank
  keeps only its partition of each tensor as the layer files are read;
- before, for ds=zero3 (``--before zero3,zero3_offload`` for both): BENCH_ZERO3_FULL_BUILD=1, the
  previous path (models/files/zero3_load.py): every rank builds the whole model, loads every layer file into it,
  and deepspeed.initialize partitions it. Parameter offload changes nothing there (all of it happens
  before deepspeed.initialize; measured equal to the MiB), so by default it runs once.

Every rank's load report gives its peak RSS at load. The framework's own share is measured on an
"empty" rank: the same launch (ds=zero3) with a tiny model (hidden 64, vocabulary 512, under 1 MiB).
Target per rank: peak RSS at load <= 1.3 x (model bytes / ranks + largest layer's bytes) + that rank's
empty-rank peak. The last column is the rank's peak over the whole launch (train.py's last line): it
includes deepspeed.initialize's ZeRO-3 model states (fp32 partitions, gradients, Adam moments, reduce
bucket), which at 4 ranks outweigh the load on either path. About 3 minutes on a 2-core machine (4
launches of ~45 s: start-up and deepspeed.initialize; the load itself takes a second or two), 4 with
``--before zero3,zero3_offload``; the model is written to a temporary directory unless --work names
one to keep (and reuse) it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.launch import deepspeed_command  # noqa: E402
from training.observation.metrics import read_final_record  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402

REPORT = re.compile(
    r"rank (\d+): stage \d+ .*\| (loaded .*?) in [\d.]+ s \| peak RSS at load (\d+) MiB "
    r"\(before building the stage (\d+) MiB"
)
TARGET = 1.3  # peak RSS at load <= TARGET x (model bytes / ranks + largest layer) + empty-rank peak
CONFIGS = ("zero3", "zero3_offload")
FULL_BUILD_ENV = (
    "BENCH_ZERO3_FULL_BUILD"  # models.files.zero3_load.FULL_BUILD_ENV (not imported: no deepspeed import here)
)
MIB = 2**20


def make_checkpoint(work: str, config) -> str:
    """A random fp32 model of ``config`` converted to layer files in ``work/ckpt`` (reused if there)."""
    from models.files.hf_convert import hf_to_stages
    from models.tiny import save_random_model

    hf_dir, ckpt, shape_file = (os.path.join(work, name) for name in ("hf", "ckpt", "shape.json"))
    shape = json.dumps(config.to_dict(), sort_keys=True)
    if os.path.isfile(os.path.join(ckpt, "latest")) and os.path.isfile(shape_file):
        with open(shape_file) as f:
            if f.read() == shape:
                return ckpt
    os.makedirs(work, exist_ok=True)
    save_random_model(config, hf_dir)
    hf_to_stages(hf_dir, ckpt, overwrite=True)
    shutil.rmtree(hf_dir)  # not needed again
    with open(shape_file, "w") as f:
        f.write(shape)
    # Written back to disk now, not during the first launch: 4 ranks of the previous path need ~2.5 GB
    # each, and a freshly written model's dirty pages made that launch 2.5-3x slower (115-129 s vs 45 s).
    os.sync()
    return ckpt


def load_reports(ckpt: str, ds: str, ranks: int, work: str, name: str, full_build: bool) -> dict[int, tuple]:
    """rank -> (peak RSS at load MiB, RSS before building MiB, train.py's load line, the run's peak RSS
    MiB: after deepspeed.initialize too) of one launch."""
    data = os.path.join(work, "train.jsonl")
    train_args = [
        f"model_name_or_path={ckpt}",
        "num_stages=1",
        f"ds={ds}",
        "max_steps=0",
        "precision=fp32",
        f"data.train_file={data}",
        "data.max_seq_length=64",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        f"output_dir={os.path.join(work, 'out', name)}",
    ]
    cmd = deepspeed_command(ranks, "train.py", train_args, port=free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", FULL_BUILD_ENV: "1" if full_build else "0"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    final = read_final_record(os.path.join(work, "out", name)) or {}  # train.py's final figures, as it prints them
    run_peaks = {r: int(f"{p['host']:.0f}") for r, p in enumerate(final.get("peak_memory_mib", []))}
    reports = {
        int(r): (int(peak), int(before), line, run_peaks.get(int(r), 0))
        for r, line, peak, before in REPORT.findall(proc.stdout)
    }
    if len(reports) != ranks:
        sys.exit(f"{name}: found {len(reports)} load reports, expected {ranks}:\n{proc.stdout[-3000:]}")
    return reports


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated ds= configs (ZeRO-3)")
    p.add_argument("--before", default="zero3", help="the configs of --configs to run the previous path for too")
    p.add_argument("--work", help="keep the models and runs here (default: a temporary directory)")
    args = p.parse_args()

    from models.llama_pipe import model_parameters, spec_parameter_counts
    from models.tiny import tiny_config

    config = tiny_config(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.6875),  # 5504 at hidden 2048, Llama's ratio
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
    )
    empty_config = tiny_config()  # hidden 64, vocabulary 512
    model_mib = model_parameters(config) * 4 / MIB
    largest_mib = max(spec_parameter_counts(config)) * 4 / MIB
    budget_mib = TARGET * (model_mib / args.ranks + largest_mib)

    with tempfile.TemporaryDirectory(prefix="bench_zero3_load_") as tmp:
        work = args.work or tmp
        start = time.time()
        ckpt = make_checkpoint(os.path.join(work, "model"), config)
        empty_ckpt = make_checkpoint(os.path.join(work, "empty"), empty_config)
        with open(os.path.join(work, "train.jsonl"), "w") as f:
            for _ in range(64):
                f.write(json.dumps({"input_ids": list(range(3, 67))}) + "\n")
        print(f"models written and converted in {time.time() - start:.0f} s", flush=True)
        rows = []
        # The framework's share at load is the same for every config: the load happens before deepspeed.initialize.
        empty = load_reports(empty_ckpt, "zero3", args.ranks, work, "empty", full_build=False)
        for ds in args.configs.split(","):
            paths = (("before", True), ("after", False)) if ds in args.before.split(",") else (("after", False),)
            for path, full_build in paths:
                t0 = time.time()
                reports = load_reports(ckpt, ds, args.ranks, work, f"{ds}-{path}", full_build)
                print(f"{ds} {path}: {time.time() - t0:.0f} s; rank 0: {reports[0][2]}", flush=True)
                for rank, (peak, before, _, run_peak) in sorted(reports.items()):
                    rows.append((ds, path, rank, before, empty[rank][0], peak, run_peak))
        print(f"total {time.time() - start:.0f} s", flush=True)

    share = model_mib / args.ranks
    print(
        f"\nmodel: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
        f"{model_parameters(config) / 1e6:.0f} M params, {model_mib:.0f} MiB fp32; largest layer "
        f"{largest_mib:.0f} MiB; {args.ranks} ranks: {share:.0f} MiB per rank's partition; target: peak <= "
        f"empty-rank peak + {TARGET} x ({share:.0f} + {largest_mib:.0f}) = empty + {budget_mib:.0f} MiB"
    )
    print(
        "| ds | load path | rank | RSS before building (MiB) | empty-rank peak (MiB) | peak RSS at load (MiB) "
        "| peak - empty (MiB) | (peak - empty) / (model / ranks + largest layer) | target "
        "| run's peak, after deepspeed.initialize (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ds, path, rank, before, empty_peak, peak, run_peak in rows:
        growth = peak - empty_peak
        print(
            f"| {ds} | {path} | {rank} | {before} | {empty_peak} | {peak} | {growth} | "
            f"{growth / (share + largest_mib):.2f} | {'met' if growth <= budget_mib else 'MISSED'} | {run_peak} |"
        )


if __name__ == "__main__":
    main()
