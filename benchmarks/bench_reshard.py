"""Resharding a ~1.5 GB checkpoint: time and peak memory, offline and in a resume on another layout.

    python benchmarks/bench_reshard.py [--hidden 768] [--layers 7] [--vocab 32000] [--work work/bench_reshard]

A random fp32 Llama (hidden 768, 12 heads / 4 KV heads, 7 layers, vocab 32000: 93 M parameters) trains
one step on pipe 2 x data 2 with ZeRO-1 and saves: layer files (4 bytes per parameter) plus fp32
masters and Adam moments (12 bytes), ~1.5 GB. Then:

  offline    python convert2ckpt.py --reshard (a fresh process): wall time, and its peak RSS (VmHWM)
  resume     train.py resumes that checkpoint on pipe 4 x data 1 for one more step: the time every rank
             takes to set its parameters' states (train.py's "resume: optimizer states of every
             parameter set in" line) and the whole job's peak RSS per rank, next to the same job
             (pipe 4 x data 1, two steps) started from the converted weights instead

The files live in --work (git-ignored) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models.files.hf_convert import hf_to_stages  # noqa: E402
from models.llama_pipe import model_parameters  # noqa: E402
from models.tiny import save_random_model, tiny_config, train_tokenizer, write_random_tokens  # noqa: E402
from tools.launch import deepspeed_command  # noqa: E402
from training.observation.metrics import read_final_record  # noqa: E402

CONVERT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("convert2ckpt", "convert2ckpt.py")
converter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(converter)
rc = converter.main(sys.argv[1:])
with open("/proc/self/status") as f:
    print("VmHWM", next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) // 1024)
sys.exit(rc)
"""


def train(work: str, out: str, stages: int, grad_acc: int, steps: int) -> str:
    args = {
        "model_name_or_path": os.path.join(work, "ckpt"),
        "output_dir": out,
        "data": "tokens",
        "data.train_file": os.path.join(work, "tokens.jsonl"),
        "data.max_seq_length": 64,
        "data.cache_dir": os.path.join(work, "cache"),
        "num_stages": stages,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": grad_acc,
        "max_steps": steps,
        "precision": "fp32",
        "ds": "zero1",
        "min_free_disk_gb": 0,
    }
    cmd = deepspeed_command(4, "train.py", [f"{k}={v}" for k, v in args.items()])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"train.py failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def peak_rss(output_dir: str) -> str:
    """Per rank, the peak host RSS (MiB) of the run in ``output_dir``: train.py's final figures, as it prints them."""
    final = read_final_record(output_dir)
    return ", ".join(f"{p['host']:.0f}" for p in final["peak_memory_mib"]) if final else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_reshard"))
    a = p.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    try:
        hf = os.path.join(a.work, "hf")
        config = tiny_config(
            hidden_size=a.hidden,
            intermediate_size=a.hidden * 8 // 3,
            num_hidden_layers=a.layers,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=a.vocab,
        )
        save_random_model(config, hf, seed=0)
        train_tokenizer(hf, vocab_size=512)
        hf_to_stages(hf, os.path.join(a.work, "ckpt"))
        write_random_tokens(os.path.join(a.work, "tokens.jsonl"), 64, 64, 512)
        run = os.path.join(a.work, "run")
        train(a.work, run, stages=2, grad_acc=2, steps=1)
        tag_dir = os.path.join(run, "global_step1")
        size = sum(os.path.getsize(os.path.join(tag_dir, f)) for f in os.listdir(tag_dir))
        start = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", CONVERT, "--reshard", "--input", run, "--output", os.path.join(a.work, "portable")],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        offline_s = time.time() - start
        if proc.returncode:
            sys.exit(f"convert2ckpt.py --reshard failed:\n{proc.stderr[-3000:]}")
        offline_rss = re.search(r"VmHWM (\d+)", proc.stdout).group(1)
        resumed = train(a.work, run, stages=4, grad_acc=4, steps=2)
        fresh = os.path.join(a.work, "fresh")
        train(a.work, fresh, stages=4, grad_acc=4, steps=2)
        set_s = re.search(r"optimizer states of every parameter set in ([\d.]+) s", resumed).group(1)
        print(
            f"checkpoint: {size / 1e9:.2f} GB, {model_parameters(config) / 1e6:.0f} M parameters "
            "(pipe 2 x data 2, ZeRO-1, fp32)"
        )
        print()
        print("| what | time | peak RSS (MiB) |")
        print("|---|---|---|")
        print(f"| convert2ckpt.py --reshard (offline, whole process) | {offline_s:.1f} s | {offline_rss} |")
        print(f"| resume on pipe 4 x data 1: states set | {set_s} s | {peak_rss(run)} per rank |")
        print(f"| the same job on pipe 4 x data 1, not resuming | - | {peak_rss(fresh)} per rank |")
        print(
            json.dumps(
                {"bytes": size, "offline_s": offline_s, "offline_rss_mib": int(offline_rss), "set_s": float(set_s)}
            )
        )
    finally:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
