"""The values of a model's config (``config.json`` of model_name_or_path, or ``model.architecture``) that change the
loss, the routing or the attention, checked before start as the run's own keys are
(training/configuration/model_source.py's ``resolve_model``, so the preflight too). Hugging Face's config classes check
their types, not their values: a ``router_aux_loss_coef`` of -0.5 trains cross entropy minus half the router loss, a
``num_experts_per_tok`` of 0 routes every token to no expert, a ``mlp_only_layers`` entry past the last layer is
ignored, and none of it says a word."""

from __future__ import annotations

import math
import types
import typing
from enum import Enum

from transformers import PretrainedConfig

from models.family_deepseek_v3 import deepseek_v3_problems
from models.family_gemma3 import gemma3_problems
from models.family_gemma4 import gemma4_problems
from models.family_qwen3_5 import MODEL_TYPES as QWEN3_5_MODEL_TYPES
from models.family_qwen3_5 import qwen3_5_problems

MOE_COUNT_KEYS = {  # model_type -> the key of its experts per MoE layer
    "qwen3_moe": "num_experts",
    "mixtral": "num_local_experts",
    "llama4_text": "num_local_experts",
    "qwen3_5_moe_text": "num_experts",
    "gpt_oss": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
}
ROUTER_LOSS_FAMILIES = (  # whose ForCausalLM adds router_aux_loss_coef x the router loss
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen3_5_moe_text",
)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)


def fixer(override: bool):
    """``fix(key, wanted)``: the advice to set ``key`` ``wanted``; ``override``: the key is set as
    ``model.architecture.<key>=`` (from scratch); otherwise in the file."""

    def fix(key: str, wanted: str) -> str:
        return f"set model.architecture.{key} {wanted}" if override else f"set {key} {wanted} there"

    return fix


# Keys whose validator's range (LlamaConfig's) gets the house's words, as model_config_problems says it for the
# families whose config class checks no range: (the range wanted, what a finite value out of it is)
HOUSE_RANGES = {
    "initializer_range": (
        "in [0, 1] (0.02 in most families)",
        "is not a standard deviation (a model from scratch draws its weights from N(0, it))",
    ),
}


