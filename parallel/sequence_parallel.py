"""Sequence parallelism (``sequence_parallel=N``): DeepSpeed's Ulysses inside every pipeline stage.

N ranks of the same stage (and tensor-parallel rank) form a sequence group; they read the same samples and
each keeps one contiguous slice of every row (``EmbeddingPipe.seq_slice``), so every activation of the
stage holds S/N tokens. Around each attention DeepSpeed's ``UlyssesSPAttentionHF`` exchanges them by
all-to-all: each rank gets the whole sequence for heads/N of the heads (all-gathering the positions too),
runs the per-document attention of models/attention.py on it, and exchanges the result back. Positions stay
global; the loss shifts the labels over the whole row before taking its slice (models/loss.py), so the last
token of one slice predicts the first of the next, and each label token is counted once per group.

The groups are consecutive coordinates of DeepSpeed's data axis (``data = group * N + rank``): DeepSpeed
averages gradients over the whole axis, and with the loss normalised per global label token
(loss_normalization=tokens, train.py scales each rank's summed slice loss by the axis size) that average is
the gradient of the global token mean.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from transformers import AttentionInterface

from models.attention import document_attention
from models.llama_pipe import EmbeddingPipe

ULYSSES_ATTENTION = "ulysses_documents"


def sequence_parallel_defaults(cfg, is_set) -> list[tuple[str, object, str]]:
    """The defaults ``sequence_parallel=N`` alone cannot run with: (key, the value it runs with, why) for each such
    key ``is_set`` says the user left (cfg: training.config.TrainConfig)."""
    sp, adapted = cfg.sequence_parallel, []
    if sp <= 1:
        return []
    multiple, seq = cfg.data.pad_to_multiple_of, cfg.data.max_seq_length
    if multiple and multiple % sp and not is_set("data.pad_to_multiple_of"):
        adapted.append(("data.pad_to_multiple_of", math.lcm(multiple, sp), f"a multiple of sequence_parallel {sp}"))
    if seq % sp and seq > sp and not is_set("data.max_seq_length"):
        adapted.append(("data.max_seq_length", seq - seq % sp, f"a multiple of sequence_parallel {sp}"))
    return adapted


def sequence_parallel_problems(cfg, model_config, layout) -> list[str]:
    """Everything train.py refuses about ``sequence_parallel`` (cfg: training.config.TrainConfig), with the
    numbers and the values that work."""
    sp, tp = layout.sp, layout.tp
    if sp <= 1:
        return []
    problems = []
    if model_config is not None:
        heads, kv = model_config.num_attention_heads // tp, model_config.num_key_value_heads // tp
        if heads % sp:
            works = [n for n in range(2, heads + 1) if heads % n == 0]
            problems.append(
                f"sequence_parallel {sp} does not divide the {heads} attention heads of each tensor-parallel rank "
                f"(num_attention_heads {model_config.num_attention_heads} / tensor_parallel {tp}): Ulysses gives each "
                f"rank whole heads; sequence_parallel values that divide them: {works}"
            )
        elif kv % sp and sp % kv:
            problems.append(
                f"sequence_parallel {sp} and the {kv} key/value heads of each tensor-parallel rank "
                f"(num_key_value_heads {model_config.num_key_value_heads} / tensor_parallel {tp}): one must divide "
                "the other (Ulysses splits the KV heads, or replicates them when there are fewer than ranks)"
            )
    seq, multiple = cfg.data.max_seq_length, cfg.data.pad_to_multiple_of
    if seq % sp:
        problems.append(
            f"data.max_seq_length {seq} is not divisible by sequence_parallel {sp}: each rank keeps an equal slice; "
            f"set data.max_seq_length to a multiple of {sp} (e.g. {seq - seq % sp})"
        )
    if multiple and multiple % sp:
        problems.append(
            f"data.pad_to_multiple_of {multiple} is not a multiple of sequence_parallel {sp}: micro-batches are cut "
            f"to a multiple of it and must split evenly; set data.pad_to_multiple_of to a multiple of {sp}"
        )
    if cfg.loss_normalization != "tokens":
        problems.append(
            f"loss_normalization={cfg.loss_normalization} with sequence_parallel {sp}: a micro-batch's mean needs "
            "its label count on every slice; use loss_normalization=tokens (the default)"
        )
    if cfg.attention != "documents":
        problems.append(
            f"attention={cfg.attention} with sequence_parallel {sp}: Ulysses runs the per-document attention on the "
            "whole sequence after its all-to-all; use attention=documents (the default)"
        )
    if cfg.peft.method != "none":
        problems.append(
            f"peft.method={cfg.peft.method} with sequence_parallel {sp} is not supported yet (no parity test of the "
            "two together): use sequence_parallel=1"
        )
    if not layout.uses_pipeline:
        problems.append(
            f"sequence_parallel {sp} runs on the pipeline engine; num_stages=1 with ds={cfg.ds_config} (ZeRO "
            f"{layout.zero}) uses DeepSpeed's data-parallel engine: use ds=zero0 or ds=zero1"
        )
    return problems


def sequence_group(topology, sp: int):
    """This rank's sequence group: (process group, rank in it). Collective: every rank creates every group,
    in the same order (torch's rule for ``new_group``)."""
    axes = topology.get_axis_names()
    mine = None
    others = [a for a in axes if a != "data"]
    for fixed in sorted(
        {tuple(getattr(c, a) for a in others) for c in map(topology.get_coord, range(topology.world_size()))}
    ):
        coords = dict(zip(others, fixed))
        for first in range(0, topology.get_dim("data"), sp):
            ranks = [topology.get_rank(**coords, data=first + i) for i in range(sp)]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = (group, ranks.index(dist.get_rank()))
    return mine


def ulysses_attention(model_config, tp: int, group):
    """Register, for this process, the attention function that runs the per-document attention under
    DeepSpeed's Ulysses over ``group``; returns its name for ``build_specs(attention=...)``.

    DeepSpeed's module fixes the micro-batch size at construction: one per size seen (eval's may differ)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    by_batch: dict[int, UlyssesSPAttentionHF] = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        batch = query.shape[0]  # query [B,Hq,S/N,D]
        if batch not in by_batch:
            by_batch[batch] = UlyssesSPAttentionHF(
                attn=document_attention,
                batch_size=batch,
                attn_head_count=model_config.num_attention_heads // tp,
                attn_head_size=head_dim,
                kv_head_count=model_config.num_key_value_heads // tp,
                num_hidden_layers=model_config.num_hidden_layers,
                process_group=group,
                seq_length_is_variable=True,
            )
        return by_batch[batch](module, query, key, value, attention_mask, *args, **kwargs)  # [B,S/N,Hq*D]

    AttentionInterface.register(ULYSSES_ATTENTION, attention)
    return ULYSSES_ATTENTION


def split_sequence_(model, group_rank: int, sp: int, loss_fn) -> None:
    """Give this stage's embedding (the first stage) and the loss (the last) this rank's slice."""
    for module in model.modules():
        if isinstance(module, EmbeddingPipe):
            module.seq_slice = (group_rank, sp)
    loss_fn.seq_slice = (group_rank, sp)
