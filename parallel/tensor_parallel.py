"""Tensor parallelism inside each pipeline stage (``tensor_parallel=N``), on DeepSpeed's own TP layers.

Megatron's split, applied to the Hugging Face modules a stage is built from while their parameters are
still on the meta device (models.llama_pipe.LlamaPipelineModule): in every decoder layer q/k/v/gate/up
become DeepSpeed ``LinearLayer`` (column-parallel: each rank keeps its rows of the weight, i.e. its
attention heads and its share of the MLP) and o/down ``LinearAllreduce`` (row-parallel, one all-reduce
after each); Hugging Face's attention reshapes with -1, so it runs on the local heads unchanged. The
embedding and the LM head keep a slice of the vocabulary: ``EmbeddingPipe`` looks up the tokens in its
slice and all-reduces, and the loss takes a vocabulary-parallel cross entropy (models/loss.py) that never
gathers the logits. RMSNorms, Qwen3's per-head q/k norms and the
row-parallel biases stay whole on every rank.

Each split parameter carries ``tp_split = (dim, rank, world)``: the layer files stay whole tensors with
Hugging Face's names, and ``LlamaPipelineModule`` gathers (save) or slices (load) them by it: a rank reads
only its piece of each tensor from the mapped file (models.layer_files.fill_module_).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.layer_files import local_modules, tp_piece
from models.llama_pipe import EmbeddingPipe, LMHeadPipe
from models.loss import CausalLMLoss
from parallel.layout import tp_dividing

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output features (rows of weight)
ROW = ("o_proj", "down_proj")  # split by input features (columns of weight), all-reduced after
PER_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3: one weight shared by all heads, each rank sees its own heads


def model_problems(config, tp: int) -> list[str]:
    """What of the model cannot be split over ``tp`` ranks, with its numbers and the tp values that work.

    KV heads are split like the query heads (each rank keeps whole GQA groups), so tp must divide them
    too: replicating KV heads for tp > num_key_value_heads (Megatron's way for MQA) is not done here."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if not bad:
        return []
    works = tp_dividing(sizes.values(), range(1, 65))
    return [
        f"tensor_parallel {tp} does not divide the model's "
        + ", ".join(f"{k} {v}" for k, v in bad.items())
        + " (each rank keeps an equal share of each): tensor_parallel values that divide all of "
        + ", ".join(f"{k} {v}" for k, v in sizes.items())
        + f": {works}"
    ]


def tensor_parallel_problems(cfg, model_config, layout) -> list[str]:
    """Everything train.py refuses about ``tensor_parallel`` (cfg: training.config.TrainConfig)."""
    tp = layout.tp
    if tp <= 1:
        return []
    problems = model_problems(model_config, tp) if model_config is not None else []
    if not layout.uses_pipeline:
        problems.append(
            f"tensor_parallel {tp} runs on the pipeline engine; num_stages=1 with ds={cfg.ds_config} (ZeRO "
            f"{layout.zero}) uses DeepSpeed's data-parallel engine: use ds=zero0 or ds=zero1"
        )
    if cfg.peft.method != "none":
        problems.append(
            f"peft.method={cfg.peft.method} with tensor_parallel {tp} is not supported yet: PEFT's layers would wrap "
            "DeepSpeed's split linears; use tensor_parallel=1 (LoRA's frozen base rarely needs it)"
        )
    if cfg.loss_chunk_tokens < 1:
        problems.append(
            f"tensor_parallel {tp} computes the loss over the vocabulary slices with the chunked loss: set "
            "loss_chunk_tokens > 0 (e.g. 1024)"
        )
    return problems


def tensor_parallel_warnings(layout, local_world_size: int) -> list[str]:
    """tensor_parallel wider than a node (``local_world_size`` ranks per node, 0 unknown): its all-reduces,
    two per layer and micro-batch each way, would cross the network between nodes."""
    if not local_world_size or layout.tp <= local_world_size:
        return []
    return [
        f"tensor_parallel {layout.tp} spans nodes of {local_world_size} ranks (LOCAL_WORLD_SIZE): every layer's "
        f"all-reduces cross the network; keep tensor_parallel <= {local_world_size} and put the rest in stages"
    ]


def mark_split(p: torch.Tensor, dim: int, rank: int, world: int) -> None:
    p.tp_split = (dim, rank, world)


def _sum_over(group):
    """A gradient hook that sums a replicated weight's partial gradients over the TP group."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


class _Reduce:
    """The embedding's all-reduce (forward sum, backward identity): DeepSpeed's ``RowParallel``."""

    def __init__(self, group):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        from deepspeed.module_inject.layers import RowParallel

        return RowParallel.apply(self.group, t.contiguous(), False)


def _split_vocab_(module: nn.Module, group, rank: int, world: int) -> int:
    """Keep this rank's rows of an embedding or LM head weight [V, H]; returns its first vocabulary id."""
    mark_split(module.weight, 0, rank, world)
    module.weight.data = tp_piece(module.weight.data, module.weight).clone()  # [V/tp, H]
    module.weight.tensor_model_parallel = True
    return rank * module.weight.shape[0]


def split_stage_(model, group, loss_fn: CausalLMLoss) -> None:
    """Cut this rank's stage into its TP pieces in place: LlamaPipelineModule calls it while the stage's
    parameters are still on the meta device, so no whole layer is ever allocated (the pieces get memory
    and their values from the layer files afterwards)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode

    set_autotp_mode(training=True)  # otherwise DeepSpeed's TP layers freeze their weights
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for _, module in local_modules(model):
        if isinstance(module, EmbeddingPipe):
            start = _split_vocab_(module, group, rank, world)
            module.vocab_range, module.tp_reduce = (start, start + module.weight.shape[0]), _Reduce(group)
            loss_fn.tensor_parallel = (group, start)  # the tied LM head's slice
            continue
        if isinstance(module, LMHeadPipe):
            loss_fn.tensor_parallel = (group, _split_vocab_(module, group, rank, world))
            continue
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if name in COLUMN and isinstance(child, nn.Linear):
                    layer = LinearLayer(child, group)
                    for p in (layer.weight, layer.bias):
                        if p is not None:
                            mark_split(p, 0, rank, world)
                    setattr(parent, name, layer)
                elif name in ROW and isinstance(child, nn.Linear):
                    layer = LinearAllreduce(child, group)
                    mark_split(layer.weight, 1, rank, world)
                    setattr(parent, name, layer)


def finish_split_(model, group) -> None:
    """Once the split stage has its memory: sum Qwen3's per-head norm gradients over the TP group, and
    flag each parameter for DeepSpeed's gradient norm: a split one counts on every TP rank, a replicated
    one on TP rank 0 only, the tied LM head's copy of the embedding nowhere (the first stage counts it)."""
    rank = dist.get_rank(group)
    for _, module in local_modules(model):
        for name, child in module.named_modules():
            if name.rsplit(".", 1)[-1] in PER_HEAD_NORMS:
                child.weight.register_hook(_sum_over(group))
    for p in model.parameters():
        split = hasattr(p, "tp_split")
        if getattr(p, "ds_pipe_replicated", False):
            p.model_parallel = p.tensor_model_parallel = False
        else:
            p.model_parallel = split or rank == 0


@torch.no_grad()
def replica_differences(model, group) -> list[str]:
    """Replicated parameters (norms, row-parallel biases) that differ from the TP group's first rank: each
    rank applies the same update to its copy, so any difference is a bug (checked at the end of a run)."""
    first = dist.get_global_rank(group, 0)
    differ = []
    for name, p in model.named_parameters():
        if hasattr(p, "tp_split"):
            continue
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=first, group=group)
        if not torch.equal(theirs, p.detach()):
            differ.append(f"{name} (max difference {(theirs - p).abs().max().item():.3g})")
    return differ
