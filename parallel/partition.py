"""How the specs are split into pipeline stages, and the pipeline module built with that split.

The split is computed here, above ``models/`` (whose ``LlamaPipelineModule`` is given it), so the
``memory`` method can use the planner without ``models/`` importing it.
"""

from __future__ import annotations

import itertools
import re

from deepspeed.runtime.pipe.topology import ProcessTopology
from transformers import PretrainedConfig

from models.attention import DOCUMENT_ATTENTION
from models.llama_pipe import DECODER_LAYER_CLASSES, LlamaPipelineModule, build_specs, spec_layout, spec_weights
from models.loss import CausalLMLoss
from models.peft_targets import SAVABLE_MODULES
from parallel.dualpipev import LlamaDualPipeVModule
from parallel.memory_plan import improve_boundaries, memory_boundaries
from parallel.sequence_parallel import sequence_group, split_sequence_, ulysses_attention
from parallel.tensor_parallel import finish_split_, split_stage_

# How train.py splits specs into stages by default (see stage_boundaries).
DEFAULT_PARTITION_METHOD = "compute"


def stage_boundaries(
    config: PretrainedConfig, num_stages: int, method: str = DEFAULT_PARTITION_METHOD, layout=None
) -> list[int]:
    """First spec of every stage, plus the end: the split ``LlamaPipelineModule`` is built with
    (:func:`build_pipeline_model`), also computed without building it (the memory planner).
    ``uniform``, ``parameters`` and ``type:`` are DeepSpeed's own methods on the same weights;
    ``compute`` is ``parameters`` over :func:`spec_weights` (both balanced per rank for DualPipeV's pieces,
    :func:`mirrored_pieces`); ``memory`` balances the planner's
    predicted per-GPU peak for ``layout`` (a ``parallel.layout.Layout``: precision, ZeRO, micro-batch,
    sequence, grad_acc, recomputation, loss chunk), see ``parallel.memory_plan.memory_boundaries``."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    method = method.lower()
    if method == "uniform":
        parts = partition_uniform(num_items=len(spec_layout(config)), num_parts=num_stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)  # DeepSpeed's _find_layer_type
        weights = [int(bool(pattern.search(spec.typename.__name__))) for spec in build_specs(config)]
        parts = partition_balanced(weights=weights, num_parts=num_stages)
    elif method == "memory":
        if layout is None or layout.pieces != num_stages:
            raise ValueError("partition_method 'memory' needs the run's layout with the same number of pieces")
        parts = memory_boundaries(config, layout)
    elif layout is not None and layout.schedule == "dualpipev" and num_stages == layout.pieces:
        parts = mirrored_pieces(spec_weights(config, method), layout.stages)
    else:
        parts = partition_balanced(weights=spec_weights(config, method), num_parts=num_stages)
    return [int(p) for p in parts]  # DeepSpeed returns numpy integers


def mirrored_pieces(weights: list[int], stages: int) -> list[int]:
    """DualPipeV's split of specs weighing ``weights`` into 2 x ``stages`` pieces, rank r holding piece r and
    piece 2 x stages - 1 - r: balanced per rank, each rank's two pieces summed (what it computes per step; even
    pieces put the embedding's and the LM head's pieces together on rank 0, the heaviest rank), ties broken
    by the most even pieces. A local search from DeepSpeed's per-piece split moves one boundary at a time while
    the ranks' loads, then the pieces', sorted largest first, get smaller."""
    from deepspeed.runtime.utils import partition_balanced

    pieces = 2 * stages
    total = list(itertools.accumulate(weights, initial=0))
    parts = [int(p) for p in partition_balanced(weights=weights, num_parts=pieces)]

    def key(bounds: list[int]) -> tuple:
        piece = [total[bounds[i + 1]] - total[bounds[i]] for i in range(pieces)]
        ranks = [piece[r] + piece[pieces - 1 - r] for r in range(stages)]
        return sorted(ranks, reverse=True), sorted(piece, reverse=True)

    return improve_boundaries(parts, key)


def build_pipeline_model(
    config: PretrainedConfig,
    topology: ProcessTopology,
    partition_method: str = DEFAULT_PARTITION_METHOD,
    activation_checkpoint_interval: int = 0,
    loss_fn: CausalLMLoss | None = None,
    layout=None,
    loss_chunk_tokens: int = 0,
    dynamic_shape: bool = False,
    attention: str = DOCUMENT_ATTENTION,
    sequence_parallel: int = 1,
    schedule: str = "1f1b",
) -> LlamaPipelineModule:
    """The Llama ``PipelineModule``; each rank builds only the layers of its own stage.

    Must be called after ``deepspeed.init_distributed()``, with a topology whose axes are pipe and
    data (``PipeDataParallelTopology``), or pipe, data and model (``PipeModelDataParallelTopology``):
    with a model axis over 1 each rank builds only its tensor-parallel pieces (parallel/tensor_parallel.py).
    With ``activation_checkpoint_interval`` N > 0, activations are recomputed in chunks of N layers, but
    only chunks made of decoder layers: DeepSpeed's reentrant checkpoint around the embedding (integer
    inputs) would get no gradient at all.
    ``layout`` (a ``parallel.layout.Layout``) is what ``partition_method=memory`` balances for.
    With ``loss_chunk_tokens`` > 0 the last stage computes the loss chunk by chunk (the stage contract
    above build_specs); a given ``loss_fn`` must chunk the same. ``dynamic_shape``: micro-batches of
    varying length (data.pad_to_multiple_of), their shapes sent with each one. ``attention``: the decoder
    layers' attention function (models.llama_pipe.ATTENTION_IMPLEMENTATIONS). With ``sequence_parallel`` N > 1
    the data axis's consecutive ranks form groups of N that split each row (parallel/sequence_parallel.py).
    With ``schedule="dualpipev"`` the specs are cut into twice as many pieces, two per rank (parallel/dualpipev.py).
    """
    loss_fn = loss_fn or CausalLMLoss(loss_chunk_tokens)
    if loss_fn.chunk_tokens != loss_chunk_tokens:
        raise ValueError(f"loss_fn chunks {loss_fn.chunk_tokens} tokens, the model {loss_chunk_tokens}")
    tp = topology.get_dim("model") if "model" in topology.get_axis_names() else 1
    split = tp > 1
    if sequence_parallel > 1:  # the groups before the model's own (every rank creates groups in the same order)
        group, group_rank = sequence_group(topology, sequence_parallel)
        attention = ulysses_attention(config, tp, group)
    pieces = topology.get_dim("pipe") * (2 if schedule == "dualpipev" else 1)
    module_class = LlamaDualPipeVModule if schedule == "dualpipev" else LlamaPipelineModule
    model = module_class(
        config,
        layers=build_specs(config, loss_chunk_tokens, attention),
        topology=topology,
        loss_fn=loss_fn,
        boundaries=stage_boundaries(config, pieces, partition_method, layout),
        activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=[cls.__name__ for cls in DECODER_LAYER_CLASSES.values()],
        dynamic_shape=dynamic_shape,
        shard_stage=(lambda m: split_stage_(m, m._grid.get_slice_parallel_group(), loss_fn)) if split else None,
    )
    if split:
        finish_split_(model, model._grid.get_slice_parallel_group())
    if sequence_parallel > 1:
        split_sequence_(model, group_rank, sequence_parallel, loss_fn)
    return model


def frozen_stage_problems(cfg, model_config, layout) -> list[str]:
    """A pipeline stage with nothing to train (only the frozen embedding, norm or LM head) has no optimizer
    group, which DeepSpeed's optimizers refuse: named here, with the knobs that move its boundaries."""
    kinds = [info.kind for info in spec_layout(model_config)]
    trained = {"decoder"} | {SAVABLE_MODULES[m] for m in cfg.peft.modules_to_save}
    bounds = stage_boundaries(model_config, layout.pieces, cfg.partition_method, layout)
    held = {s: [kinds[bounds[p] : bounds[p + 1]] for p in layout.rank_pieces(s)] for s in range(layout.stages)}
    empty = [s for s, pieces in held.items() if not trained & {kind for piece in pieces for kind in piece}]
    if not empty:
        return []
    return [
        f"with peft.method=lora, stage(s) {empty} of partition_method={cfg.partition_method} (specs "
        + ", ".join(f"{bounds[p]}..{bounds[p + 1] - 1}" for s in empty for p in layout.rank_pieces(s))
        + ") hold no decoder layer, hence nothing to train: "
        + "".join(f"use partition_method={m}, " for m in ("compute", "uniform") if m != cfg.partition_method)
        + "fewer num_stages, or train that module fully (peft.modules_to_save)"
    ]
