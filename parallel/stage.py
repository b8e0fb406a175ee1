"""A rank's pipeline stage built for a layout: the ranks' topology, the stage's class, and each axis's plan applied.

As torchtitan's ``parallelize_llama`` applies tensor parallelism, context parallelism, ... one ``apply_*`` after the
other, :func:`build_pipeline_model` builds the stage and applies the plans of the axes its ``Layout`` uses
(``parallel.axes.AXES``, in order: tensor, sequence, expert, schedule; parallel/axis.py lists the steps). The layout
is the only source of the axes' sizes; training/ asks :func:`axis_plans` for the steps that follow the build (the
DeepSpeed config, the engine, the announcement, the end-of-run check).
"""

from __future__ import annotations

from deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from transformers import PretrainedConfig

from models.attention import DOCUMENT_ATTENTION
from models.families import moe_spec
from models.family_deepseek_v3 import SequenceBalanceLoss
from models.files.pipeline_dir import local_modules
from models.llama_pipe import DECODER_LAYER_CLASSES, LlamaPipelineModule, NormPipe, build_specs, router_stats_experts
from models.loss import CausalLMLoss, LossSplit, PreferenceLoss, logit_softcap
from models.router_loss import RouterLoss
from parallel.axes import AXES
from parallel.axis import AxisPlan
from parallel.layout import Layout
from parallel.partition import DEFAULT_PARTITION_METHOD, stage_boundaries


def axis_plans(layout: Layout) -> list[AxisPlan]:
    """The plans of the axes ``layout`` uses, in the order they apply."""
    return [axis(layout) for axis in AXES if axis.used(layout)]


def pipeline_topology(layout: Layout) -> ProcessTopology:
    """The ranks' topology: pipe x data, or pipe x data x model with tensor parallelism (the model axis varies
    fastest: a tensor-parallel group is consecutive ranks, a node). Pipe is the outer axis; DeepSpeed's data axis
    holds the sequence groups and the data-parallel ranks (``Layout.data_axis``)."""
    if layout.tp > 1:
        return PipeModelDataParallelTopology(num_pp=layout.stages, num_mp=layout.tp, num_dp=layout.data_axis)
    return PipeDataParallelTopology(num_pp=layout.stages, num_dp=layout.data_axis)


def stage_class(plans: list[AxisPlan]) -> type:
    """The stage's class: the ``stage_class`` of the one plan that has its own (tensor parallelism's
    ``TensorParallelStage``, expert parallelism's ``ExpertParallelStage``, DualPipeV's ``LlamaDualPipeVModule``),
    else ``LlamaPipelineModule``. No two of those axes combine: their rules refuse it."""
    own = [plan.stage_class for plan in plans if plan.stage_class is not None]
    if len(own) > 1:
        raise ValueError(
            f"no stage class combines {' and '.join(cls.__name__ for cls in own)}: these axes' rules refuse them "
            "together (parallel/axis.py's layout_problems)"
        )
    return own[0] if own else LlamaPipelineModule


