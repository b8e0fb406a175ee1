"""Per-rank peak host memory when loading one pipeline stage, for 1, 2 and 4 stages of one model.

    python scripts/bench_load.py [--hidden 1024 --layers 24 --vocab 32000] [--work work/bench_load]

Builds a random Llama of that shape (fp32), converts it, then for each stage count K launches
`deepspeed --num_gpus K train.py num_stages=K max_steps=0` (data parallel 1: one rank per stage) and
reads every rank's load report. Prints one table row per rank: stage parameters, RSS before the stage
was built (imports + process group), peak RSS after loading, and the growth over stage parameters.
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

REPORT = re.compile(
    r"rank (\d+): stage (\d+) .*?\(\d+ specs, ([\d.]+) M params\).*peak RSS at load (\d+) MiB "
    r"\(before building the stage (\d+) MiB, stage parameters (\d+) MiB\)"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--stages", default="1,2,4", help="comma-separated stage counts")
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_load"))
    args = p.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    from convert2ckpt import hf_to_stages
    from models.tiny import save_random_model, tiny_config

    hf_dir, ckpt, data = (os.path.join(args.work, n) for n in ("hf", "ckpt", "train.jsonl"))
    os.makedirs(args.work, exist_ok=True)
    config = tiny_config(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                         vocab_size=args.vocab, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64)
    if not os.path.isfile(os.path.join(ckpt, "latest")):
        save_random_model(config, hf_dir)
        hf_to_stages(hf_dir, ckpt, overwrite=True)
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"input_ids": list(range(3, 67))}) + "\n")

    rows = []
    for k in (int(s) for s in args.stages.split(",")):
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(k), "train.py",
               f"model_name_or_path={ckpt}", f"num_stages={k}", "max_steps=0", f"data.train_file={data}",
               "data.max_seq_length=64", f"gradient_accumulation_steps={k}", "precision=fp32",
               f"output_dir={os.path.join(args.work, 'out')}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"num_stages={k} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        for m in REPORT.finditer(proc.stdout):
            rank, stage, mparams, peak, before, param_mib = m.groups()
            rows.append((k, int(rank), int(stage), float(mparams), int(param_mib), int(before), int(peak)))

    with torch.device("meta"):  # count without allocating
        total = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {total / 1e6:.0f} M params, "
          f"{total * 4 / 2**20:.0f} MiB fp32")
    print("| stages | rank | stage | params (M) | stage params (MiB) | RSS before stage (MiB) | peak RSS at load (MiB) | growth / stage bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for k, rank, stage, mparams, param_mib, before, peak in rows:
        print(f"| {k} | {rank} | {stage} | {mparams:.1f} | {param_mib} | {before} | {peak} | {(peak - before) / param_mib:.2f} |")


if __name__ == "__main__":
    main()
