"""The ``peft.*`` settings' rules, checked before start by training.configuration.validate.resolve (cfg: its
TrainConfig, layout: parallel.layout.Layout): what a LoRA run cannot do with these settings, and a resume that changes
them."""

from __future__ import annotations

import importlib.util
import os

from models.family_qwen3_5 import lora_problems as qwen3_5_lora_problems
from models.files.peft_adapter import adapter_model_problems, adapter_settings_problems
from models.peft_targets import DECODER_LINEARS, SAVABLE_MODULES


def peft_change_problems(cfg, changes) -> list[str]:
    """Resuming with other ``peft`` settings than the checkpoint's: the adapters (or their absence) are
    what was trained, so any change is refused (``peft.init_from`` applies to a new run only)."""
    changed = {k: v for cls in changes.changed.values() for k, v in cls.items() if k.startswith("peft.")}
    changed.pop("peft.init_from", None)
    if not changed:
        return []
    return [
        f"{cfg.output_dir} was trained with other peft settings: "
        + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        + ": set the saved values to resume it, or choose another output_dir"
    ]


def peft_layout_problems(layout, peft_method: str | None = None, ds_config: str | None = None) -> list[str]:
    """PEFT's rule on a parallel.layout.Layout (peft_problems asks it with the config's settings, the planner,
    parallel/memory_plan.py, with those the layout implies: LoRA where ``layout.lora_rank`` > 0, ds=zeroN of its
    ZeRO stage): the pipeline engine (``layout.engine``, parallel/engines.py, says whether it is one)."""
    if peft_method is None:
        peft_method = "lora" if layout.lora_rank else "none"
    if peft_method == "none":
        return []
    ds_config = ds_config if ds_config is not None else f"zero{layout.zero}"
    return layout.engine.pipeline_only(
        f"peft.method={peft_method} runs on the pipeline engine: num_stages=1 with ds={ds_config} uses DeepSpeed's "
        "data-parallel engine, which this version does not adapt; use ds=zero0 or ds=zero1 (the frozen base has "
        "no optimizer state to partition further)"
    )


def peft_problems(cfg, model_config, layout) -> list[str]:
    """What a LoRA run cannot do with these settings (peft.method=lora)."""
    p, problems = cfg.peft, []
    if not cfg.model_name_or_path:
        problems.append("peft.method=lora adapts a trained base: set model_name_or_path (a convert2ckpt.py checkpoint)")
    if p.alpha == 0:
        problems.append(
            "peft.alpha 0 scales every adapter's update to 0, so nothing trains (gradient norm 0 every step): set "
            "peft.alpha > 0 (commonly 2 x peft.r)"
        )
    elif p.alpha < 0:
        problems.append(
            f"peft.alpha {p.alpha:g} < 0 scales every adapter's update by a negative alpha / r: set peft.alpha > 0 "
            "(commonly 2 x peft.r)"
        )
    problems += qwen3_5_lora_problems(getattr(model_config, "model_type", None))
    if p.r < 1:
        problems.append(f"peft.r {p.r} < 1: set the LoRA rank to 1 or more (8, 16, 64 are common)")
    if not 0 <= p.dropout < 1:
        problems.append(f"peft.dropout {p.dropout} must be in [0, 1)")
    unknown = sorted(set(p.target_modules) - set(DECODER_LINEARS))
    if unknown or not p.target_modules:
        problems.append(
            f"peft.target_modules {list(p.target_modules)}: choose one or more of {list(DECODER_LINEARS)} "
            f"({'unknown: ' + ', '.join(unknown) if unknown else 'none given'})"
        )
    unknown = sorted(set(p.modules_to_save) - set(SAVABLE_MODULES))
    if unknown:
        problems.append(f"peft.modules_to_save {unknown} unknown: choose from {list(SAVABLE_MODULES)}")
    if model_config is not None and p.modules_to_save and model_config.tie_word_embeddings:
        problems.append(
            f"peft.modules_to_save {list(p.modules_to_save)} with tied embeddings: the embedding and the LM head "
            "share one weight, which PEFT's adapter format saves as two; leave peft.modules_to_save empty"
        )
    if p.quantize == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(
            "peft.quantize=nf4 (QLoRA) quantises with bitsandbytes, which is not installed: pip install "
            "bitsandbytes (pinned in pyproject.toml), or set peft.quantize=none"
        )
    problems += peft_layout_problems(layout, cfg.peft.method, cfg.ds_config)
    if p.init_from and not os.path.isdir(p.init_from):
        problems.append(
            f"peft.init_from {p.init_from}: no such directory: give a PEFT adapter directory "
            "(save_pretrained's output, or convert2ckpt.py --to-hf of a LoRA run)"
        )
    elif p.init_from and not os.path.isfile(os.path.join(p.init_from, "adapter_config.json")):
        problems.append(
            f"peft.init_from {p.init_from} has no adapter_config.json: give a PEFT adapter directory "
            "(save_pretrained's output, or convert2ckpt.py --to-hf of a LoRA run)"
        )
    elif p.init_from:
        damaged, differs = adapter_settings_problems(p.init_from, p)
        problems += damaged
        if model_config is not None:
            problems += adapter_model_problems(p.init_from, model_config)
        if differs:
            problems.append(
                f"peft.init_from={p.init_from} differs from the peft settings: {'; '.join(differs)}: set peft.* "
                "to the adapter's values"
            )
    return problems