def build_pipeline_model(
    config: PretrainedConfig,
    topology: ProcessTopology,
    layout: Layout | None = None,
    loss: CausalLMLoss | PreferenceLoss | None = None,
    partition_method: str = DEFAULT_PARTITION_METHOD,
    activation_checkpoint_interval: int = 0,
    dynamic_shape: bool = False,
    attention: str = DOCUMENT_ATTENTION,
    sequence_balance_coef: float = 0.0,
) -> LlamaPipelineModule:
    """The Llama ``PipelineModule``; each rank builds only the layers of its own stage, with the plans of the axes
    ``layout`` uses applied (tensor parallelism: only this rank's pieces; sequence parallelism: Ulysses over groups
    of consecutive data-axis ranks; DualPipeV: twice as many pieces, two per rank), and ``loss`` told this rank's
    share of it (``LossSplit``).

    Must be called after ``deepspeed.init_distributed()``, with :func:`pipeline_topology`'s topology of ``layout``
    (None: pipe x data of ``topology``, no other axis). With ``activation_checkpoint_interval`` N > 0, activations
    are recomputed in chunks of N layers, but only chunks made of decoder layers: DeepSpeed's reentrant checkpoint
    around the embedding (integer inputs) would get no gradient at all. ``layout`` is also what
    ``partition_method=memory`` balances for; with its ``loss_chunk`` > 0 the last stage computes the loss chunk by
    chunk (the stage contract above build_specs), and ``loss`` (None: the next-token loss) must chunk the same; its
    ``loss_impl`` is what ``loss`` computes the head's cross entropy with (models.loss.head_losses).
    ``dynamic_shape``: micro-batches of varying length (data.pad_to_multiple_of), their shapes sent with each one.
    ``attention``: the decoder layers' attention function (models.llama_pipe.ATTENTION_IMPLEMENTATIONS).
    ``sequence_balance_coef`` > 0 (``moe.sequence_balance_coef``, deepseek_v3): the loss adds it x DeepSeek-V3's
    sequence-wise balance loss (models/family_deepseek_v3.py) in place of the router loss.
    """
    layout = layout or Layout(stages=topology.get_dim("pipe"), dp=topology.get_dim("data"))
    loss = loss or CausalLMLoss(layout.loss_chunk, softcap=logit_softcap(config))
    if loss.chunk_tokens != layout.loss_chunk:
        raise ValueError(f"loss_fn chunks {loss.chunk_tokens} tokens, the model {layout.loss_chunk}")
    softcap = getattr(loss, "softcap", None)  # Gemma's final_logit_softcapping: the loss caps the head's logits
    if softcap != logit_softcap(config):
        raise ValueError(
            f"loss_fn caps the logits at {softcap}, the model config's final_logit_softcapping at "
            f"{logit_softcap(config)}: build the loss with softcap=models.loss.logit_softcap(config)"
        )
    loss.compute_head_with(layout.loss_impl)  # loss_impl: the chunked loss or Liger's fused linear cross entropy
    axes = {axis: topology.get_dim(axis) for axis in topology.get_axis_names()}
    if (axes["pipe"], axes.get("model", 1), axes["data"]) != (layout.stages, layout.tp, layout.data_axis):
        raise ValueError(f"the topology's axes {axes} are not those of the layout {layout.axes()}")
    plans = axis_plans(layout)
    for plan in plans:  # collectives first: every rank creates the axes' process groups before the stage's own
        attention = plan.before_build(config, topology, attention)
    model = stage_class(plans)(
        config,
        layers=build_specs(config, layout.loss_chunk, attention, sequence_balance_coef > 0),
        topology=topology,
        loss_fn=loss,
        boundaries=stage_boundaries(config, layout.pieces, partition_method, layout),
        activation_checkpoint_interval=activation_checkpoint_interval,
        **checkpoint_function(config, sequence_balance_coef > 0),
        checkpointable_layers=[cls.__name__ for cls in DECODER_LAYER_CLASSES.values()],
        dynamic_shape=dynamic_shape,
    )
    split: dict = {}
    for plan in plans:
        split.update(plan.apply(model))
    loss.split_over(LossSplit(**split))
    attach_router_loss(model, config, loss, sequence_balance_coef)
    return model


def checkpoint_function(config: PretrainedConfig, sequence_balance: bool = False) -> dict:
    """A stage that sends two float tensors (the hidden states and, with the router loss, the router probabilities;
    with the sequence-wise balance loss, its terms) gets two backward calls from DeepSpeed's pipeline engine, one per
    tensor; DeepSpeed's reentrant checkpoint frees its saved inputs in the first ('NoneType' object is not iterable in
    the second): the non-reentrant one keeps them for as long as the graph lives."""
    if not router_stats_experts(config) and not sequence_balance:
        return {}
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    return {"activation_checkpoint_func": non_reentrant_checkpoint}


def attach_router_loss(model, config: PretrainedConfig, loss: CausalLMLoss, sequence_balance_coef: float = 0.0) -> None:
    """A MoE model with ``output_router_logits``: the loss adds the router loss, from the statistics this rank's final
    norm (the last stage's) hands it (the stage contract above models.llama_pipe.build_specs); with
    ``sequence_balance_coef`` > 0, that x DeepSeek-V3's sequence-wise balance loss instead."""
    moe = moe_spec(config)
    if moe is None or not (moe.router_loss or sequence_balance_coef > 0):
        return
    if sequence_balance_coef > 0:
        loss.router = SequenceBalanceLoss(moe.num_experts, moe.top_k, sequence_balance_coef)
    else:
        loss.router = RouterLoss(moe.num_experts, moe.top_k, moe.router_aux_loss_coef)
    for _, module in local_modules(model):
        if isinstance(module, NormPipe):
            module.router_sink = loss.router.receive
