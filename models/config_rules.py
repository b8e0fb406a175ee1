"""The values of a model's config (``config.json`` of model_name_or_path, or ``model.architecture``) that change the
loss, the routing or the attention, checked before start as the run's own keys are (training/model_source.py's
``resolve_model``, so the preflight too). Hugging Face's config classes check their types, not their values: a
``router_aux_loss_coef`` of -0.5 trains cross entropy minus half the router loss, a ``num_experts_per_tok`` of 0 routes
every token to no expert, a ``mlp_only_layers`` entry past the last layer is ignored, and none of it says a word."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

MOE_COUNT_KEYS = {  # model_type -> the key of its experts per MoE layer
    "qwen3_moe": "num_experts",
    "mixtral": "num_local_experts",
    "llama4_text": "num_local_experts",
}
ROUTER_LOSS_FAMILIES = ("qwen3_moe", "mixtral")  # whose ForCausalLM adds router_aux_loss_coef x the router loss


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)


def model_config_problems(config: PretrainedConfig, where: str, override: bool) -> list[str]:
    """Meaningless values of ``config`` (read from ``where``: a config.json path, or model.architecture), one line
    each naming the file and the key. ``override``: the key is set as ``model.architecture.<key>=`` (from scratch);
    otherwise in the file."""

    def fix(key: str, wanted: str) -> str:
        return f"set model.architecture.{key} {wanted}" if override else f"set {key} {wanted} there"

    problems: list[str] = []

    def need(key: str, ok: bool, wanted: str, why: str = "") -> None:
        if not ok:
            value = getattr(config, key, None)
            problems.append(f"{where}: {key} {value!r} {why or 'is out of range'}: {fix(key, wanted)}")

    layers = config.num_hidden_layers
    eps = getattr(config, "rms_norm_eps", None)
    need(
        "rms_norm_eps",
        _finite(eps) and eps > 0,
        "> 0 (1e-5 or 1e-6)",
        "is not a positive number (RMSNorm divides by the root of the mean square + it)",
    )
    dropout = getattr(config, "attention_dropout", 0.0)
    need("attention_dropout", _finite(dropout) and 0 <= dropout < 1, "in [0, 1) (0: no dropout, the usual)")
    window = getattr(config, "sliding_window", None)
    need(
        "sliding_window",
        window is None or (_number(window) and window >= 1),
        "to a window of 1 or more tokens, or null (full attention)",
        "lets a token attend to nothing",
    )
    problems += _rope_problems(config, where, fix)
    model_type = config.model_type
    if model_type == "llama4_text":
        chunk = config.attention_chunk_size
        need("attention_chunk_size", chunk is None or chunk >= 1, "to 1 or more tokens (8192 in Llama 4), or null")
        if config.attn_temperature_tuning:
            need(
                "floor_scale",
                config.floor_scale >= 1,
                ">= 1 (8192 in Llama 4)",
                "is out of range (the attention temperature divides the positions by it)",
            )
            need("attn_scale", _finite(config.attn_scale) and config.attn_scale >= 0, ">= 0 (0.1 in Llama 4)")
    if model_type not in MOE_COUNT_KEYS:
        return problems
    count_key = MOE_COUNT_KEYS[model_type]
    experts = getattr(config, count_key)
    # Qwen3-MoE with 0 experts is a dense model (every layer its MLP); the others route every MoE layer
    need(count_key, experts >= (0 if model_type == "qwen3_moe" else 1), ">= 1 (experts per MoE layer)")
    if experts >= 1:
        k = config.num_experts_per_tok
        need(
            "num_experts_per_tok",
            1 <= k <= experts,
            f"in [1, {experts}] ({count_key} {experts})",
            "routes each token to no expert" if k < 1 else f"is more than the {experts} experts",
        )
    if model_type == "qwen3_moe":
        need("decoder_sparse_step", config.decoder_sparse_step >= 1, ">= 1 (1: every layer routed)")
        need(
            "mlp_only_layers",
            all(isinstance(i, int) and 0 <= i < layers for i in config.mlp_only_layers),
            f"to layer indices in [0, {layers}) (num_hidden_layers {layers})",
            "names layers the model does not have (ignored: no layer of the model is made dense by it)",
        )
    if model_type == "llama4_text":
        step = config.interleave_moe_layer_step
        need("interleave_moe_layer_step", step >= 1, ">= 1 (1: every layer routed)")
        need(
            "moe_layers",
            all(isinstance(i, int) and 0 <= i < layers for i in config.moe_layers or ()),
            f"to layer indices in [0, {layers}) (num_hidden_layers {layers})",
            "names layers the model does not have (ignored: no layer of the model is routed by it)",
        )
    if model_type == "mixtral":
        jitter = config.router_jitter_noise
        need(
            "router_jitter_noise",
            _finite(jitter) and 0 <= jitter < 1,
            "in [0, 1) (0: no noise, Mixtral's)",
            "is not a noise scale (each router input is multiplied by a factor in [1 - it, 1 + it])",
        )
    if model_type in ROUTER_LOSS_FAMILIES:
        coef = config.router_aux_loss_coef
        need(
            "router_aux_loss_coef",
            _finite(coef) and coef >= 0,
            ">= 0 (0.001 in Qwen3-MoE, 0.02 in Mixtral)",
            f"would subtract {-coef:g} x the router's load-balancing loss from the cross entropy, rewarding experts "
            "out of balance"
            if _finite(coef)
            else "is not a finite number (the loss is cross entropy + it x the router's load-balancing loss)",
        )
    return problems


def _rope_problems(config: PretrainedConfig, where: str, fix) -> list[str]:
    """rope_theta > 0 and a scaling factor >= 1 (transformers' own rope checks only log a warning)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    problems = []
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and not (_finite(theta) and theta > 0):
        problems.append(f"{where}: rope_theta {theta!r} is out of range: {fix('rope_theta', '> 0 (10000 to 1e6)')}")
    factor = rope.get("factor")
    if factor is not None and not (_finite(factor) and factor >= 1):
        problems.append(
            f"{where}: rope scaling factor {factor!r} (rope_type {rope.get('rope_type')}) is out of range: "
            + fix("rope_scaling.factor", ">= 1 (the context's extension)")
        )
    return problems
