"""LoRA against full fine-tuning: the same model, layout, data and steps through train.py.

    python scripts/bench_lora.py                                  # CPU: 4 ranks, pipe 2 x data 2, fp32
    python scripts/bench_lora.py --gpus 8 --stages 4 --precision bf16 --hidden-size 4096 ...   # a GPU node

A random Llama of the given shape is written and converted once; train.py then runs it with
peft.method=none, peft.method=lora and LoRA on an NF4 base (peft.quantize=nf4), each rank one CPU thread
on CPU. Per case the table gives the median step time after --warmup steps, real tokens per second, and
per rank the model-state bytes train.py measures (weights + gradients + optimizer states,
training/memory_census.py) and its peak memory (host RSS on CPU, the GPU allocator's peak on a GPU).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero1")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--num-hidden-layers", type=int, default=8)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-key-value-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--cases", default="full,lora,qlora", help="comma-separated: full, lora, qlora (NF4 base)")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")
    return p.parse_args(argv)


def per_rank(log: str, marker: str, pattern: str) -> list[float]:
    """The per-rank numbers of train.py's line holding ``marker``."""
    line = next((x for x in log.splitlines() if marker in x), "")
    return [float(v) for v in re.findall(pattern, line)]


def run_case(args, name: str, ckpt: str, data: str, work: str) -> dict:
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"model_name_or_path={ckpt}",
        f"output_dir={out}",
        f"data.train_file={data}",
        f"data.max_seq_length={args.seq}",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        f"num_stages={args.stages}",
        f"ds={args.ds}",
        f"precision={args.precision}",
        f"micro_batch_size={args.micro_batch}",
        f"gradient_accumulation_steps={args.grad_accum}",
        f"max_steps={args.steps}",
        "save_steps=0",
        "min_free_disk_gb=0",
    ]
    if name in ("lora", "qlora"):
        overrides += ["peft.method=lora", f"peft.r={args.lora_rank}", f"peft.alpha={2 * args.lora_rank}"]
    if name == "qlora":
        overrides.append("peft.quantize=nf4")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.gpus), "train.py", *overrides]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False
    )
    if proc.returncode:
        raise SystemExit(f"{name}: train.py failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    timed = steps[args.warmup :] or steps
    log = proc.stdout
    states = per_rank(log, "model states per rank", r"= ([\d.]+)")
    gpu = per_rank(log, "peak memory per rank", r"GPU (\d+)")
    return {
        "step_s": statistics.median(r["step_s"] for r in timed),
        "tokens_s": statistics.median(r["tokens_per_s"] for r in timed),
        "states": states,
        "peak": gpu or per_rank(log, "peak memory per rank", r"host (\d+)"),
        "peak_kind": "GPU" if gpu else "host RSS",
        "loss": steps[-1]["loss"],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    from models.hf_io import hf_to_stages
    from models.tiny import save_random_model, tiny_config, train_tokenizer, write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_lora-")
    hf, ckpt, data = (os.path.join(work, n) for n in ("hf", "ckpt", "train.jsonl"))
    if not os.path.isdir(ckpt):
        config = tiny_config(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            max_position_embeddings=max(512, args.seq),
        )
        save_random_model(config, hf, seed=0)
        train_tokenizer(hf, vocab_size=512)  # side files only: the data are token ids
        hf_to_stages(hf, ckpt)
    samples = args.steps * args.micro_batch * args.grad_accum * (args.gpus // args.stages)
    write_random_tokens(data, samples, args.seq, vocab_size=args.vocab_size)
    results = {name: run_case(args, name, ckpt, data, work) for name in args.cases.split(",")}
    dp = args.gpus // args.stages
    print(
        f"pipe {args.stages} x data {dp}, ds={args.ds}, {args.precision}, hidden {args.hidden_size}, "
        f"{args.num_hidden_layers} layers, vocab {args.vocab_size}, seq {args.seq}, micro {args.micro_batch} x "
        f"grad_acc {args.grad_accum}, {args.steps} steps (median after {args.warmup}); LoRA r={args.lora_rank} on "
        "every decoder linear layer"
    )
    kind = next(iter(results.values()))["peak_kind"]
    print(f"{'case':<6} {'s/step':>7} {'tokens/s':>9}  {'model states per rank (MiB)':<34} peak {kind} per rank (MiB)")
    for name, r in results.items():
        states = ", ".join(f"{v:.1f}" for v in r["states"])
        peak = ", ".join(f"{v:.0f}" for v in r["peak"])
        print(f"{name:<6} {r['step_s']:>7.3f} {r['tokens_s']:>9.0f}  {states:<34} {peak}")
    full = results.get("full")
    for name, r in results.items():
        if full is not None and name != "full":
            ratio = lambda key: max(r[key]) / max(full[key])
            print(
                f"{name} / full: step time {r['step_s'] / full['step_s']:.2f}, model states {ratio('states'):.2f} "
                f"(largest rank), peak {ratio('peak'):.2f}"
            )


if __name__ == "__main__":
    main()
