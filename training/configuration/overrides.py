"""The keys a user set: Hydra overrides and composed config keys that TrainConfig does not have (each with the
nearest valid key, or why a TRL GRPOConfig setting is not here), values of a type the key does not take (each with
the form it takes), and entries of a ``data.sources`` override that are not sources."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import fields
from enum import Enum

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from models.config_rules import type_words
from training.configuration.schema import MODEL_CONF_DIR, DataFormat, SourceConfig, TrainConfig, leaf_keys


def given_keys(overrides: list[str]) -> set[str]:
    """The dotted keys a list of Hydra overrides sets (``++data.pad_to_multiple_of=8`` -> data.pad_to_multiple_of)."""
    return {arg.split("=", 1)[0].lstrip("+~") for arg in overrides if "=" in arg}


# TRL 1.16 GRPOConfig's settings that grpo.* does not have: grpo.<name> is refused with why, not with the nearest key
# (a test checks each is a GRPOConfig field; trl is not imported here, it is a test-only dependency).
_VLLM = "generation runs on the pipeline's own stages (parallel/pipeline_generation.py), not in vLLM"
_OWN_GENERATION = "generation runs on the pipeline's own stages, each with its own KV cache (models/generation.py)"
_SAMPLING = "sampling takes grpo.temperature, grpo.top_p and grpo.top_k only"
_ONE_BATCH = (
    "each step generates its own completions, the global batch (micro_batch_size x gradient_accumulation_steps x "
    "data-parallel; TRL's default)"
)
_REFERENCE = "the reference of grpo.beta > 0 stays the starting weights (TRL's default)"
_ENTROPY = "no entropy term is added to the loss (TRL's default)"
_LOGGING = "completions are not logged as tables (metrics.jsonl has the rewards)"
_LOSSES = "its loss type is not built (grpo.loss_type: dapo, grpo, dr_grpo or bnpo)"
TRL_GRPO_ONLY = {
    "learning_rate": "the learning rate is optim.lr",
    "model_init_kwargs": "the model is loaded from model_name_or_path as the pipeline builds it",
    "trust_remote_code": "the model is loaded from model_name_or_path as the pipeline builds it, without remote code",
    "router_aux_loss_coef": "the router loss follows the model config's output_router_logits and router_aux_loss_coef",
    "disable_dropout": "the model's dropout stays as its config sets it (TRL's default)",
    "cast_lm_head_to_fp32": "the LM head runs in the run's precision (precision=fp32 for fp32)",
    "remove_unused_columns": "every column but the prompt reaches the reward functions (TRL's default)",
    "num_generations_eval": "evaluation generates grpo.num_generations completions per prompt",
    "ds3_gather_for_generation": "generation runs on the pipeline engine, which has no ZeRO-3 weights to gather",
    "shuffle_dataset": "data.shuffle shuffles the prompts (seeded with seed, a permutation per pass)",
    "pad_to_multiple_of": "rows are padded as data.pad_to_multiple_of says",
    "generation_batch_size": _ONE_BATCH,
    "steps_per_generation": _ONE_BATCH,
    "min_p": _SAMPLING,
    "repetition_penalty": _SAMPLING,
    "generation_kwargs": _SAMPLING,
    "chat_template_kwargs": "conversational prompts are rendered with the chat template's defaults",
    "cache_implementation": _OWN_GENERATION,
    "use_transformers_continuous_batching": _OWN_GENERATION,
    "transformers_continuous_batching_config": _OWN_GENERATION,
    "use_transformers_paged": _OWN_GENERATION,
    "use_vllm": _VLLM,
    "vllm_mode": _VLLM,
    "vllm_model_impl": _VLLM,
    "vllm_enable_sleep_mode": _VLLM,
    "vllm_structured_outputs_regex": _VLLM,
    "vllm_server_base_url": _VLLM,
    "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM,
    "vllm_server_timeout": _VLLM,
    "vllm_group_port": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM,
    "vllm_max_model_length": _VLLM,
    "vllm_tensor_parallel_size": _VLLM,
    "vllm_importance_sampling_correction": _VLLM,
    "vllm_importance_sampling_mode": _VLLM,
    "vllm_importance_sampling_clip_max": _VLLM,
    "vllm_importance_sampling_clip_min": _VLLM,
    "vllm_importance_sampling_cap": _VLLM,
    "delta": "the two-sided clip of the ratio (delta) is not built",
    "sapo_temperature_neg": _LOSSES,
    "sapo_temperature_pos": _LOSSES,
    "vespo_k_pos": _LOSSES,
    "vespo_lambda_pos": _LOSSES,
    "vespo_k_neg": _LOSSES,
    "vespo_lambda_neg": _LOSSES,
    "importance_sampling_level": "the ratio is taken per token (TRL's default, token); per sequence is not built",
    "multi_objective_aggregation": "the rewards are summed, then normalised (TRL's default, sum_then_normalize)",
    "sync_ref_model": _REFERENCE,
    "ref_model_mixup_alpha": _REFERENCE,
    "ref_model_sync_steps": _REFERENCE,
    "top_entropy_quantile": "every completion token counts in the loss (TRL's default, 1.0)",
    "entropy_coef": _ENTROPY,
    "use_adaptive_entropy": _ENTROPY,
    "entropy_coef_min": _ENTROPY,
    "entropy_coef_max": _ENTROPY,
    "entropy_coef_delta": _ENTROPY,
    "entropy_target": _ENTROPY,
    "max_tool_calling_iterations": "tool calls during generation are not built",
    "off_policy_mask_threshold": "the off-policy sequence mask is not built",
    "use_bias_correction_kl": "the KL term is always bias-corrected (TRL's default, true)",
    "log_completions": _LOGGING,
    "log_multimodal": _LOGGING,
    "num_completions_to_print": _LOGGING,
    "log_unique_prompts": _LOGGING,
    "log_completions_hub_repo": _LOGGING,
}


def trl_only_problem(key: str) -> str | None:
    """The line for ``grpo.<name>``, a TRL GRPOConfig setting this project does not have; None for any other key."""
    section, _, name = key.partition(".")
    if section != "grpo" or name not in TRL_GRPO_ONLY:
        return None
    return f"{key} is TRL GRPOConfig's setting, not supported here: {TRL_GRPO_ONLY[name]}"


def unknown_key_problems(given: dict, schema: type | None = None, prefix: str = "") -> list[str]:
    """Keys of the composed config that TrainConfig does not have (``+key=value`` adds them past Hydra's
    own check, and OmegaConf.to_object drops them silently), each with the nearest valid key."""
    defaults = (schema or TrainConfig)()
    problems = []
    for key, value in given.items():
        if not hasattr(defaults, key) and trl_only_problem(f"{prefix}{key}"):
            problems.append(trl_only_problem(f"{prefix}{key}"))
        elif not hasattr(defaults, key):
            near = difflib.get_close_matches(
                f"{prefix}{key}", leaf_keys(dataclasses.asdict(TrainConfig())), n=1, cutoff=0.6
            )
            hint = f": did you mean {near[0]}?" if near else ": `python train.py --cfg job` lists the keys"
            problems.append(f"unknown key {prefix}{key}{hint}")
        elif dataclasses.is_dataclass(getattr(defaults, key)) and isinstance(value, dict):
            problems += unknown_key_problems(value, type(getattr(defaults, key)), f"{prefix}{key}.")
    return problems


def override_key_problems(overrides: list[str]) -> list[str]:
    """Command-line ``key=value`` overrides whose key TrainConfig does not have, found before Hydra
    composes the config (Hydra's own error would suggest adding the typo with ``+``), in
    ``unknown_key_problems``' words, then values the key does not take (``value_type_problem``). Groups
    (``model=``, ``ds=``, ``data=``), Hydra's own keys and ``+``/``~`` overrides are left to Hydra and to
    ``unknown_key_problems``."""
    groups = {d for d in os.listdir(os.path.dirname(MODEL_CONF_DIR)) if not d.endswith(".yaml")}
    given, sources, values = {}, [], []
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if "=" not in arg or arg.startswith(("-", "+", "~")) or key in groups or key.split(".")[0] == "hydra":
            continue
        node, parts = TrainConfig(), key.split(".")
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node) or not hasattr(node, part):
                break
            node = getattr(node, part)
        else:
            if key in ("data.sources", "data.eval_sources"):
                sources += source_override_problems(key, arg.split("=", 1)[1])
            elif not dataclasses.is_dataclass(node):
                values.append(arg)
            continue
        if not dataclasses.is_dataclass(node) and depth > 0 and parts[depth - 1] == "architecture":
            continue  # below model.architecture: a Hugging Face config field, checked when the config is built
        tree = given
        for part in parts[:-1]:
            tree = tree.setdefault(part, {})
        tree[parts[-1]] = None
    return unknown_key_problems(given) + sources + value_type_problems(values)


# The form of list keys whose entries are not interchangeable ({v}: the value given alone); any other list key
# given one value is shown that value as a one-entry list.
LIST_FORMS = {
    "profile_steps": "two steps [first,last]: profile_steps=[{v},{v}] for step {v} alone, e.g. profile_steps=[5,6]",
    "optim.betas": "AdamW's two betas [beta1,beta2], e.g. optim.betas=[0.9,0.95]",
}


# The forms of mapping keys: (one entry, several)
DICT_FORMS = {
    "model.architecture": (
        "<key>=value (a Hugging Face config key, e.g. model.architecture.hidden_size=64)",
        "'{hidden_size:64,num_hidden_layers:4}'",
    ),
}


def value_type_problems(overrides: list[str]) -> list[str]:
    """``key=value`` overrides of TrainConfig's leaf keys whose value Hydra would refuse for the key's type, each
    with the form the key takes (Hydra says only "int is not a ListConfig" or "could not be converted to
    Integer"; for a choice it lists the valid values, and is left to say so). The value is parsed as Hydra parses
    it and set as Hydra sets it (``OmegaConf.update`` on the schema), so nothing Hydra accepts is refused here."""
    problems, schema = [], None
    for arg in overrides:
        try:
            override = OverridesParser.create().parse_override(arg)
        except Exception:  # not parsable: Hydra's message names where
            continue
        if override.is_sweep_override():
            continue
        key, value = override.key_or_group, override.value()
        schema = schema if schema is not None else OmegaConf.structured(TrainConfig)
        try:
            OmegaConf.update(schema, key, value, merge=True)
        except ValidationError:
            kind, _ = key_type(key)
            if not (isinstance(kind, type) and issubclass(kind, Enum)):  # Hydra's line lists the choices already
                problems.append(value_type_problem(key, arg.split("=", 1)[1], value))
        except Exception:  # no merge into the schema's default (a mapping into model.architecture's None): the
            continue  # composed config, with the group's entry, decides
    return problems


def value_type_problem(key: str, raw: str, value) -> str:
    """The line for ``key=raw`` (parsed: ``value``) that ``key``'s type does not take: the form it takes."""
    kind, default = key_type(key)
    origin = typing.get_origin(kind) or kind
    if origin is dict:
        entry, example = DICT_FORMS.get(key, ("<name>=value", "{name:value,other:value}"))
        return (
            f"{key}={raw}: {key} is a mapping: set one entry with {key}.{entry}, or several with "
            f"{key}={example} (Hydra's mapping syntax)"
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)) and key in LIST_FORMS:
            return f"{key}={raw} is one value; {key} is a list of {LIST_FORMS[key].format(v=raw)}"
        if not isinstance(value, (list, tuple)):
            return f"{key}={raw} is one value; {key} is a list: write {key}=[{raw}] (several: [a,b])"
        entry = typing.get_args(kind)[0] if typing.get_args(kind) else str
        example = (
            f"; {key} is a list of {LIST_FORMS[key].format(v='N')}" if key in LIST_FORMS else example_of(key, default)
        )
        return f"{key}={raw}: each entry of {key} must be {type_words(entry)}{example}"
    return f"{key}={raw}: {key} takes {type_words(kind)}{example_of(key, default) if kind is not bool else ''}"


def example_of(key: str, default) -> str:
    """The hint ", e.g. key=<its default>" where the default is an example worth showing."""
    return f", e.g. {key}={form(default)}" if default not in (None, "", []) else ""


def key_type(key: str) -> tuple[type, object]:
    """(the declared type, without Optional, and the default) of TrainConfig's dotted leaf ``key``."""
    node: object = TrainConfig()
    for part in key.split("."):
        kind = typing.get_type_hints(type(node))[part]
        node = getattr(node, part)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]
    return kind, node


