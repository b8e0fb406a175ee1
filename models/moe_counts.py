"""Parameters of a Mixture-of-Experts model split into routed experts and the rest, from the stage specs' shapes.

A MoE layer's routed experts are the tensors of its fused experts module (``mlp.experts.gate_up_proj`` [E,2I,H] and
``mlp.experts.down_proj`` [E,H,I] in transformers 5; Llama 4's ``feed_forward.experts.*``): every state-dict key
with ``.experts.`` in it. Everything else is dense: attention, norms, embeddings, the LM head, the router
(``mlp.gate.weight`` [E,H]) and a shared expert (``shared_expert.*``), which every token runs through. A token is
routed to top_k of a layer's E experts, so it computes with the dense parameters and top_k / E of the expert
parameters: the active parameters (the model cards' count). Hugging Face's Llama 4 computes more: its experts module
runs every token through all E experts, scaled by the router scores (:func:`experts_per_token`), which the compute
weights and the planner count. Counted on the meta device (:func:`models.specs.expected_state_shapes`), so a new
family counts right as soon as its specs build; dense models have no experts and every count here is theirs unchanged.

Expert parallelism and the planner (parallel/memory_plan.py) read :func:`moe_shape`: per rank it holds 1/ep of
each MoE layer's experts and all of the rest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from transformers import PretrainedConfig

from models.families import moe_spec
from models.llama_pipe import (
    build_specs,
    is_routed_expert,
    spec_layout,
    spec_parameter_counts,
    spec_routed_expert_counts,
)
from models.specs import expected_state_shapes

# A shared expert's keys: Llama 4's ``feed_forward.shared_expert.gate_proj.weight``, DeepSeek-V3's ``shared_experts.``;
# and Gemma 4's dense ``mlp.`` that a MoE layer runs beside its experts on every token (a routed layer of the other
# families has no ``mlp.gate_proj``: its router is ``mlp.gate`` or ``mlp.router``)
SHARED_KEY = re.compile(r"\.shared_experts?\.|^\.mlp\.(gate|up|down)_proj\.")


def parameter_split(config: PretrainedConfig) -> tuple[int, int]:
    """(routed-expert parameters, all other parameters) of the whole model (a tied embedding counted once)."""
    counts, experts = spec_parameter_counts(config), spec_routed_expert_counts(config)
    owned = [info.index for info in spec_layout(config) if info.owns_file]
    routed = sum(experts[i] for i in owned)
    return routed, sum(counts[i] for i in owned) - routed


def active_parameters(config: PretrainedConfig) -> int:
    """Parameters of the experts a token is routed to: all but the routed experts, plus top_k / E of those (every MoE
    layer holds E experts of equal size, so the share is exact), as the model cards count them. A dense model's whole
    count. (What a token computes with is :func:`experts_per_token`'s: more for llama4_text.)"""
    routed, rest = parameter_split(config)
    moe = moe_spec(config)
    return rest if moe is None else rest + routed * moe.top_k // moe.num_experts


def experts_per_token(config: PretrainedConfig) -> int:
    """How many of a MoE layer's E experts each token runs through (``models.families.MoESpec``, what the compute
    weights count): top_k; all E for llama4_text, whose experts module runs every token through every expert; 0 for a
    dense model."""
    moe = moe_spec(config)
    return 0 if moe is None or not moe.moe_layers else moe.experts_per_token


@dataclass(frozen=True)
class MoEShape:
    """What the planner needs to know about a model's experts (parallel/memory_plan.py's ``Shape`` carries it)."""

    num_experts: int  # E per MoE layer
    top_k: int  # experts each token is routed to
    moe_layers: int  # decoder layers whose MLP is routed
    expert_width: int  # I: each expert's SwiGLU intermediate size
    expert_params: int  # routed-expert parameters of the whole model
    largest_expert_tensor: int  # elements of the largest fused expert tensor (all E experts of one MoE layer)
    experts_per_token: int = 0  # experts each token runs through (experts_per_token): top_k; E for llama4_text
    shared_width: int = 0  # a shared expert's SwiGLU intermediate size (every token runs it); 0: none


def moe_shape(config: PretrainedConfig) -> MoEShape | None:
    """The experts of ``config`` as the planner counts them, from the specs' shapes; None for a dense model. The
    expert width is what the shapes imply for a SwiGLU expert (3 H I parameters: gate, up and down), as is the shared
    expert's (its ``shared_expert.`` keys)."""
    moe = moe_spec(config)
    if moe is None or not moe.moe_layers:
        return None
    experts = spec_routed_expert_counts(config)
    layer_spec = 1 + moe.moe_layers[0]  # spec of the first MoE decoder layer (spec_layout: decoder i is spec 1 + i)
    shapes = expected_state_shapes(build_specs(config)[layer_spec])
    largest = max(math.prod(s) for k, s in shapes.items() if is_routed_expert(k))
    # the experts' weights, without biases (gpt-oss's, 2 I + H an expert)
    weights = sum(math.prod(s) for k, s in shapes.items() if is_routed_expert(k) and not k.endswith("_bias"))
    width = weights // (moe.num_experts * 3 * config.hidden_size)
    shared = sum(math.prod(s) for k, s in shapes.items() if SHARED_KEY.search(f".{k}")) // (3 * config.hidden_size)
    return MoEShape(
        moe.num_experts,
        moe.top_k,
        len(moe.moe_layers),
        width,
        sum(experts),
        largest,
        experts_per_token(config),
        shared,
    )