def model_config_problems(config: PretrainedConfig, where: str, override: bool) -> list[str]:
    """Meaningless values of ``config`` (read from ``where``: a config.json path, or model.architecture), one line
    each naming the file and the key. ``override``: the key is set as ``model.architecture.<key>=`` (from scratch);
    otherwise in the file."""
    fix = fixer(override)
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
    std = getattr(config, "initializer_range", 0.02)
    need(
        "initializer_range",
        _finite(std) and 0 <= std <= 1,
        HOUSE_RANGES["initializer_range"][0],
        HOUSE_RANGES["initializer_range"][1] if _finite(std) else "is not a finite number",
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
    if model_type == "gemma3_text":
        problems += gemma3_problems(config, where, fix)
    if model_type == "gemma4_text":
        problems += gemma4_problems(config, where, fix)
    if model_type == "deepseek_v3":
        problems += deepseek_v3_problems(config, where, fix)
    if model_type in QWEN3_5_MODEL_TYPES:
        problems += qwen3_5_problems(config, where, fix)
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


# Sizes of the model's tensors and counts of its heads and layers: whole numbers of 1 or more where set (None keeps
# the family's own: num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads).
SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "intermediate_size_mlp",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# Top-level keys that transformers 5 takes from rope_parameters instead when that sets them too
ROPE_DUPLICATES = ("rope_theta", "partial_rotary_factor")


def config_field_problems(
    config_class: type, fields: dict, where: str, override: bool
) -> tuple[dict, list[str], set[str]]:
    """(``fields`` as ``config_class`` takes them, problems, the keys refused): the values a family's config class
    would refuse with a traceback (transformers' strict config dataclasses check each field's type, and some
    families' heads), or take and then build nothing (a layer count of 0, a negative width), or silently ignore (a
    top-level rope_theta beside rope_parameters' own), one line each naming ``where`` (a config.json path, or
    model.architecture), the key and the value. A whole number where a float is declared is the float
    (``"rms_norm_eps": 1`` as ``1.0``): JSON and Hydra write 0 and 0.0 alike."""
    fix = fixer(override)
    declared = getattr(config_class, "__dataclass_fields__", {})
    validators = getattr(config_class, "__validators__", {})
    fields, problems, bad = dict(fields), [], set()

    def accepts(name, value) -> Exception | None:
        for validator in validators.get(name, ()):
            try:
                validator(value)
            except (TypeError, ValueError) as e:
                return e
        return None

    for name, value in list(fields.items()):
        if name not in validators:
            continue
        error = accepts(name, value)
        if error is not None and _number(value) and isinstance(value, int) and accepts(name, float(value)) is None:
            fields[name], error = float(value), None
        if error is None:
            continue
        bad.add(name)
        kind = declared[name].type
        if isinstance(error, TypeError):
            problems.append(
                f"{where}: {name} {value!r} is not {type_words(kind)}: {fix(name, 'to ' + type_words(kind))}"
            )
        elif name in HOUSE_RANGES:  # our own words for the range, not transformers' validator text
            wanted, why = HOUSE_RANGES[name]
            why = why if _finite(value) else "is not a finite number"
            problems.append(f"{where}: {name} {value!r} {why}: {fix(name, wanted)}")
        else:
            problems.append(f"{where}: {name} {value!r} is out of range ({error}): {fix(name, 'within it')}")
    problems += _name_problems(fields, where, fix, bad)

    def value(name):
        if name in fields:
            return fields[name]
        return getattr(declared[name], "default", None) if name in declared else None

    sizes = {}
    for name in SIZE_KEYS:
        size = value(name)
        if name in bad or size is None or (name not in fields and name not in declared):
            continue
        if not (_number(size) and isinstance(size, int) and size >= 1):
            bad.add(name)
            problems.append(
                f"{where}: {name} {size!r} is not a positive whole number (a size or count of the model): "
                + fix(name, "to 1 or more")
            )
        else:
            sizes[name] = size
    key, there = ("model.architecture.", "") if override else ("", " there")
    heads, kv, hidden = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads"), sizes.get("hidden_size")
    if heads and kv and heads % kv:
        problems.append(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} (each key/value head "
            f"serves the same number of query heads): set {key}num_key_value_heads to a divisor of {heads} "
            f"({_divisors(heads)}) or {key}num_attention_heads to a multiple of {kv}{there}"
        )
    # head_dim unset: each head takes hidden_size / num_attention_heads dimensions (LlamaConfig asks it always)
    model_type = getattr(config_class, "model_type", None)
    # (multi-head latent attention's heads take sizes of their own: qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    mla = model_type == "deepseek_v3"
    if heads and hidden and hidden % heads and not mla and (value("head_dim") is None or model_type == "llama"):
        problems.append(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} (each head takes "
            f"hidden_size / num_attention_heads dimensions): "
            f"{fix('num_attention_heads', f'to a divisor of {hidden} (e.g. {_near_divisor(hidden, heads)})')}"
        )
    problems += _token_id_problems(fields, sizes.get("vocab_size"), where, fix, bad, override)
    problems += _rope_duplicate_problems(config_class, fields, where, override)
    return fields, problems, bad


def _name_problems(fields: dict, where: str, fix, bad: set) -> list[str]:
    """hidden_act and dtype / torch_dtype name what transformers looks up by name when it builds the model (an
    activation in transformers.activations.ACT2FN, a torch floating dtype): a name it lacks is a KeyError or an
    AttributeError from inside the build."""
    import torch
    from transformers.activations import ACT2FN

    problems = []
    act = fields.get("hidden_act")
    if "hidden_act" not in bad and isinstance(act, str) and act not in ACT2FN:
        bad.add("hidden_act")
        problems.append(
            f"{where}: hidden_act {act!r} is not an activation transformers knows: "
            + fix("hidden_act", f"to one of {', '.join(sorted(ACT2FN))} (silu in Llama)")
        )
    for key in ("dtype", "torch_dtype"):
        name = fields.get(key)
        if key in bad or not isinstance(name, str):
            continue
        dtype = getattr(torch, name, None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            bad.add(key)
            problems.append(
                f"{where}: {key} {name!r} is not a torch floating dtype: "
                + fix(key, "to bfloat16, float16 or float32 (the dtype of the released weights), or remove it")
            )
    return problems


def _token_id_problems(fields: dict, vocab: int | None, where: str, fix, bad: set, override: bool) -> list[str]:
    """pad/bos/eos token ids of a config.json inside its vocabulary (pad_token_id is the embedding's padding row: one
    outside it fails the build). From scratch pad_token_id only: a conf/model's bos/eos ids stay set where
    model.architecture.vocab_size is lowered to a small tokenizer's (tests/test_families.py), and train nothing."""
    problems = []
    if vocab is None:
        return problems
    for key in ("pad_token_id",) if override else ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = fields.get(key)
        if key in bad or value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if all(_number(i) and isinstance(i, int) and 0 <= i < vocab for i in ids):
            continue
        bad.add(key)
        problems.append(
            f"{where}: {key} {value!r} is outside the vocabulary (vocab_size {vocab}): "
            + fix(key, f"to a token id in [0, {vocab}) (the tokenizer's), or null")
        )
    return problems


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[:-1])) + f" or {found[-1]}" if len(found) > 1 else str(n)


