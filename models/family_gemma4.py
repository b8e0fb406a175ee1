"""Gemma 4's text model (``model_type`` gemma4_text, ``Gemma4ForCausalLM``): what its stages carry beyond Gemma 3's,
and the values of its config they refuse.

Inside ``Gemma4TextDecoderLayer`` (run as it is): Gemma 3's pre/post norms, q/k norms and sliding and full layers
(``layer_types``, a RoPE per type; full layers with heads of ``global_head_dim``), plus a v norm, scores unscaled
and a ``layer_scalar`` buffer (kept in the layer files). Its RMSNorm scales by ``weight`` (not 1 + weight). Outside
it, two values every later layer reads, so they travel with the hidden states between stages:

- per-layer inputs [B,S,L,P] (``hidden_size_per_layer_input`` P): the embedding spec computes them once from the
  input ids and the scaled lookups (:meth:`Gemma4Embedding.per_layer_inputs`: the text model's
  ``get_per_layer_inputs`` and ``project_per_layer_inputs``); layer i reads ``[:, :, i]``;
- shared keys and values (``num_kv_shared_layers``): the last layers reuse the keys and values of the last earlier
  layer of their attention type (``kv_sharing_modes``: that layer ``store``s, they ``reuse``); each storing layer
  appends its (keys, values) [B,KV,S,D] to the tuple, in layer order, and a reusing layer reads its type's pair.

With ``enable_moe_block`` every layer also routes: beside its MLP, a router (:class:`Gemma4TextRouter`: softmax
top-k of a scaled RMS-normed input, renormalised, times ``per_expert_scale``) and fused experts of Qwen3-MoE's form
(``gate_up_proj`` [E,2I,H], ``down_proj`` [E,H,I]), inside the layer, so nothing more travels; ``Gemma4ForCausalLM``
adds no router loss (its router's probabilities are recorded as ``router_logits`` and not used), so neither do the
stages (models/families.py's ``moe_spec``).

The wire after spec 0 is ``(hidden, position_ids, per_layer_inputs, *keys_values)``, each extra only while a later
layer reads it (the per-layer inputs up to the last layer, a pair up to its last reader, and not at all where the
config has none), so every float a stage receives gets its gradient back, as DeepSpeed's pipeline asserts, and a
storing layer's k/v projections learn from the layers that reuse them; the final norm receives the hidden states and
positions alone.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextDecoderLayer, Gemma4TextRouter

from models.family_gemma3 import scaled_lookup

MODEL_TYPE = "gemma4_text"
# the Hugging Face prefix of the embedding spec: it holds model.embed_tokens and the per-layer inputs' modules
EMBED_PREFIX = "model."


def reuses_kv(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether a layer reuses an earlier one's keys and values (it then holds no k/v projections or norms)."""
    return config.model_type == MODEL_TYPE and config.kv_sharing_modes[layer_idx] == "reuse"


def kv_source(config: PretrainedConfig, layer_idx: int) -> int:
    """The storing layer whose keys and values a reusing layer reads: the last one of its attention type."""
    modes, kind = config.kv_sharing_modes, config.layer_types[layer_idx]
    return max(i for i, mode in enumerate(modes) if mode == "store" and config.layer_types[i] == kind)


def pairs_on_wire(config: PretrainedConfig, after_layer: int) -> list[int]:
    """The storing layers whose (keys, values) travel after layer ``after_layer`` (-1: the embedding), in layer
    order: from the storing layer to its last reader. A pair no later layer reads is not sent: DeepSpeed asserts a
    gradient comes back for every float a stage receives."""
    readers = {}  # storing layer -> its last reader
    for i, mode in enumerate(config.kv_sharing_modes):
        if mode == "reuse":
            readers[kv_source(config, i)] = i
    return [src for src, last in sorted(readers.items()) if src <= after_layer < last]


def carries_per_layer_inputs(config: PretrainedConfig, after_layer: int) -> bool:
    """Whether the per-layer inputs travel after layer ``after_layer``: while a later layer reads its slice."""
    return bool(config.hidden_size_per_layer_input) and after_layer < config.num_hidden_layers - 1


