"""Per-rank peak host memory when loading one pipeline stage, for 1, 2 and 4 stages of one model.

    python benchmarks/bench_load.py [--hidden 1024 --layers 24 --vocab 32000] [--work work/bench_load]
    python benchmarks/bench_load.py --layouts 1x2,1x4,2x2    # stages x tensor_parallel

Builds a random Llama of that shape (fp32), converts it, then for each layout K x T launches
`deepspeed --num_gpus K*T train.py num_stages=K tensor_parallel=T max_steps=0` (data parallel 1) and
reads every rank's load report: the parameters it holds (its stage, or its tensor-parallel piece of
it), RSS before the stage was built (imports + process group) and peak RSS after loading.

The framework's own share is measured on an "empty" rank: the same launch (same K, same command) with
a tiny model (hidden 64, vocabulary 512: under 1 MiB of parameters per stage), whose peak RSS at load
is everything but the weights. Target per rank: peak RSS at load <= 1.3 x stage parameter bytes +
that rank's empty-rank peak.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.launch import deepspeed_command  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402

REPORT = re.compile(
    r"rank (\d+): stage (\d+) .*?\(\d+ specs, ([\d.]+) M params\).*peak RSS at load (\d+) MiB "
    r"\(before building the stage (\d+) MiB, stage parameters (\d+) MiB\)"
)
TARGET = 1.3  # peak RSS at load <= TARGET x stage bytes + empty-rank peak


def make_checkpoint(work: str, config) -> str:
    """A random fp32 Llama of ``config``, converted to layer files in ``work/ckpt`` (reused if there)."""
    from models.files.hf_convert import hf_to_stages
    from models.tiny import save_random_model

    hf_dir, ckpt = os.path.join(work, "hf"), os.path.join(work, "ckpt")
    shape_file = os.path.join(work, "shape.json")
    shape = json.dumps(config.to_dict(), sort_keys=True)
    if not (
        os.path.isfile(os.path.join(ckpt, "latest")) and os.path.isfile(shape_file) and open(shape_file).read() == shape
    ):
        os.makedirs(work, exist_ok=True)
        save_random_model(config, hf_dir)
        hf_to_stages(hf_dir, ckpt, overwrite=True)
        with open(shape_file, "w") as f:
            f.write(shape)
    return ckpt


def load_reports(ckpt: str, k: int, data: str, out: str, tp: int = 1) -> dict[int, tuple]:
    """rank -> (stage, M params, stage MiB, RSS before stage MiB, peak RSS at load MiB) for K stages
    (each split over ``tp`` ranks)."""
    train_args = [
        f"model_name_or_path={ckpt}",
        f"num_stages={k}",
        f"tensor_parallel={tp}",
        "loss_chunk_tokens=64",
        "max_steps=0",
        f"data.train_file={data}",
        "data.max_seq_length=64",
        f"gradient_accumulation_steps={k}",
        "precision=fp32",
        f"output_dir={out}",
    ]
    cmd = deepspeed_command(k * tp, "train.py", train_args, port=free_port())
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"{ckpt}, num_stages={k} tensor_parallel={tp} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    reports = {}
    for m in REPORT.finditer(proc.stdout):
        rank, stage, mparams, peak, before, param_mib = m.groups()
        reports[int(rank)] = (int(stage), float(mparams), int(param_mib), int(before), int(peak))
    if len(reports) != k * tp:
        sys.exit(f"{ckpt}, {k} x {tp}: found {len(reports)} load reports, expected {k * tp}:\n{proc.stdout[-3000:]}")
    return reports


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layouts", default="1,2,4", help="comma-separated stage counts, or STAGESxTP")
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_load"))
    args = p.parse_args()

    from models.llama_pipe import model_parameters
    from models.tiny import tiny_config

    layouts = [tuple(int(n) for n in (x + "x1").split("x")[:2]) for x in args.layouts.split(",")]
    config = tiny_config(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
    )
    # hidden 64, vocabulary 512, 4 KV heads: splits over up to 4 tensor-parallel ranks
    empty_config = tiny_config(num_hidden_layers=max(4, *(k for k, _ in layouts)), num_key_value_heads=4)
    ckpt = make_checkpoint(args.work, config)
    empty_ckpt = make_checkpoint(os.path.join(args.work, "empty"), empty_config)
    data = os.path.join(args.work, "train.jsonl")
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"input_ids": list(range(3, 67))}) + "\n")

    rows = []
    for k, tp in layouts:
        empty = load_reports(empty_ckpt, k, data, os.path.join(args.work, "out_empty"), tp)
        full = load_reports(ckpt, k, data, os.path.join(args.work, "out"), tp)
        for rank in sorted(full):
            stage, mparams, param_mib, before, peak = full[rank]
            rows.append((f"{k} x {tp}", rank, stage, mparams, param_mib, before, empty[rank][4], peak))

    total = model_parameters(config)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {total / 1e6:.0f} M params, "
        f"{total * 4 / 2**20:.0f} MiB fp32; empty rank: the same launch with a {empty_config.num_hidden_layers}-layer "
        f"hidden-{empty_config.hidden_size} model"
    )
    print(
        "| stages x tensor | rank | stage | params (M) | rank's params (MiB) | RSS before stage (MiB) | "
        f"empty-rank peak (MiB) | peak RSS at load (MiB) | limit {TARGET} x params + empty (MiB) | "
        "(peak - empty) / param bytes | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, rank, stage, mparams, param_mib, before, empty_peak, peak in rows:
        limit = TARGET * param_mib + empty_peak
        print(
            f"| {layout} | {rank} | {stage} | {mparams:.1f} | {param_mib} | {before} | {empty_peak} | {peak} | "
            f"{limit:.0f} | {(peak - empty_peak) / param_mib:.2f} | {'met' if peak <= limit else 'MISSED'} |"
        )


if __name__ == "__main__":
    main()
