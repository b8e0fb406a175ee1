"""The Llama family: which Hugging Face modules build the stages of each ``config.json`` ``model_type``.

Every family here is a Llama decoder with one or two differences, all inside Hugging Face's own
modules, so the stage contract, spec layout, layer files, converter, planner and training loop are one
code path (``models.llama_pipe``) and parity with ``<Family>ForCausalLM`` holds by construction:

- llama:   the reference.
- mistral: sliding-window attention on every layer when ``sliding_window`` is set.
- qwen2:   biases on q/k/v; ``use_sliding_window`` + ``max_window_layers`` give per-layer
           ``layer_types`` (sliding on the layers from ``max_window_layers`` on); small sizes tie
           their embeddings.
- qwen3:   RMSNorm of queries and keys per head (``q_norm``/``k_norm``); sliding window as qwen2.
- qwen3_moe: Qwen3 whose MLP is a Mixture of Experts (softmax router, top-k renormalised with
           ``norm_topk_prob``) on the layers ``mlp_only_layers`` / ``decoder_sparse_step`` pick.
- mixtral: Mistral with a Mixture of Experts on every layer (softmax router, top-k renormalised).
- llama4_text: Llama 4's text model (``Llama4ForCausalLM``): a Mixture of Experts (sigmoid router scores applied
           to the input of the experts, top-k, plus a shared expert beside them) on the layers ``moe_layers`` /
           ``interleave_moe_layer_step`` pick, dense MLPs (``intermediate_size_mlp``) on the others; chunked
           attention (``attention_chunk_size``) on the RoPE layers, full attention with temperature tuning and no
           RoPE on the ``no_rope_layers``; L2 norm of queries and keys (``use_qk_norm``); complex RoPE
           frequencies. ``Llama4ForCausalLM`` adds no router loss, whatever ``output_router_logits`` says, so
           neither do the stages (:func:`moe_spec`).
- gemma3_text: Gemma 3's text model (``Gemma3ForCausalLM``): RMSNorms of 1 + weight before and after attention
           and the MLP, per-head q/k norms, scores scaled by ``query_pre_attn_scalar``, sliding and full layers
           (``layer_types``, 5:1) with a RoPE base each, embeddings times sqrt(hidden_size), tied; the differences
           outside the decoder layer are the ``Family`` flags below (models/family_gemma3.py).
- gemma4_text: Gemma 4's text model (``Gemma4ForCausalLM``): Gemma 3's layer with a v norm, unscaled scores, full
           layers of ``global_head_dim`` heads and a ``layer_scalar``; RMSNorms of weight (not 1 + weight); per-layer
           inputs computed by the embedding spec and shared keys/values of ``num_kv_shared_layers``, both carried on
           the wire between stages (models/family_gemma4.py); with ``enable_moe_block`` a routed expert block beside
           the MLP on every layer (top-k softmax renormalised, times ``per_expert_scale``); no router loss in
           ``Gemma4ForCausalLM``.
- deepseek_v3: DeepSeek-V3 (also Kimi K2, Moonlight): multi-head latent attention (low-rank q and kv projections,
           queries and keys of a RoPE part and a no-RoPE part, values of another head size), dense MLPs on the first
           ``first_k_dense_replace`` layers, then a Mixture of Experts with a shared expert and sigmoid routing within
           groups (``n_group``, ``topk_group``) biased by the buffer ``e_score_correction_bias`` (kept in the layer
           files, never trained); ``DeepseekV3ForCausalLM`` adds no router loss. The bias update rule and the
           sequence-wise balance loss: models/family_deepseek_v3.py.
- qwen3_5_text / qwen3_5_moe_text: Qwen3.5's text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Gated
           DeltaNet linear-attention layers (a short convolution and a recurrent state, restarted per document of a
           packed row) and gated full-attention layers with partial RoPE, 3:1 by ``layer_types``; RMSNorms of
           1 + weight; the MoE variant routes every layer (softmax top-k, renormalised) beside a gated shared
           expert. Its stage hooks: models/family_qwen3_5.py.
- gpt_oss: gpt-oss: attention with a learned sink per head (models/family_gpt_oss.py; ``attention=dense_mask`` runs
           Hugging Face's eager attention, which has the sinks, where the others run ``sdpa``, which drops them),
           sliding and full layers alternating (``layer_types``), q/k/v/o biases, and a Mixture of Experts on every
           layer: a router with a bias (top-k of its logits, softmax over the k), fused experts with biases, their
           gate and up columns interleaved, and a clamped SwiGLU. Its MXFP4 release is read dequantized to bf16.

The MoE families' routers and experts are Hugging Face's own modules too (:func:`moe_spec`); the stages carry
their routing statistics for the router loss (models/router_loss.py) and parallel/expert_parallel.py splits
their experts over ranks.

Adding a family is one ``Family`` entry, its two stage classes (a decoder layer and a norm, written out in
models/llama_pipe.py) and its tests (tests/test_families.py), as long as its decoder
layer takes ``(hidden, attention_mask, position_ids, position_embeddings)`` like Llama's and its model
has the ``model.embed_tokens`` / ``model.layers.N`` / ``model.norm`` / ``lm_head`` layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.llama4 import modeling_llama4
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from models.config_rules import config_field_problems, model_config_problems
from models.family_gpt_oss import is_mxfp4, mxfp4_refusal

DEFAULT_MODEL_TYPE = "llama"  # a conf/model architecture without model_type


@dataclass(frozen=True)
class Family:
    """The Hugging Face classes one ``model_type`` is built from."""

    model_type: str
    config_class: type
    causal_lm: type  # <Family>ForCausalLM: the parity reference and what an export loads as
    decoder_layer: type
    rms_norm: type
    rotary_embedding: type
    # whether its decoder layer passes position_ids on to its attention (Llama 4's keeps them: the stage hands them)
    layer_passes_positions: bool = True
    # what attention=dense_mask runs with transformers' masks: sdpa, or eager where sdpa drops a part (gpt-oss's sinks)
    dense_attention: str = "sdpa"
    # Gemma's differences outside its decoder layer (models/family_gemma3.py): lookups times sqrt(hidden_size) in the
    # weight's dtype; a rotary embedding that takes the layer's attention type (a RoPE base per type); an RMSNorm
    # that scales by 1 + weight, so initialised to 0
    scaled_embedding: bool = False
    rope_per_layer_type: bool = False
    norm_adds_one: bool = False

    @property
    def name(self) -> str:
        """Class-name prefix, e.g. ``Qwen2`` (it names the stage classes built from this family)."""
        return self.causal_lm.__name__.removesuffix("ForCausalLM")


def _family(
    model_type: str, module, prefix: str, causal_lm: str | None = None, layer_passes_positions: bool = True
) -> Family:
    """The entry of a family whose modeling module names its classes ``<prefix>ForCausalLM``,
    ``<prefix>DecoderLayer`` etc.; ``causal_lm``: the model's class name where it has another prefix (Llama 4's
    text model: ``Llama4ForCausalLM`` over ``Llama4TextDecoderLayer``)."""
    causal_lm = getattr(module, causal_lm or f"{prefix}ForCausalLM")
    return Family(
        model_type=model_type,
        config_class=causal_lm.config_class,
        causal_lm=causal_lm,
        decoder_layer=getattr(module, f"{prefix}DecoderLayer"),
        rms_norm=getattr(module, f"{prefix}RMSNorm"),
        rotary_embedding=getattr(module, f"{prefix}RotaryEmbedding"),
        layer_passes_positions=layer_passes_positions,
    )


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _family("llama", modeling_llama, "Llama"),
        _family("mistral", modeling_mistral, "Mistral"),
        _family("qwen2", modeling_qwen2, "Qwen2"),
        _family("qwen3", modeling_qwen3, "Qwen3"),
        _family("qwen3_moe", modeling_qwen3_moe, "Qwen3Moe"),
        _family("mixtral", modeling_mixtral, "Mixtral"),
        _family("llama4_text", modeling_llama4, "Llama4Text", "Llama4ForCausalLM", layer_passes_positions=False),
        replace(
            _family("gemma3_text", modeling_gemma3, "Gemma3"),
            scaled_embedding=True,
            rope_per_layer_type=True,
            norm_adds_one=True,
        ),
        _family("deepseek_v3", modeling_deepseek_v3, "DeepseekV3"),
        Family(  # Gemma 4's text model: its per-layer inputs and shared keys/values travel (models/family_gemma4.py)
            "gemma4_text",
            modeling_gemma4.Gemma4TextConfig,
            modeling_gemma4.Gemma4ForCausalLM,
            modeling_gemma4.Gemma4TextDecoderLayer,
            modeling_gemma4.Gemma4RMSNorm,
            modeling_gemma4.Gemma4TextRotaryEmbedding,
            scaled_embedding=True,
            rope_per_layer_type=True,
        ),
        Family(  # Qwen3.5's rotary embedding is its text model's: Qwen3_5TextRotaryEmbedding
            "qwen3_5_text",
            modeling_qwen3_5.Qwen3_5TextConfig,
            modeling_qwen3_5.Qwen3_5ForCausalLM,
            modeling_qwen3_5.Qwen3_5DecoderLayer,
            modeling_qwen3_5.Qwen3_5RMSNorm,
            modeling_qwen3_5.Qwen3_5TextRotaryEmbedding,
            norm_adds_one=True,
        ),
        Family(
            "qwen3_5_moe_text",
            modeling_qwen3_5_moe.Qwen3_5MoeTextConfig,
            modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM,
            modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer,
            modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm,
            modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding,
            norm_adds_one=True,
        ),
        replace(_family("gpt_oss", modeling_gpt_oss, "GptOss"), dense_attention="eager"),
    )
}
# Every family's RMSNorm class (the from-scratch initialisation sets their weights to 1).
RMS_NORM_CLASSES = tuple(dict.fromkeys(f.rms_norm for f in FAMILIES.values()))
# Those that scale by 1 + weight (Gemma): initialised to 0, as Hugging Face initialises them.
NORM_PLUS_ONE_CLASSES = tuple(dict.fromkeys(f.rms_norm for f in FAMILIES.values() if f.norm_adds_one))
# The MoE modules whose own parameters Hugging Face draws from N(0, initializer_range): routers and fused experts.
MOE_NORMAL_CLASSES = (
    modeling_qwen3_moe.Qwen3MoeTopKRouter,
    modeling_qwen3_moe.Qwen3MoeExperts,
    modeling_mixtral.MixtralTopKRouter,
    modeling_mixtral.MixtralExperts,
    modeling_llama4.Llama4TextExperts,  # its router is an nn.Linear: drawn as one
    modeling_deepseek_v3.DeepseekV3TopkRouter,  # its weight; its e_score_correction_bias buffer stays 0
    modeling_deepseek_v3.DeepseekV3Experts,
    modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter,  # its shared expert's gate is an nn.Linear: drawn as one
    modeling_qwen3_5_moe.Qwen3_5MoeExperts,
    modeling_gemma4.Gemma4TextExperts,  # its router's scales start at 1 (models/family_gemma4.py), its proj drawn
)


class UnsupportedModelError(ValueError):
    """A ``model_type`` outside the family table; the message lists the supported ones."""


class ModelConfigError(UnsupportedModelError):
    """Values of a config.json or model.architecture that its family's config class cannot take, one line each
    (``problems``; models/config_rules.py's ``config_field_problems``). An UnsupportedModelError, so every place
    that reports a config it cannot use reports these too."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def unsupported_message(model_type: object, where: str) -> str:
    return (
        f"{where}: model_type {model_type!r} is not supported; supported model types: "
        f"{', '.join(FAMILIES)} (the family table in models/families.py)"
    )


def family_of(config: PretrainedConfig) -> Family:
    """The family of a loaded config; UnsupportedModelError for any other model_type."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None or not isinstance(config, family.config_class):
        raise UnsupportedModelError(unsupported_message(getattr(config, "model_type", None), type(config).__name__))
    return family


def load_config(model_dir: str) -> PretrainedConfig:
    """``model_dir/config.json`` as its family's config class. The model_type is read from the JSON
    first: loading another family's config.json through LlamaConfig would succeed with a warning
    and build the wrong model."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        try:
            raw = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e}): copy the model's config.json again") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object: copy the model's config.json again")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(unsupported_message(model_type, path))
    if is_mxfp4(raw) and model_type == "gpt_oss":  # its experts read dequantized (models/family_gpt_oss.py)
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    quantized = raw.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        if method == "mxfp4":
            raise UnsupportedModelError(mxfp4_refusal(path, model_type))
        raise UnsupportedModelError(
            f"{path}: a quantized checkpoint (quantization_config: {method}), whose weights are not the model's "
            "own tensors: convert the unquantized model (its bf16/fp16/fp32 release); for a 4-bit base, train with "
            "peft.method=lora peft.quantize=nf4, which quantises on load"
        )
    return build_config(model_type, raw, path, override=False)