class Gemma4Embedding(nn.Module):
    """Spec 0's modules under ``model.``, named as ``Gemma4TextModel`` names them: ``embed_tokens`` and, with
    per-layer inputs, ``embed_tokens_per_layer``, ``per_layer_model_projection`` and ``per_layer_projection_norm``."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_scale = config.hidden_size**0.5
        layers, width = config.num_hidden_layers, config.hidden_size_per_layer_input
        self.per_layer_shape = (layers, width) if width else None
        if self.per_layer_shape:
            self.embed_tokens_per_layer = nn.Embedding(
                config.vocab_size_per_layer_input, layers * width, config.pad_token_id
            )
            self.per_layer_model_projection = nn.Linear(config.hidden_size, layers * width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(width, eps=config.rms_norm_eps)

    @property
    def weight(self) -> nn.Parameter:
        """The token embedding [V,H]: the tied LM head's and DeepSpeed's ``tied_weight_attr``."""
        return self.embed_tokens.weight

    def lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(hidden [B,S,H] times sqrt(H), and the per-layer inputs [B,S,L,P] where the config has them)."""
        hidden = scaled_lookup(self.embed_tokens(input_ids), self.embed_scale)
        if self.per_layer_shape is None:
            return (hidden,)
        return hidden, self.per_layer_inputs(input_ids, hidden)

    def per_layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``get_per_layer_inputs`` and ``project_per_layer_inputs``: a lookup of L x P per token times sqrt(P), and
        the scaled embeddings projected, times hidden ** -0.5 and RMS-normed per layer; summed, times 2 ** -0.5."""
        width = self.per_layer_shape[1]
        identity = scaled_lookup(self.embed_tokens_per_layer(input_ids), width**0.5)
        projected = self.per_layer_model_projection(hidden) * hidden.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(*hidden.shape[:-1], *self.per_layer_shape))
        return (projected + identity.reshape(*input_ids.shape, *self.per_layer_shape)) * 2.0**-0.5


class Gemma4LayerWire:
    """Mixin before ``DecoderLayerPipe``: takes the per-layer input and the shared keys and values off the wire
    (:func:`carries_per_layer_inputs`, :func:`pairs_on_wire`), hands them to the layer (through
    :class:`Gemma4LayerCall`) and puts on what later layers read."""

    def forward(self, inputs: tuple) -> tuple:
        config, i, attn = self.config, self.layer_idx, self.self_attn
        hidden, position_ids, *rest = inputs
        per_layer_inputs = rest.pop(0) if carries_per_layer_inputs(config, i - 1) else None  # [B,S,L,P]
        pairs = {src: (rest[2 * n], rest[2 * n + 1]) for n, src in enumerate(pairs_on_wire(config, i - 1))}
        shared = {attn.layer_type: pairs[kv_source(config, i)]} if attn.is_kv_shared_layer else {}
        self._extra = {
            "per_layer_input": None if per_layer_inputs is None else per_layer_inputs[:, :, i],
            "shared_kv_states": shared,  # a storing layer puts its pair in
        }
        try:
            hidden, position_ids = super().forward((hidden, position_ids))
        finally:
            self._extra = None
        if attn.store_full_length_kv:
            # [B,KV,S,D] each, transposed views of the projections: contiguous, as a stage's send needs them
            pairs[i] = tuple(t.contiguous() for t in shared[attn.layer_type])
        out = [hidden, position_ids]
        if carries_per_layer_inputs(config, i):
            out.append(per_layer_inputs)
        for src in pairs_on_wire(config, i):
            out += pairs[src]
        return tuple(out)


class Gemma4LayerCall:
    """Mixin between ``DecoderLayerPipe`` and ``Gemma4TextDecoderLayer``: the layer's call with what
    :class:`Gemma4LayerWire` took off the wire."""

    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        return super().forward(hidden, **kwargs, **self._extra)


def largest(config: PretrainedConfig, name: str):
    """``config.<name>``, or where the layers differ in it (Gemma 4's full layers: heads of ``global_head_dim``, and
    with ``attention_k_eq_v`` their own KV heads; reading it from the config then raises) the largest layer's value:
    what the planner and the FLOP count read as every layer's, an upper bound."""
    if getattr(config, "is_heterogeneous", False):
        return max(getattr(config.per_layer_config[i], name) for i in range(config.num_hidden_layers))
    return getattr(config, name, None)


def init_layer_scalar_(module: nn.Module) -> None:
    """Gemma 4's values of 1 from scratch, as Hugging Face's: a decoder layer's ``layer_scalar`` buffer and a
    router's ``scale`` and ``per_expert_scale`` (a meta-built layer holds no value; the router's ``proj`` is drawn as
    every linear layer)."""
    scalar = getattr(module, "layer_scalar", None)
    if isinstance(module, Gemma4TextDecoderLayer) and isinstance(scalar, torch.Tensor):
        scalar.fill_(1.0)
    if isinstance(module, Gemma4TextRouter):
        module.scale.fill_(1.0)
        module.per_expert_scale.fill_(1.0)