def _near_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), -d))


def _rope_duplicate_problems(config_class: type, fields: dict, where: str, override: bool) -> list[str]:
    """A RoPE value set twice, differently, where transformers 5 takes one and drops the other without a word
    (modeling_rope_utils' ``convert_rope_params_to_dict``): ``rope_scaling`` replaces ``rope_parameters``, and a
    ``rope_theta`` / ``partial_rotary_factor`` of the one it takes wins over the top-level key."""
    import transformers

    version = transformers.__version__
    key = "model.architecture." if override else ""
    problems = []
    params, scaling = fields.get("rope_parameters"), fields.get("rope_scaling")
    rope = scaling if isinstance(scaling, dict) else params
    used = "rope_scaling" if isinstance(scaling, dict) else "rope_parameters"
    if not isinstance(rope, dict):
        return problems
    if isinstance(params, dict) and used == "rope_scaling":
        taken = {"rope_theta": fields.get("rope_theta", getattr(config_class, "default_theta", None)), **scaling}
        # what rope_parameters says that the config will not have ("default": no scaling, what rope_scaling replaces)
        lost = {k: v for k, v in params.items() if taken.get(k) != v and (k, v) != ("rope_type", "default")}
        if lost:
            said = ", ".join(f"{k} {v!r} (it takes {taken.get(k)!r})" for k, v in lost.items())
            problems.append(
                f"{where}: rope_scaling {scaling} and rope_parameters {params} are both set: transformers {version} "
                f"builds the RoPE from rope_scaling and ignores rope_parameters' {said}; keep one of them (put those "
                f"values in {key}rope_scaling, or remove it)"
            )
    for name in ROPE_DUPLICATES:
        if name in fields and name in rope and fields[name] != rope[name]:
            problems.append(
                f"{where}: {name} {fields[name]!r} and {used}.{name} {rope[name]!r} disagree: transformers {version} "
                f"uses {used}.{name} ({rope[name]!r}) and ignores the top-level {name}; set the one you mean in "
                f"{key}{used}.{name} and remove {key}{name}"
            )
    return problems


_BASIC_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", typing.Any: "any value"}
_PLURALS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def type_words(kind) -> str:
    """A declared type in words, for a message: ``int | None`` "an integer or null", ``list[int]`` "a list of
    integers", ``dict[str, Any]`` "a mapping (name: value)", a Literal or Enum "one of a, b, c"."""
    if kind is None or kind is type(None):
        return "null"
    if kind in _BASIC_WORDS:
        return _BASIC_WORDS[kind]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        words = list(dict.fromkeys(type_words(a) for a in args if a is not type(None)))
        if "a number" in words and "an integer" in words:
            words.remove("an integer")
        words += ["null"] if type(None) in args else []
        return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "one of " + ", ".join(str(m.value) for m in kind)
    if origin in (list, tuple, set) or kind in (list, tuple, set):
        entry = args[0] if args else None
        return f"a list of {_PLURALS[entry]}" if entry in _PLURALS else "a list"
    if origin is dict or kind is dict or typing.is_typeddict(kind):
        return "a mapping (name: value)"
    return f"a {getattr(kind, '__name__', str(kind))}"
