"""Long sequences on the same ranks: sequence parallelism 1, 2, 4 (and the dense-mask attention), through train.py.

    python benchmarks/bench_long_context.py                 # CPU: 4 ranks, seq 4096, 8192, 16384; about 10 minutes
    python benchmarks/bench_long_context.py --gpus 8 --seqs 32768,65536 --precision bf16 --hidden-size 4096 ...

A random Llama of the given shape is written and converted once; for each sequence length every case runs
train.py on ``--gpus`` ranks with ``num_stages=1`` (ZeRO-1) and the same global batch of ``--global-batch`` packed
rows (documents of ``--doc`` tokens): ``sp N`` is ``sequence_parallel=N`` (data parallel over the rest),
``sp 1, dense mask`` the same as sp 1 with ``attention=dense_mask`` (a [B,1,S,S] mask per layer). Per case: the
median step time after --warmup steps, real tokens per second, and per rank the step's peak of allocated
tensors above its start (train.py's ``count_step_memory``: activations, gradients, loss buffer,
temporaries) and the peak memory (host RSS on CPU, the GPU allocator's peak on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import add_run_args, bench_model, measure_train, run_overrides  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, seq=4096, micro_batch=1, global_batch=4, steps=4)
    p.set_defaults(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1024, warmup=1
    )
    p.add_argument("--seqs", default="4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--sps", default="1,2,4", help="sequence_parallel values, comma-separated")
    p.add_argument("--doc", type=int, default=1024, help="tokens per packed document")
    return p.parse_args(argv)


def write_documents(path: str, rows: int, seq: int, doc: int, vocab_size: int) -> None:
    """``rows`` x (seq / doc) documents of ``doc`` random tokens, a data=tokens file that packs into ``rows`` rows."""
    import torch

    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(rows * (seq // doc)):
            f.write(json.dumps({"input_ids": torch.randint(3, vocab_size, (doc,), generator=g).tolist()}) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    seqs, sps = [int(s) for s in args.seqs.split(",")], [int(s) for s in args.sps.split(",")]
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_long_context-")
    args.seq = max(seqs)
    ckpt = bench_model(args, work)
    print(
        f"{args.gpus} ranks, ds={args.ds}, {args.precision}, hidden {args.hidden_size}, {args.num_hidden_layers} "
        f"layers, {args.num_attention_heads} heads, vocab {args.vocab_size}, global batch {args.global_batch} packed "
        f"rows of documents of {args.doc} tokens, {args.steps} steps (median after {args.warmup})"
    )
    print(
        "| seq | case | s/step | tokens/s | step's peak of tensors above its start per rank (MiB) | peak memory per "
        "rank (MiB) |\n|---|---|---|---|---|---|",
        flush=True,
    )
    for seq in seqs:
        data = os.path.join(work, f"docs_{seq}.jsonl")
        write_documents(data, args.steps * args.global_batch, seq, min(args.doc, seq), args.vocab_size)
        cases = [(sp, "documents") for sp in sps] + [(1, "dense_mask")]
        for sp, attention in cases:
            dp = args.gpus // sp
            name = f"sp {sp}" + (", dense mask" if attention == "dense_mask" else "")
            out = os.path.join(work, f"{seq}_{sp}_{attention}")
            args.seq = seq
            overrides = run_overrides(args, ckpt, data, work, out) + [
                "data=tokens",
                "data.packing=true",
                "data.shuffle=false",
                "num_stages=1",
                f"sequence_parallel={sp}",
                f"attention={attention}",
                f"gradient_accumulation_steps={args.global_batch // (args.micro_batch * dp)}",
                "count_step_memory=true",
                "loss_chunk_tokens=1024",
            ]
            r = measure_train(args.gpus, overrides, out, args.warmup, name)
            peaks = ", ".join(f"{v:.0f}" for v in r["peak"])
            print(
                f"| {seq} | {name} | {r['step_s']:.2f} | {r['tokens_s']:.0f} | "
                f"{', '.join(f'{v:.0f}' for v in r['step_peak'])} | {r['peak_kind']} {peaks} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