def gemma4_problems(config: PretrainedConfig, where: str, fix) -> list[str]:
    """What of a gemma4_text config the stages cannot compute as ``Gemma4ForCausalLM`` does, one line each."""
    problems = []
    if getattr(config, "enable_moe_block", False):
        problems += moe_block_problems(config, where, fix)
    try:
        config.kv_sharing_modes
    except ValueError as e:  # a reusing layer's attention type without an earlier layer of that type
        types = config.layer_types
        most = max(n for n in range(len(types)) if set(types[: len(types) - n]) == set(types))
        problems.append(
            f"{where}: num_kv_shared_layers {config.num_kv_shared_layers} with layer_types {types}: {e}: "
            + fix("num_kv_shared_layers", f"at most {most} (or put each attention type among the first layers)")
        )
    if getattr(config, "use_bidirectional_attention", None):
        problems.append(
            f"{where}: use_bidirectional_attention {config.use_bidirectional_attention!r} (tokens seeing later "
            "ones) is not a causal language model the stages train: " + fix("use_bidirectional_attention", "null")
        )
    return problems


def moe_block_problems(config: PretrainedConfig, where: str, fix) -> list[str]:
    """With ``enable_moe_block``: the experts per layer, the experts per token and their width, which Hugging Face's
    layer needs (None builds no layer) and takes unchecked (0 experts per token routes nothing)."""
    experts, k, width = config.num_experts, config.top_k_experts, config.moe_intermediate_size
    problems = []
    if not isinstance(experts, int) or experts < 1:
        problems.append(
            f"{where}: num_experts {experts!r} with enable_moe_block true: each layer's routed block needs 1 or more "
            "experts: " + fix("num_experts", ">= 1 (128 in Gemma 4 26B-A4B)")
        )
    elif not isinstance(k, int) or not 1 <= k <= experts:
        problems.append(
            f"{where}: top_k_experts {k!r} with enable_moe_block true is not in [1, {experts}] (num_experts "
            f"{experts}): " + fix("top_k_experts", f"in [1, {experts}] (8 in Gemma 4 26B-A4B)")
        )
    if not isinstance(width, int) or width < 1:
        problems.append(
            f"{where}: moe_intermediate_size {width!r} with enable_moe_block true: the experts need a width: "
            + fix("moe_intermediate_size", ">= 1 (704 in Gemma 4 26B-A4B)")
        )
    return problems


# training setting (its TrainConfig name) -> (whether a value is refused, why, and what to set)
TRAINING_RULES = {
    "tensor_parallel": (
        lambda v: v > 1,
        "the per-layer inputs' lookup and projection and the shared keys/values are not split, and full layers of "
        "global_head_dim heads are not checked split: set tensor_parallel=1",
    ),
    "sequence_parallel": (
        lambda v: v > 1,
        "Ulysses exchanges heads around a layer's own attention, not the keys and values another layer reuses: set "
        "sequence_parallel=1",
    ),
    "pipeline_schedule": (
        lambda v: v == "dualpipev",
        "DualPipeV's wire (parallel/dualpipev.py) is not checked with the per-layer inputs and shared keys/values: "
        "set pipeline_schedule=1f1b",
    ),
    "peft.method": (
        lambda v: v == "lora",
        "the reusing layers have no k_proj/v_proj and no adapter parity is tested on Gemma 4: set peft.method=none",
    ),
    "compile": (lambda v: bool(v), "its stages' longer tuples are not checked compiled: set compile=false"),
    "train_objective": (
        lambda v: v == "grpo",
        "generation on the stages (models/generation.py) keeps a key/value cache per layer and hands its layers no "
        "per-layer inputs or shared keys/values: use train_objective=sft or dpo",
    ),
    "activation_checkpoint_interval": (
        lambda v: v > 0,
        "the one-stage engine's checkpointed call (models/llama_pipe.py's LlamaStack) carries the hidden states and "
        "positions alone: set activation_checkpoint_interval=0",
    ),
}


def axis_problems(model_type: str | None, key: str, value) -> list[str]:
    """One parallel axis's setting (``tensor_parallel``, ``sequence_parallel``, ``pipeline_schedule``) refused for
    Gemma 4: what the axis plans (parallel/) ask, as they own their rules."""
    return training_problems(model_type, {key: value})


def training_problems(model_type: str | None, settings: dict) -> list[str]:
    """The training ``settings`` (TrainConfig name -> value, as many of :data:`TRAINING_RULES` as given) refused for
    Gemma 4, one line each with the reason and the value to set (training/configuration/validate.py asks)."""
    if model_type != MODEL_TYPE:
        return []
    problems = []
    for key, value in settings.items():
        refused, reason = TRAINING_RULES[key]
        if refused(value):
            problems.append(f"{key}={value} with Gemma 4 (gemma4_text): {reason}")
    return problems
