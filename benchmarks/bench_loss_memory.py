"""Peak memory and time of the last stage's loss side, the LM head's logits and cross entropy, forward
and backward: unchunked (``loss_chunk_tokens=0``) against the chunked loss (models/loss.py).

    python benchmarks/bench_loss_memory.py [--tokens 2048] [--hidden 64] [--vocab 32000] [--chunks 0,1024,256]

One micro-batch of ``--tokens`` tokens, every one a label token, hidden states and head weight as leaves
(what the final norm and the head hand the loss). The peak is the largest total of live tensors allocated
during forward + backward (training.observation.memory_census.LiveTensorBytes: the CPU allocator itself reports
nothing); the inputs, created before, are not counted, their gradients are. The time is
the median of ``--repeats`` runs without the counter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.loss import CausalLMLoss  # noqa: E402
from training.observation.memory_census import LiveTensorBytes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def loss_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """(hidden [1,N,H], head weight [V,H], labels [1,N]): leaves of a fresh graph."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dtype).requires_grad_()
    return h, w, torch.randint(0, vocab, (1, tokens), generator=g)


def loss_step(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int) -> None:
    """Forward and backward of the loss side, as the last stage runs it for ``loss_chunk_tokens=chunk``."""
    outputs = F.linear(h, w) if chunk == 0 else (h, w)  # logits [1,N,V], or what the chunked loss takes
    CausalLMLoss(chunk)(outputs, labels).backward()


def peak_bytes(fn) -> int:
    """The largest total of live tensor bytes allocated while ``fn`` runs
    (training.observation.memory_census.LiveTensorBytes, as a GPU allocator would count them)."""
    with LiveTensorBytes() as counter:
        fn()
    return counter.peak


def loss_peak_bytes(tokens: int, hidden: int, vocab: int, chunk: int, dtype: torch.dtype = torch.float32) -> int:
    h, w, labels = loss_inputs(tokens, hidden, vocab, dtype)
    return peak_bytes(lambda: loss_step(h, w, labels, chunk))


def loss_seconds(tokens: int, hidden: int, vocab: int, chunk: int, dtype: torch.dtype, repeats: int) -> float:
    h, w, labels = loss_inputs(tokens, hidden, vocab, dtype)
    times = []
    for _ in range(repeats):
        h.grad = w.grad = None
        start = time.perf_counter()
        loss_step(h, w, labels, chunk)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunks", default="0,1024,256", help="loss_chunk_tokens values; 0 = unchunked")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dtype, chunks = DTYPES[args.dtype], [int(c) for c in args.chunks.split(",")]
    print(
        f"loss side of one micro-batch: {args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, "
        f"{args.dtype}, forward + backward, {torch.get_num_threads()} thread(s)"
    )
    print("| loss_chunk_tokens | peak MiB | vs unchunked | time s |\n|---|---|---|---|")
    base = None
    for chunk in chunks:
        peak = loss_peak_bytes(args.tokens, args.hidden, args.vocab, chunk, dtype)
        seconds = loss_seconds(args.tokens, args.hidden, args.vocab, chunk, dtype, args.repeats)
        base = peak if chunk == 0 else base
        ratio = f"{base / peak:.1f}x lower" if base and chunk else "-"
        print(f"| {chunk or 'off'} | {peak / 2**20:.1f} | {ratio} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
