"""Tensor parallelism inside each pipeline stage (``tensor_parallel=N``), on DeepSpeed's own TP layers.

The contract (what each rank holds, what crosses the wire, what is replicated):

- Megatron's split, applied by :class:`TensorParallelPlan` to the Hugging Face modules a stage is built from
  while their parameters are still on the meta device (:class:`TensorParallelStage`): :data:`LAYER_PLAN` says how
  each submodule of a decoder layer is split. q/k/v/gate/up become DeepSpeed ``LinearLayer`` (column-parallel:
  each rank keeps its rows of the weight, i.e. its attention heads and its share of the MLP) and o/down
  ``LinearAllreduce`` (row-parallel, one all-reduce after each); Hugging Face's attention reshapes with -1, so
  it runs on the local heads unchanged.
- :data:`END_PLAN`: the embedding and the LM head keep a slice of the vocabulary. ``EmbeddingPipe`` looks up the
  tokens in its slice and all-reduces, and the loss takes a vocabulary-parallel cross entropy (models/loss.py)
  that never gathers the logits: the plan returns the group and the slice's first id for it (``LossSplit``).
- Replicated on every rank: RMSNorms, the row-parallel biases, and the per-head q/k norms (Qwen3, Gemma 3), whose
  gradients (each rank's from its own heads) are summed over the group. Between stages, the hidden states travel whole
  (``pipe_partitioned`` off).

Each split parameter carries ``tp_split = (dim, rank, world)``: the layer files stay whole tensors with
Hugging Face's names, and :class:`TensorParallelStage` gathers (save) or slices (load) them by it: a rank reads
only its piece of each tensor from the mapped file (models.files.pipeline_dir.fill_module_).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.family_gemma4 import axis_problems as gemma4_axis_problems
from models.family_qwen3_5 import parallel_problems as qwen3_5_parallel_problems
from models.files.pipeline_dir import local_modules, tp_piece
from models.llama_pipe import EmbeddingPipe, LlamaPipelineModule, LMHeadPipe, materialize_, tied_head_call
from parallel.axis import AxisPlan, ModelFacts, RuleSettings
from parallel.layout import Layout, tp_dividing
from parallel.split_layer_files import load_pieces, save_whole


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


def _split_vocab_(module: nn.Module, rank: int, world: int) -> int:
    """Keep this rank's rows of an embedding or LM head weight [V, H]; returns its first vocabulary id."""
    mark_split(module.weight, 0, rank, world)
    module.weight.data = tp_piece(module.weight.data, module.weight).clone()  # [V/tp, H]
    module.weight.tensor_model_parallel = True
    return rank * module.weight.shape[0]


# The styles: how one submodule is split. ``split`` runs on the meta device and returns the module that replaces it
# (None: it stays, changed in place or not at all); ``finish`` runs once the stage has its memory.
class Style:
    @staticmethod
    def split(module: nn.Module, group, rank: int, world: int) -> nn.Module | None:
        return None

    @staticmethod
    def finish(module: nn.Module, group) -> None:
        pass


class Colwise(Style):
    """Column-parallel (DeepSpeed's ``LinearLayer``): this rank's rows of the weight and the bias (output features)."""

    @staticmethod
    def split(module, group, rank, world):
        from deepspeed.module_inject.layers import LinearLayer

        if not isinstance(module, nn.Linear):
            return None
        layer = LinearLayer(module, group)
        for p in (layer.weight, layer.bias):
            if p is not None:
                mark_split(p, 0, rank, world)
        return layer


class Rowwise(Style):
    """Row-parallel (DeepSpeed's ``LinearAllreduce``): this rank's columns of the weight (input features), the
    outputs all-reduced; the bias whole."""

    @staticmethod
    def split(module, group, rank, world):
        from deepspeed.module_inject.layers import LinearAllreduce

        if not isinstance(module, nn.Linear):
            return None
        layer = LinearAllreduce(module, group)
        mark_split(layer.weight, 1, rank, world)
        return layer


