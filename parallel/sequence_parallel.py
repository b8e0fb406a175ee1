"""Sequence parallelism (``sequence_parallel=N``): DeepSpeed's Ulysses inside every pipeline stage.

N ranks of the same stage (and tensor-parallel rank) form a sequence group; they read the same samples and
each keeps one contiguous slice of every row (the embedding keeps it: ``SliceRows``), so every activation of the
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

import torch
import torch.distributed as dist
from transformers import AttentionInterface

from models.attention import document_attention
from models.family_gemma4 import axis_problems as gemma4_axis_problems
from models.family_qwen3_5 import parallel_problems as qwen3_5_parallel_problems
from models.llama_pipe import EmbeddingPipe, tied_head_call
from parallel.axis import AxisPlan, ModelFacts, RuleSettings
from parallel.layout import Layout

ULYSSES_ATTENTION = "ulysses_documents"


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


def sequence_slice(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """[B,S,...] -> [B,S/ranks,...]: the ``rank``-th contiguous slice of every row."""
    seq = t.shape[1]
    if seq % ranks:
        raise ValueError(f"a micro-batch of {seq} tokens per row does not split over {ranks} sequence-parallel ranks")
    return t[:, rank * seq // ranks : (rank + 1) * seq // ranks].contiguous()  # sent to the next stage as is


class SliceRows:
    """The module takes whole rows (input_ids, position_ids) [B,S] and keeps this rank's slice of each: everything
    after it runs on S / ranks tokens, positions global. A forward pre-hook; the tied LM head's call of the
    embedding (``tied_head=True``: hidden states, not rows) passes untouched."""

    @staticmethod
    def apply(module, rank: int, ranks: int) -> None:
        def keep_slice(module, args, kwargs):
            if tied_head_call(args, kwargs):
                return None
            rows = tuple(sequence_slice(t, rank, ranks) for t in args[0])  # ([B,S/ranks] int64, [B,S/ranks] int64)
            return (rows,), kwargs

        # first of the pre-hooks: tensor parallelism's vocabulary hooks (registered at build) then see the slice
        module.register_forward_pre_hook(keep_slice, with_kwargs=True, prepend=True)


# The stage modules that change, by class: the embedding takes whole rows (the loss takes its slice of the labels
# from the plan's LossSplit; every decoder layer's attention is Ulysses, ``before_build``).
SEQUENCE_PLAN = {EmbeddingPipe: SliceRows}


class SequenceParallelPlan(AxisPlan):
    """``sequence_parallel`` > 1 (parallel/axis.py's rules and steps): before the stage, this rank's sequence group
    and the Ulysses attention over it (registered with transformers for this process, the name the decoder layers
    call); on the built stage, :data:`SEQUENCE_PLAN`; for the loss, this rank's slice of each row. No checkpoint
    pieces: every rank of a sequence group holds the whole stage."""

    @staticmethod
    def used(layout: Layout) -> bool:
        return layout.sp > 1

    @staticmethod
    def layout_problems(
        layout: Layout, model: ModelFacts = ModelFacts(), settings: RuleSettings = RuleSettings()
    ) -> list[str]:
        """sequence_parallel's rules, with the numbers and the values that work: whole attention heads per rank and
        KV heads split or replicated (the model's ``heads``, ``kv_heads``; None: not checked), equal slices of the
        sequence and of the pad multiple, the token-normalised loss, the per-document attention, no LoRA, the
        pipeline engine."""
        sp, tp = layout.sp, layout.tp
        if sp <= 1:
            return []
        peft_method = settings.peft(layout)
        problems = []
        if model.heads is not None:
            heads, kv_heads = model.heads, model.kv_heads
            local, kv = heads // tp, kv_heads // tp
            if local % sp:
                works = [n for n in range(2, local + 1) if local % n == 0]
                problems.append(
                    f"sequence_parallel {sp} does not divide the {local} attention heads of each tensor-parallel rank "
                    f"(num_attention_heads {heads} / tensor_parallel {tp}): Ulysses gives each "
                    f"rank whole heads; sequence_parallel values that divide them: {works}"
                )
            elif kv % sp and sp % kv:
                problems.append(
                    f"sequence_parallel {sp} and the {kv} key/value heads of each tensor-parallel rank "
                    f"(num_key_value_heads {kv_heads} / tensor_parallel {tp}): one must divide "
                    "the other (Ulysses splits the KV heads, or replicates them when there are fewer than ranks)"
                )
        seq, multiple = layout.seq_len, settings.pad_to_multiple_of
        if seq % sp:
            problems.append(
                f"data.max_seq_length {seq} is not divisible by sequence_parallel {sp}: each rank keeps an equal "
                f"slice; set data.max_seq_length to a multiple of {sp} (e.g. {seq - seq % sp})"
            )
        if multiple and multiple % sp:
            problems.append(
                f"data.pad_to_multiple_of {multiple} is not a multiple of sequence_parallel {sp}: micro-batches are "
                f"cut to a multiple of it and must split evenly; set data.pad_to_multiple_of to a multiple of {sp}"
            )
        if settings.loss_normalization != "tokens":
            problems.append(
                f"loss_normalization={settings.loss_normalization} with sequence_parallel {sp}: a micro-batch's mean "
                "needs its label count on every slice; use loss_normalization=tokens (the default)"
            )
        if settings.attention != "documents":
            problems.append(
                f"attention={settings.attention} with sequence_parallel {sp}: Ulysses runs the per-document attention "
                "on the whole sequence after its all-to-all; use attention=documents (the default)"
            )
        if peft_method != "none":
            problems.append(
                f"peft.method={peft_method} with sequence_parallel {sp} is not supported yet (no parity test of the "
                "two together): use sequence_parallel=1"
            )
        problems += qwen3_5_parallel_problems(model.model_type, 1, sp)
        problems += gemma4_axis_problems(model.model_type, "sequence_parallel", sp)
        return problems + layout.engine.needs_pipeline(f"sequence_parallel {sp}", settings.ds(layout))

    @staticmethod
    def defaults(cfg, is_set) -> list[tuple[str, object, str]]:
        """The defaults ``sequence_parallel=N`` alone cannot run with: the pad multiple and the row length, made
        multiples of N."""
        sp, adapted = cfg.sequence_parallel, []
        if sp <= 1:
            return []
        multiple, seq = cfg.data.pad_to_multiple_of, cfg.data.max_seq_length
        if multiple and multiple % sp and not is_set("data.pad_to_multiple_of"):
            adapted.append(("data.pad_to_multiple_of", math.lcm(multiple, sp), f"a multiple of sequence_parallel {sp}"))
        if seq % sp and seq > sp and not is_set("data.max_seq_length"):
            adapted.append(("data.max_seq_length", seq - seq % sp, f"a multiple of sequence_parallel {sp}"))
        return adapted

    @staticmethod
    def fp8_problems(layout: Layout, recipe: str) -> list[str]:
        return (
            [
                f"fp8={recipe} with sequence_parallel {layout.sp}: the float8 scales would span each rank's slice of "
                "the sequence, not the whole micro-batch, which is not checked against the unsplit run: set "
                "sequence_parallel=1, or fp8=null"
            ]
            if layout.sp > 1
            else []
        )

    @staticmethod
    def compile_problems(layout: Layout) -> list[str]:
        return (
            [
                f"compile=true with sequence_parallel {layout.sp}: Ulysses' all-to-all around each attention is not "
                "checked compiled: set sequence_parallel=1 (shorter data.max_seq_length or more stages), or set "
                "compile=false"
            ]
            if layout.sp > 1
            else []
        )

    @staticmethod
    def objective_problems(layout: Layout, train_objective: str) -> list[str]:
        """train_objective=dpo: a sequence's log-probability is one sum; grpo: generation keeps whole sequences."""
        if layout.sp <= 1:
            return []
        if train_objective == "dpo":
            return [
                f"sequence_parallel {layout.sp} with train_objective=dpo: DPO sums each sequence's log-probabilities, "
                "which sequence parallelism splits over ranks; set sequence_parallel=1"
            ]
        if train_objective == "grpo":
            return [
                f"sequence_parallel {layout.sp} with train_objective=grpo: generation runs each stage on whole "
                "sequences, one token at a time, not on slices split over ranks; set sequence_parallel=1"
            ]
        return []

    def before_build(self, config, topology, attention: str) -> str:
        # the groups before the stage's own (every rank creates groups in the same order)
        self.group, self.rank = sequence_group(topology, self.layout.sp)
        return ulysses_attention(config, self.layout.tp, self.group)

    def apply(self, model) -> dict:
        for module in model.modules():
            for cls, style in SEQUENCE_PLAN.items():
                if isinstance(module, cls):
                    style.apply(module, self.rank, self.layout.sp)
        return {"seq_slice": (self.rank, self.layout.sp)}