def check_rope(config: PretrainedConfig, where: str) -> None:
    """A rope type transformers cannot build would fail deep inside the first stage's build."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for one in per_layer_type(rope) or [rope]:
        kind = one.get("rope_type", one.get("type", "default")) if isinstance(one, dict) else "default"
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModelError(
                f"{where}: rope_type {kind!r} is not one transformers {transformers_version()} knows "
                f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}): fix rope_scaling / rope_parameters there"
            )


def per_layer_type(rope: object) -> list[dict]:
    """The RoPE settings of each attention type where ``rope_parameters`` holds one mapping per type (Gemma 3's
    ``sliding_attention`` and ``full_attention``), else []."""
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return []


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def config_from_dict(fields: dict, where: str = "model.architecture") -> PretrainedConfig:
    """A conf/model ``architecture`` mapping as its family's config (``model_type`` defaults to llama)."""
    fields = dict(fields)
    model_type = fields.pop("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(unsupported_message(model_type, where))
    return build_config(model_type, fields, where, override=True)


def build_config(model_type: str, fields: dict, where: str, override: bool) -> PretrainedConfig:
    """``fields`` (of a config.json at ``where``, or model.architecture: ``override``) as ``model_type``'s config
    class, as ``from_pretrained`` builds it; ModelConfigError with one line per value the class would refuse with a
    traceback (config_rules.config_field_problems), or for what it still refuses."""
    config_class = FAMILIES[model_type].config_class
    fields, problems, bad = config_field_problems(config_class, fields, where, override)
    if problems:
        # the value rules too, on the keys that were not refused (all of a config's problems in one go)
        try:
            rest = config_class.from_dict({k: v for k, v in fields.items() if k not in bad})
        except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError) as e:
            rest = None
            problems += [] if (line := rope_keys_problem(e, fields, where, override)) is None else [line]
        if rest is not None:
            problems += [
                line
                for line in model_config_problems(rest, where, override)
                if line.removeprefix(f"{where}: ").split(" ", 1)[0] not in bad
            ]
        raise ModelConfigError(problems)
    try:
        config = config_class.from_dict(fields)
    except KeyError as e:
        line = rope_keys_problem(e, fields, where, override)
        if line is None:
            raise
        raise ModelConfigError([line]) from e
    except (StrictDataclassError, TypeError, ValueError) as e:
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ is not None else e
        raise ModelConfigError(
            [f"{where}: not a {model_type} config transformers {transformers_version()} takes: {cause}"]
        ) from e
    check_rope(config, where)
    return config


