"""Attention over packed rows, per decoder layer: the dense per-document mask against models/attention.py.

    python benchmarks/bench_attention.py                              # CPU: seq 4k, 8k, 16k, fp32
    python benchmarks/bench_attention.py --seqs 8192,32768 --dtype bf16   # a CUDA GPU (bf16: varlen flash attention)

One decoder layer of a small Llama (or ``--window`` N: Mistral with a sliding window of N tokens), forward and
backward on one packed row of documents of ``--doc`` tokens each (the last one shorter), for
``attention=dense_mask`` (transformers' sdpa with the [1,1,S,S] per-document mask) and ``attention=documents``.
Each case runs in a fresh process: on a GPU the memory is the peak allocated above the layer and its inputs
(``torch.cuda.max_memory_allocated``), on CPU the peak RSS above the RSS before the first forward. The table
also gives the dense mask's own size (S x S booleans) and the mean seconds of ``--repeats`` forward+backward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from parallel.layout import count_arg  # noqa: E402


def run_case(spec: dict) -> dict:
    import torch

    from models.host_memory import current_rss_mb, peak_rss_mb
    from models.llama_pipe import ATTENTION_IMPLEMENTATIONS, decoder_layer_class, prepare_config
    from models.tiny import tiny_config

    cuda = spec["device"] == "cuda"
    dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[spec["dtype"]])
    overrides = dict(sliding_window=spec["window"]) if spec["window"] else {}
    config = tiny_config(
        "mistral" if spec["window"] else "llama",
        hidden_size=spec["hidden"],
        intermediate_size=2 * spec["hidden"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"] // 2,
        **overrides,
    )
    config = prepare_config(config, ATTENTION_IMPLEMENTATIONS[spec["attention"]])
    torch.manual_seed(0)
    layer = decoder_layer_class(config)(config, 0).to(spec["device"], dtype)
    seq, doc = spec["seq"], spec["doc"]
    positions = torch.cat([torch.arange(min(doc, seq - s)) for s in range(0, seq, doc)])[None].to(spec["device"])
    hidden = torch.randn(1, seq, spec["hidden"], device=spec["device"], dtype=dtype, requires_grad=True)  # [1,S,H]

    def step():
        out, _ = layer((hidden, positions))
        out.float().square().mean().backward()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_mb()
    step()  # the measured peak: the first forward + backward
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else peak_rss_mb() - base
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak, "s": sum(times) / len(times)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--doc", type=count_arg(1), default=1024, help="tokens per packed document")
    p.add_argument("--window", type=count_arg(0), default=0, help="Mistral's sliding window (0: Llama, none)")
    p.add_argument("--hidden", type=count_arg(8), default=256)
    p.add_argument("--heads", type=count_arg(2), default=4)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=count_arg(1), default=2)
    p.add_argument("--case", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"one decoder layer, hidden {args.hidden}, {args.heads} heads, {args.dtype}, {device}, documents of {args.doc} "
        f"tokens{f', sliding window {args.window}' if args.window else ''}; memory: "
        + ("peak allocated above the inputs" if device == "cuda" else "peak RSS above the RSS before the forward")
    )
    print(
        "\n| seq | attention | dense mask (MiB) | peak memory (MiB) | s per forward + backward |\n|---|---|---|---|---|"
    )
    for seq in [int(s) for s in args.seqs.split(",")]:
        for attention in ("dense_mask", "documents"):
            spec = dict(vars(args), seq=seq, attention=attention, device=device)
            spec.pop("case")
            proc = subprocess.run(
                [sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT
            )
            if proc.returncode:
                print(f"| {seq} | {attention} | | failed: {proc.stderr.strip().splitlines()[-1]} | |", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            mask = seq * seq / 2**20 if attention == "dense_mask" else 0
            print(f"| {seq} | {attention} | {mask:.0f} | {r['peak_mib']:.0f} | {r['s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