class SummedGradient(Style):
    """Replicated, its gradient summed over the group: the per-head q/k norms (Qwen3, Gemma 3), one weight that every
    head shares, of which each rank sees only its own heads."""

    @staticmethod
    def finish(module, group):
        module.weight.register_hook(_sum_over(group))


class VocabEmbedding(Style):
    """The embedding's rows of this rank's vocabulary slice: a forward pre-hook looks up the tokens of the slice
    (ids shifted into it, the others at row 0), a forward hook zeroes the others' rows and sums the ranks'
    lookups. The tied LM head's call (``tied_head=True``) passes untouched."""

    @staticmethod
    def split(module, group, rank, world):
        start = _split_vocab_(module, rank, world)
        end, reduce = start + module.weight.shape[0], _Reduce(group)
        pad = module.padding_idx
        module.padding_idx = pad - start if pad is not None and start <= pad < end else None  # no gradient to it
        outside = []  # the forward in flight's [B,S] bool mask, from the pre-hook to the hook

        def local_ids(module, args, kwargs):
            if tied_head_call(args, kwargs):
                return None
            input_ids, position_ids = args[0]  # [B,S] int64, [B,S] int64
            outside.append((input_ids < start) | (input_ids >= end))  # [B,S] bool
            return (((input_ids - start).masked_fill(outside[-1], 0), position_ids), *args[1:]), kwargs

        def summed(module, args, kwargs, output):
            if tied_head_call(args, kwargs):
                return None
            hidden, position_ids = output  # [B,S,H] (rows of other slices looked up as row 0), [B,S]
            return reduce(hidden.masked_fill(outside.pop()[..., None], 0.0)), position_ids

        module.register_forward_pre_hook(local_ids, with_kwargs=True)
        module.register_forward_hook(summed, with_kwargs=True)


class VocabHead(Style):
    """The LM head's rows of this rank's vocabulary slice (the loss is vocabulary-parallel)."""

    @staticmethod
    def split(module, group, rank, world):
        _split_vocab_(module, rank, world)


# Inside each decoder layer, by submodule name (torchtitan's per-block plan): how it is split.
LAYER_PLAN: dict[str, type[Style]] = {
    "q_proj": Colwise,
    "k_proj": Colwise,
    "v_proj": Colwise,
    "gate_proj": Colwise,
    "up_proj": Colwise,
    "o_proj": Rowwise,
    "down_proj": Rowwise,
    "q_norm": SummedGradient,
    "k_norm": SummedGradient,
}
# The stage's ends, by class: the vocabulary is split over the ranks.
END_PLAN: dict[type, type[Style]] = {EmbeddingPipe: VocabEmbedding, LMHeadPipe: VocabHead}
COLUMN = tuple(name for name, style in LAYER_PLAN.items() if style is Colwise)  # split by output features
ROW = tuple(name for name, style in LAYER_PLAN.items() if style is Rowwise)  # by input features, all-reduced after
PER_HEAD_NORMS = tuple(name for name, style in LAYER_PLAN.items() if style is SummedGradient)


def _end_style(module: nn.Module) -> type[Style] | None:
    return next((style for cls, style in END_PLAN.items() if isinstance(module, cls)), None)


def split_stage_(model, group) -> None:
    """Cut this rank's stage into its TP pieces in place, by :data:`END_PLAN` and :data:`LAYER_PLAN`: while the
    stage's parameters are still on the meta device, so no whole layer is ever allocated (the pieces get memory
    and their values from the layer files afterwards)."""
    from deepspeed.module_inject.layers import set_autotp_mode

    set_autotp_mode(training=True)  # otherwise DeepSpeed's TP layers freeze their weights
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for _, module in local_modules(model):
        end = _end_style(module)
        if end is not None:
            end.split(module, group, rank, world)
            continue
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                replacement = LAYER_PLAN.get(name, Style).split(child, group, rank, world)
                if replacement is not None:
                    setattr(parent, name, replacement)