def rope_keys_problem(error: Exception, fields: dict, where: str, override: bool) -> str | None:
    """The line for transformers' rope validation KeyError (a rope type without the keys it needs: llama3 without
    low_freq_factor), naming the file, the rope type and the keys missing; None for any other error."""
    import ast
    import re

    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else ""
    if "rope_parameters" not in text or "Missing required keys" not in text:
        return None
    key = "rope_scaling" if isinstance(fields.get("rope_scaling"), dict) else "rope_parameters"
    rope = fields.get(key) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    found = re.search(r"(\{.*\})\s*$", text)
    try:
        missing = ", ".join(sorted(ast.literal_eval(found.group(1)))) if found else text
    except (ValueError, SyntaxError):
        missing = found.group(1)
    there = f"model.architecture.{key}" if override else f"{key} there"
    return (
        f"{where}: {key} (rope_type {kind!r}) lacks {missing}, which transformers {transformers_version()} needs "
        f"for that rope type: add them to {there}, or set rope_type default (no scaling)"
    )


def attention_type(config: PretrainedConfig, layer_idx: int) -> str:
    """``full_attention``, ``sliding_attention`` or ``chunked_attention`` for one decoder layer, as the family's
    model picks its mask: per-layer ``layer_types`` (qwen2, qwen3; llama4_text's chunked RoPE layers), else a
    sliding window on every layer whenever ``sliding_window`` is set (mistral), else full (llama)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer_idx]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


@dataclass(frozen=True)
class MoESpec:
    """What a Mixture-of-Experts family's config says about its MoE layers."""

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]  # decoder layer indices whose MLP is routed
    router_loss: bool  # output_router_logits: cross entropy + router_aux_loss_coef x load-balancing loss
    router_aux_loss_coef: float
    # experts each token runs through: top_k; all E for Llama 4, whose Hugging Face experts module runs every token
    # through every expert, scaled by the router scores (what the compute weights and the planner count)
    experts_per_token: int
    router: str = "mlp.gate"  # the router module in a decoder layer; its output[0] is the router logits [T,E]
    # the fused experts module: gate_up_proj [E,2I,H], down_proj [E,H,I]; Llama 4's the transposes, [E,H,2I], [E,I,H]
    experts: str = "mlp.experts"


