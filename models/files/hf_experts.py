"""How a Mixture-of-Experts layer's tensors are stored on disk by Hugging Face, against how the stages hold them.

transformers 5 holds each MoE layer's experts fused (``mlp.experts.gate_up_proj [E,2I,H]``, ``mlp.experts.down_proj
[E,H,I]``), and so do our layer files: a rank with expert parallelism reads only its own experts' rows of a
memory-mapped file. The released checkpoints, and ``save_pretrained``, store one tensor per expert and projection
(Qwen3-MoE: ``mlp.experts.E.{gate,up,down}_proj.weight``; Mixtral: ``block_sparse_moe.experts.E.w{1,3,2}.weight``,
its router ``block_sparse_moe.gate.weight``). :func:`disk_pieces` is the one table between the two: each stage
tensor as the disk tensors it is made of, and where each sits in it, used by the conversion both ways
(models/files/hf_convert.py). Written here rather than through transformers' ``WeightConverter`` operations: those
convert whole state dicts at load time, while the converter reads and writes one layer at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ExpertsOnDisk:
    """A family's per-expert names on disk."""

    block: str  # the MoE block's module name on disk (the stages' is "mlp")
    gate: str
    up: str
    down: str


EXPERTS_ON_DISK = {
    "qwen3_moe": ExpertsOnDisk("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ExpertsOnDisk("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v3": ExpertsOnDisk("mlp", "gate_proj", "up_proj", "down_proj"),  # its gate's bias stored as it is
    "qwen3_5_moe_text": ExpertsOnDisk("mlp", "gate_proj", "up_proj", "down_proj"),  # its shared expert as it is
}

# A stage tensor of a MoE block: layer prefix, then the block's part (gate.weight, experts.gate_up_proj, ...)
_MOE_KEY = re.compile(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")

Select = Callable[[torch.Tensor], torch.Tensor]  # the disk tensor's place in the stage tensor (a view)


def disk_pieces(config: PretrainedConfig, hf_key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple, Select]]:
    """The disk tensors stage tensor ``hf_key`` (of ``shape``) is made of: (disk key, disk shape, its view in the
    stage tensor). A tensor stored as it is gives itself."""
    disk = EXPERTS_ON_DISK.get(getattr(config, "model_type", None))
    match = _MOE_KEY.match(hf_key) if disk is not None else None
    if match is None:
        return [(hf_key, tuple(shape), lambda t: t)]
    layer, part = match.groups()
    block = f"{layer}{disk.block}."
    if part == "gate.weight":
        return [(f"{block}gate.weight", tuple(shape), lambda t: t)]
    experts = f"{block}experts."
    if part == "experts.down_proj":  # [E,H,I]
        return [(f"{experts}{e}.{disk.down}.weight", tuple(shape[1:]), lambda t, e=e: t[e]) for e in range(shape[0])]
    num_experts, two_i, hidden = shape  # gate_up_proj [E,2I,H]: each expert's gate rows, then its up rows
    half = two_i // 2
    pieces = []
    for e in range(num_experts):
        pieces.append((f"{experts}{e}.{disk.gate}.weight", (half, hidden), lambda t, e=e: t[e, :half]))
        pieces.append((f"{experts}{e}.{disk.up}.weight", (half, hidden), lambda t, e=e: t[e, half:]))
    return pieces


def assemble(pieces: list[tuple[str, tuple, Select]], shape: tuple, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The stage tensor of ``shape`` from its disk tensors (``get(disk key)``): the disk tensor itself when it is
    stored as it is, else a new tensor filled piece by piece."""
    if len(pieces) == 1 and pieces[0][1] == tuple(shape):
        return get(pieces[0][0])
    whole = None
    for key, _, select in pieces:
        t = get(key)
        if whole is None:
            whole = torch.empty(shape, dtype=t.dtype)
        select(whole).copy_(t)
        del t
    return whole