def finish_split_(model, group) -> None:
    """Once the split stage has its memory: each style's ``finish`` (the per-head norms' summed gradients), and
    each parameter flagged for DeepSpeed's gradient norm: a split one counts on every TP rank, a replicated
    one on TP rank 0 only, the tied LM head's copy of the embedding nowhere (the first stage counts it)."""
    rank = dist.get_rank(group)
    for _, module in local_modules(model):
        for name, child in module.named_modules():
            LAYER_PLAN.get(name.rsplit(".", 1)[-1], Style).finish(child, group)
    for p in model.parameters():
        split = hasattr(p, "tp_split")
        if getattr(p, "ds_pipe_replicated", False):
            p.model_parallel = p.tensor_model_parallel = False
        else:
            p.model_parallel = split or rank == 0


class TensorParallelStage(LlamaPipelineModule):
    """The stage's class with tensor parallelism (``TensorParallelPlan.stage_class``): what building, saving and
    loading do with the pieces.

    Building: the stage's layers are built with their parameters on the meta device (buffers, e.g. rotary
    frequencies, built as usual), :func:`split_stage_` cuts them into this rank's pieces, and only the pieces get
    memory, zeros until the caller loads or initialises them: no rank ever allocates a whole layer. Saving gathers
    each split tensor and writes it whole, from TP rank 0, so layer files keep Hugging Face's names and shapes;
    loading reads the whole tensors and keeps this rank's pieces. A stage without a split tensor saves and loads
    as DeepSpeed does."""

    def _build(self) -> None:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            super()._build()
        split_stage_(self, self._grid.get_slice_parallel_group())
        materialize_(self)

    def _is_split(self) -> bool:
        return any(hasattr(p, "tp_split") for p in self.parameters())

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        if not self._is_split():
            return super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        if self._grid.data_parallel_id == 0:
            save_whole(self, save_dir, checkpoint_engine, self._grid.get_slice_parallel_group(), "tp_split")
        return None

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        if not self._is_split():
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        load_pieces(self, load_dir)
        return None


def liger_loss_problems(loss_impl: str, tp: int) -> list[str]:
    """``loss_impl=liger`` (models/kernels.py) with the LM head split by vocabulary over ``tp`` ranks."""
    if loss_impl != "liger":
        return []
    return [
        f"loss_impl=liger with tensor_parallel {tp}: the LM head is split by vocabulary, and Liger's fused linear "
        "cross entropy needs each row's logits over the whole vocabulary on one rank (the chunked loss all-reduces "
        "them per chunk): set loss_impl=chunked (the chunked loss, the same numbers), or tensor_parallel=1"
    ]


