"""DPO against SFT: the same model, layout, texts and rows per micro-batch through train.py.

    python benchmarks/bench_dpo.py                                   # CPU: 4 ranks, pipe 2 x data 2, fp32
    python benchmarks/bench_dpo.py --gpus 8 --stages 4 --precision bf16 --hidden-size 4096 ...   # a GPU node

A random Llama of the given shape is written and converted once, and preference pairs of the offline corpus's
words (a prompt of --prompt-words, completions of --completion-words). ``sft`` trains on the same texts as
prompt/response rows, each pair's chosen and rejected completion a row, with micro-batches of 2 x --micro-batch
rows; ``dpo`` trains on the pairs, --micro-batch pairs (the same rows) per micro-batch, after the reference pass
(its stored table removed first, so it runs). Per case: the median step time after --warmup steps, real tokens
per second, and per rank the model-state bytes (training/observation/memory_census.py) and peak memory (host RSS on CPU,
the GPU allocator's peak on a GPU); then the reference pass's time, against the training steps' time per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_pipeline_args, bench_model, measure_train, run_overrides  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_args(p, micro_help="pairs per micro-batch (SFT: twice as many rows)")
    p.add_argument("--prompt-words", type=int, default=20)
    p.add_argument("--completion-words", type=int, nargs=2, default=(20, 50), metavar=("MIN", "MAX"))
    return p.parse_args(argv)


def write_texts(args, pairs_path: str, sft_path: str, num_pairs: int) -> None:
    """The pairs, and the same texts as SFT rows (a pair's chosen, then its rejected completion)."""
    from models.tiny import corpus_documents

    rng = random.Random(0)
    words = [w for doc in corpus_documents() for w in doc.split()]
    text = lambda n: " ".join(words[(start := rng.randrange(len(words) - n)) : start + n])  # noqa: E731
    lo, hi = args.completion_words
    with open(pairs_path, "w") as pairs, open(sft_path, "w") as sft:
        for _ in range(num_pairs):
            prompt, chosen, rejected = text(args.prompt_words), text(rng.randint(lo, hi)), text(rng.randint(lo, hi))
            pairs.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
            for response in (chosen, rejected):
                sft.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def run_case(args, name: str, ckpt: str, data: str, work: str) -> dict:
    out = os.path.join(work, name)
    overrides = run_overrides(args, ckpt, data, work, out)
    overrides += [f"num_stages={args.stages}", f"gradient_accumulation_steps={args.grad_accum}"]
    if name == "dpo":
        overrides.append("data=dpo")
        for root, _, files in os.walk(os.path.join(work, "cache")):  # the reference pass runs, not a stored one
            for f in files:
                if f.startswith("reference-"):
                    os.remove(os.path.join(root, f))
    else:  # the same rows per micro-batch: two for each pair
        overrides = [o for o in overrides if not o.startswith("micro_batch_size=")]
        overrides += ["data=sft", f"micro_batch_size={2 * args.micro_batch}"]
    result = measure_train(args.gpus, overrides, out, args.warmup, name)
    found = re.search(
        r"reference: forward-only pass of the starting model over (\d+) pairs in ([\d.]+) s", result["log"]
    )
    if found:
        result["reference"] = (int(found.group(1)), float(found.group(2)))
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_dpo-")
    ckpt = bench_model(args, work)
    dp = args.gpus // args.stages
    global_pairs = args.micro_batch * args.grad_accum * dp
    pairs, sft = os.path.join(work, "pairs.jsonl"), os.path.join(work, "sft.jsonl")
    write_texts(args, pairs, sft, args.steps * global_pairs)
    results = {name: run_case(args, name, ckpt, path, work) for name, path in (("sft", sft), ("dpo", pairs))}
    print(
        f"pipe {args.stages} x data {dp}, ds={args.ds}, {args.precision}, hidden {args.hidden_size}, "
        f"{args.num_hidden_layers} layers, vocab {args.vocab_size}, seq {args.seq}; {global_pairs} pairs per step "
        f"(micro {args.micro_batch} x grad_acc {args.grad_accum} x dp {dp}), SFT the same {2 * global_pairs} rows; "
        f"{args.steps} steps (median after {args.warmup})"
    )
    kind = results["sft"]["peak_kind"]
    print(f"{'case':<5} {'s/step':>7} {'tokens/s':>9}  {'model states per rank (MiB)':<30} peak {kind} per rank (MiB)")
    for name, r in results.items():
        states = ", ".join(f"{v:.1f}" for v in r["states"])
        peak = ", ".join(f"{v:.0f}" for v in r["peak"])
        print(f"{name:<5} {r['step_s']:>7.3f} {r['tokens_s']:>9.0f}  {states:<30} {peak}")
    sft, dpo = results["sft"], results["dpo"]
    print(
        f"dpo / sft: step time {dpo['step_s'] / sft['step_s']:.2f}, peak {max(dpo['peak']) / max(sft['peak']):.2f} "
        "(largest rank)"
    )
    count, seconds = dpo["reference"]
    per_pair_step = dpo["step_s"] / global_pairs
    print(
        f"reference pass: {count} pairs in {seconds:.2f} s ({seconds / count * 1e3:.1f} ms/pair, "
        f"{seconds / count / per_pair_step:.2f} x a training step's time per pair; "
        f"{seconds / dpo['step_s']:.1f} steps' time)"
    )


if __name__ == "__main__":
    main()