def moe_spec(config: PretrainedConfig) -> MoESpec | None:
    """The MoE layout of a config, or None for a dense family. The routed layers follow the family's decoder
    layer (Qwen3MoeDecoderLayer's rule; tests/test_moe.py checks it against the layers Hugging Face builds)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3_moe":
        experts = config.num_experts
        moe_layers = tuple(
            i
            for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and experts > 0 and (i + 1) % config.decoder_sparse_step == 0
        )
    elif model_type == "mixtral":
        experts, moe_layers = config.num_local_experts, tuple(range(config.num_hidden_layers))
    elif model_type == "llama4_text":  # Llama4TextDecoderLayer's is_moe_layer; its router returns (scores, logits)
        return MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            moe_layers=tuple(i for i in range(config.num_hidden_layers) if i in config.moe_layers),
            router_loss=False,  # Llama4ForCausalLM adds none, even with output_router_logits
            router_aux_loss_coef=0.0,
            experts_per_token=config.num_local_experts,
            router="feed_forward.router",
            experts="feed_forward.experts",
        )
    elif model_type == "qwen3_5_moe_text":  # Qwen3_5MoeDecoderLayer: every layer routed
        experts, moe_layers = config.num_experts, tuple(range(config.num_hidden_layers))
    elif model_type == "deepseek_v3":  # DeepseekV3DecoderLayer: routed from first_k_dense_replace on
        return MoESpec(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            moe_layers=tuple(range(config.first_k_dense_replace, config.num_hidden_layers)),
            router_loss=False,  # DeepseekV3ForCausalLM adds none, even with output_router_logits
            router_aux_loss_coef=0.0,
            experts_per_token=config.num_experts_per_tok,
        )
    elif model_type == "gemma4_text":  # Gemma4TextDecoderLayer: with enable_moe_block, every layer beside its MLP
        if not config.enable_moe_block:
            return None
        return MoESpec(
            num_experts=config.num_experts,
            top_k=config.top_k_experts,
            moe_layers=tuple(range(config.num_hidden_layers)),
            router_loss=False,  # Gemma4ForCausalLM adds none (its router's probabilities are recorded, not used)
            router_aux_loss_coef=0.0,
            experts_per_token=config.top_k_experts,
            router="router",  # returns (probabilities, top-k weights, top-k indices)
            experts="experts",
        )
    elif model_type == "gpt_oss":  # GptOssDecoderLayer: every layer routed; its router is mlp.router
        return MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            moe_layers=tuple(range(config.num_hidden_layers)),
            router_loss=bool(getattr(config, "output_router_logits", False)),
            router_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0)),
            experts_per_token=config.num_experts_per_tok,
            router="mlp.router",
        )
    else:
        return None
    return MoESpec(
        num_experts=experts,
        top_k=config.num_experts_per_tok,
        moe_layers=moe_layers,
        router_loss=bool(getattr(config, "output_router_logits", False)),
        router_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0)),
        experts_per_token=config.num_experts_per_tok,
    )