class TensorParallelPlan(AxisPlan):
    """``tensor_parallel`` > 1 (parallel/axis.py's rules and steps): the stage built, saved and loaded in pieces
    (:class:`TensorParallelStage`; its layer files whole, each split parameter gathered by its ``tp_split``),
    its replicated parameters flagged for the gradient norm, the loss told its vocabulary slice, the stages'
    tensors sent whole, and the replicas compared at the end of the run."""

    stage_class = TensorParallelStage
    # the layer files, whole (parallel/split_layer_files.py's save_whole and load_pieces)
    checkpoint_pieces = (TensorParallelStage.save_state_dict, TensorParallelStage.load_state_dir)

    @staticmethod
    def used(layout: Layout) -> bool:
        return layout.tp > 1

    @staticmethod
    def layout_problems(
        layout: Layout, model: ModelFacts = ModelFacts(), settings: RuleSettings = RuleSettings()
    ) -> list[str]:
        """tensor_parallel's rules beyond the model's sizes (:func:`model_problems`): the pipeline engine, no LoRA,
        the chunked loss."""
        tp = layout.tp
        if tp <= 1:
            return []
        peft_method = settings.peft(layout)
        problems = layout.engine.needs_pipeline(f"tensor_parallel {tp}", settings.ds(layout))
        problems += qwen3_5_parallel_problems(model.model_type, tp, 1)
        problems += gemma4_axis_problems(model.model_type, "tensor_parallel", tp)
        if peft_method != "none":
            problems.append(
                f"peft.method={peft_method} with tensor_parallel {tp} is not supported yet: PEFT's layers would wrap "
                "DeepSpeed's split linears; use tensor_parallel=1 (LoRA's frozen base rarely needs it)"
            )
        if layout.loss_chunk < 1:
            problems.append(
                f"tensor_parallel {tp} computes the loss over the vocabulary slices with the chunked loss: set "
                "loss_chunk_tokens > 0 (e.g. 1024)"
            )
        return problems

    @classmethod
    def problems(cls, cfg, model_config, layout: Layout, ds_json: dict | None = None) -> list[str]:
        """The model's sizes (:func:`model_problems`), then the layout's rules, then Liger's loss on a head split by
        vocabulary."""
        if layout.tp <= 1:
            return []
        sizes = model_problems(model_config, layout.tp) if model_config is not None else []
        return (
            sizes + super().problems(cfg, model_config, layout, ds_json) + liger_loss_problems(cfg.loss_impl, layout.tp)
        )

    @staticmethod
    def fp8_problems(layout: Layout, recipe: str) -> list[str]:
        return (
            [
                f"fp8={recipe} with tensor_parallel {layout.tp}: DeepSpeed's tensor-parallel layers are not nn.Linear, "
                "torchao does not convert them, and FP8 over split weights is not checked: set tensor_parallel=1 "
                "(more stages or data parallelism instead), or fp8=null"
            ]
            if layout.tp > 1
            else []
        )

    @staticmethod
    def compile_problems(layout: Layout) -> list[str]:
        return (
            [
                f"compile=true with tensor_parallel {layout.tp}: DeepSpeed's tensor-parallel layers all-reduce inside "
                "their forward and backward, and compiled they are not checked against the unsplit model: set "
                "tensor_parallel=1 (more stages or data parallelism instead), or set compile=false"
            ]
            if layout.tp > 1
            else []
        )

    @staticmethod
    def warnings(layout: Layout, local_world_size: int) -> list[str]:
        """tensor_parallel wider than a node (``local_world_size`` ranks per node, 0 unknown): its all-reduces,
        two per layer and micro-batch each way, would cross the network between nodes."""
        if not local_world_size or layout.tp <= local_world_size:
            return []
        return [
            f"tensor_parallel {layout.tp} spans nodes of {local_world_size} ranks (LOCAL_WORLD_SIZE): every layer's "
            f"all-reduces cross the network; keep tensor_parallel <= {local_world_size} and put the rest in stages"
        ]

    def apply(self, model) -> dict:
        group = model._grid.get_slice_parallel_group()
        finish_split_(model, group)
        ends = [m for _, m in local_modules(model) if _end_style(m) is not None]
        if not ends:
            return {}
        return {"tensor_parallel": (group, dist.get_rank(group) * ends[0].weight.shape[0])}  # the head's slice

    def ds_config_(self, ds: dict) -> None:
        # DeepSpeed would cut each tensor sent between stages over the TP group (pipe_partitioned); the
        # stages send them whole, as the parity tests run them.
        ds["pipeline"] = {**ds.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}

    def end_check(self, model, gather) -> tuple[str, str]:
        """Every replicated parameter is the same on the TP peers."""
        differ = replica_differences(model, model._grid.get_slice_parallel_group())
        reports = gather("checking the tensor-parallel replicas", lambda: differ)
        bad = sorted({d for r in reports for d in r})
        if bad:
            return "replicated parameters differ between tensor-parallel peers: " + ", ".join(bad[:5]), ""
        return "", "tensor-parallel peers hold identical replicated parameters (norms, row-parallel biases)"


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