def form(value) -> str:
    """``value`` written as a Hydra override writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(form(v) for v in value) + "]"
    return str(value)


def source_override_problems(key: str, value: str) -> list[str]:
    """Entries of a data.sources / data.eval_sources override that are not sources (a mistyped key, a format
    no reader knows, a weight that is no number, a bare path), each named with a source's keys: Hydra would
    advise ``+data.sources`` or say only that it could not merge the override."""
    try:
        entries = OverridesParser.create().parse_override(f"{key}={value}").value()
    except Exception:  # not parsable: Hydra's message names where
        return []
    keys = [f.name for f in fields(SourceConfig)]
    valid = f"a source's keys are {', '.join(keys)}"
    if not isinstance(entries, list):
        return [f"{key} is a list of sources, e.g. {key}='[{{path: a.jsonl, weight: 3}}]' ({valid})"]
    problems = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} {entry!r} is not a source: write it as {{path: {entry}}} ({valid})")
            continue
        for name in entry:
            if name not in keys:
                near = difflib.get_close_matches(str(name), keys, n=1, cutoff=0.6)
                hint = f": did you mean {near[0]}?" if near else ""
                problems.append(f"unknown key {name} in {where}{hint} ({valid})")
        fmt = entry.get("format")
        if fmt is not None and fmt not in [f.value for f in DataFormat]:
            problems.append(
                f"{where} format {fmt!r}: set one of {', '.join(f.value for f in DataFormat)}, or leave it out "
                "(the source then has data.format)"
            )
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            problems.append(f"{where} weight {weight!r} is not a number: set e.g. weight: 3")
    return problems
