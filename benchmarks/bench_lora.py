"""LoRA against full fine-tuning: the same model, layout, data and steps through train.py.

    python benchmarks/bench_lora.py                                  # CPU: 4 ranks, pipe 2 x data 2, fp32
    python benchmarks/bench_lora.py --gpus 8 --stages 4 --precision bf16 --hidden-size 4096 ...   # a GPU node

A random Llama of the given shape is written and converted once; train.py then runs it with
peft.method=none, peft.method=lora and LoRA on an NF4 base (peft.quantize=nf4), each rank one CPU thread
on CPU. Per case the table gives the median step time after --warmup steps, real tokens per second, and
per rank the model-state bytes train.py measures (weights + gradients + optimizer states,
training/observation/memory_census.py) and its peak memory (host RSS on CPU, the GPU allocator's peak on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_pipeline_args, bench_model, measure_train, run_overrides  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_args(p)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--cases", default="full,lora,qlora", help="comma-separated: full, lora, qlora (NF4 base)")
    return p.parse_args(argv)


def run_case(args, name: str, ckpt: str, data: str, work: str) -> dict:
    out = os.path.join(work, name)
    overrides = run_overrides(args, ckpt, data, work, out)
    overrides += [f"num_stages={args.stages}", f"gradient_accumulation_steps={args.grad_accum}"]
    if name in ("lora", "qlora"):
        overrides += ["peft.method=lora", f"peft.r={args.lora_rank}", f"peft.alpha={2 * args.lora_rank}"]
    if name == "qlora":
        overrides.append("peft.quantize=nf4")
    return measure_train(args.gpus, overrides, out, args.warmup, name)


def main(argv=None) -> None:
    args = parse_args(argv)
    from models.tiny import write_random_tokens

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_lora-")
    ckpt = bench_model(args, work)
    data = os.path.join(work, "train.jsonl")
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
