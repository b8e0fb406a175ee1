"""A training command checked before booking the cluster (scripts/preflight.py): the same config
validation train.py runs, for a given world size, then the layout and the planner's per-GPU memory
estimate for it, with the pipeline schedule's bubble (and DualPipeV's activations against 1F1B's) and, for a
Mixture-of-Experts model, its experts per rank and their all-to-all bytes. With num_epochs, the steps the run will
take where its data is already tokenized (a scripts/prepare_data.py directory or the tokenized cache: the sample
count of its meta.json, the settings naming steps checked against them; training/configuration/step_range.py).
Nothing is started: no process group, no model, no tokenizing."""

from __future__ import annotations

import dataclasses
import os

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel.generation_memory import cache_windows, generation_chunks, prompt_tokens, with_generation
from parallel.memory_plan import GB, expert_report, schedule_report, shape_of, stage_estimates, stage_table
from parallel.partition import splitter
from training.configuration.overrides import given_keys, override_key_problems, unknown_key_problems
from training.configuration.schema import REPO_ROOT, ConfigError, register_configs
from training.configuration.step_range import known_steps, known_train_samples
from training.configuration.validate import resolve

INTERNAL_LINES = ("reference_type=", "object_type=")  # OmegaConf's class names in a validation error: no help to a user


def composed_with_unknown(overrides: list[str]):
    """(train.py's config, a training.configuration.schema.TrainConfig, from its Hydra overrides; its keys TrainConfig
    lacks, in train.py's words), without starting anything. Raises ValueError with train.py's message for a mistyped key
    (override_key_problems, before Hydra, as train.py's ``__main__``) or an override Hydra cannot apply: Hydra's
    line and its causes, as train.py prints them (an invalid choice's cause lists the valid values)."""
    typos = override_key_problems(overrides)
    if typos:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(typos))
    register_configs()
    try:
        with initialize_config_dir(config_dir=os.path.join(REPO_ROOT, "conf"), version_base="1.3"):
            tree = compose(config_name="config", overrides=overrides)
            unknown = unknown_key_problems(OmegaConf.to_container(tree))  # to_object would drop them silently
            return OmegaConf.to_object(tree), unknown
    except (HydraException, OmegaConfBaseException) as e:
        lines, cause = [str(e)], e.__cause__
        while cause is not None:
            lines += [line for line in str(cause).splitlines() if not line.strip().startswith(INTERNAL_LINES)]
            cause = cause.__cause__
        raise ValueError("\n".join(lines)) from e


def composed(overrides: list[str]):
    """train.py's config from its Hydra overrides (composed_with_unknown); a key TrainConfig lacks raises
    ValueError with train.py's line."""
    cfg, unknown = composed_with_unknown(overrides)
    if unknown:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(unknown))
    return cfg


def check(world_size: int, overrides: list[str]) -> list[str]:
    """The report's lines for a valid config; raises ValueError with train.py's message otherwise."""
    cfg, unknown = composed_with_unknown(overrides)
    try:
        resolved = resolve(cfg, world_size=world_size, problems=unknown, given=given_keys(overrides), count_data=True)
    except ConfigError as e:
        raise ValueError(str(e)) from e
    cfg, config = resolved.cfg, resolved.model_config
    lines = [f"adapted: {a}" for a in resolved.adapted] + [f"warning: {w}" for w in resolved.warnings]
    layout = resolved.layout
    lines.append(
        f"config OK for {world_size} ranks: {layout.axes()}, {layout.engine}, "
        f"ds_config {cfg.ds_config} (ZeRO-{layout.zero}), {cfg.precision}"
    )
    lines.append(
        f"global batch {layout.global_batch} = micro {layout.micro_batch} x grad_acc {layout.grad_accum} "
        f"x dp {layout.dp}; {layout.tokens_per_step} tokens/step"
    )
    if cfg.num_epochs:  # where max_steps alone decides, the steps are the config's
        lines.append(steps_line(resolved))
    layout = dataclasses.replace(layout, dtype="fp32" if cfg.precision == "fp32" else "bf16")  # the planner's two cases
    split = splitter(config, None, cfg.partition_method)
    params, layers = split(layout)
    stages = stage_estimates(params, layout, shape_of(config), layers)
    windows = cache_windows(config) if layout.generation else None
    stages = with_generation(stages, params, layout, shape_of(config), layers, windows)
    e = max(stages, key=lambda s: s.total)
    lines.append(
        f"planner (scripts/estimate_memory.py), most loaded GPU (stage {e.stage}, {e.parameters / 1e9:.2f} B "
        f"params): {estimate_sum(e)}"
        + (f"; host {e.host / GB:.1f} GB per rank (offloaded)" if e.host else "")
        + (f"; host {e.snapshot / GB:.1f} GB per rank for save_async's copy of a checkpoint" if e.snapshot else "")
    )
    lines += ["  " + line for line in stage_table(stages, layers, layout)]
    lines += generation_report(layout)
    lines += schedule_report(split, layout, shape_of(config))
    lines += expert_report(layout, shape_of(config), layers)  # a MoE model's experts per rank and all-to-all bytes
    if layout.lora_rank:
        full = max(
            stage_estimates(params, dataclasses.replace(layout, lora_rank=0), shape_of(config), layers),
            key=lambda s: s.total,
        )
        lines.append(
            f"LoRA r={layout.lora_rank}: adapters {sum(s.parameters - p for s, p in zip(stages, params)) / 1e6:.1f} M "
            f"trained; full fine-tuning on this layout would need {full.total / GB:.1f} GB on its most loaded GPU "
            f"(stage {full.stage}; model states {full.model_states / GB:.1f} GB against {e.model_states / GB:.1f} GB)"
        )
    return lines


def estimate_sum(e) -> str:
    """A stage's estimate as its sum in GB: the training step's parts, or with train_objective=grpo the resident
    parts and the larger of the training step and the generation (``Estimate.total``)."""
    states = f"model states {e.model_states / GB:.1f} GB"
    acts = f"activations {e.activations / GB:.1f} GB + loss {e.loss / GB:.1f} GB"
    if not e.generation:
        temps = f"gradient and bucket temporaries {(e.grad_temp + e.buffers) / GB:.1f} GB"
        return f"{states} + {acts} + {temps} = {e.total / GB:.1f} GB"
    bucket = f" + bucket {e.buffers / GB:.1f} GB" if e.buffers else ""
    return (
        f"{states} + reference weights {e.reference / GB:.1f} GB{bucket} + the larger of the training step ({acts} + "
        f"gradient temporaries {e.grad_temp / GB:.1f} GB = {e.training / GB:.1f} GB) and the generation (KV cache "
        f"{e.kv_cache / GB:.1f} GB + logits, masks and hidden states {(e.generation - e.kv_cache) / GB:.1f} GB = "
        f"{e.generation / GB:.1f} GB) = {e.total / GB:.1f} GB"
    )


def generation_report(layout) -> list[str]:
    """What train_objective=grpo's generation holds per data-parallel rank, in the config's knobs; nothing else."""
    g = layout.generation
    if g is None:
        return []
    reference = (
        f"the reference weights (grpo.beta {g.beta:g}) stay beside the trained ones"
        if g.beta
        else "no reference weights (grpo.beta 0)"
    )
    return [
        f"generation (train_objective=grpo): {layout.rank_batch} rows per data-parallel rank (micro_batch_size "
        f"{layout.micro_batch} x gradient_accumulation_steps {layout.grad_accum}) in {generation_chunks(layout)} "
        f"chunks (grpo.generation_micro_batches), prompts of up to {prompt_tokens(layout)} tokens "
        f"(data.max_seq_length - grpo.max_completion_length) + {g.completion_len} generated; its KV cache is freed "
        f"before the training step, {reference}"
    ]


def steps_line(resolved) -> str:
    """The steps the run will train and where the count comes from (what resolve checked the settings naming steps
    against), or why num_epochs' count is not known yet."""
    cfg = resolved.cfg
    steps = known_steps(cfg, resolved.dp, resolved.resume_tag, resolved.model_config, count_data=True)
    if steps is not None:
        return steps.line()
    unknown = known_train_samples(cfg, resolved.model_config)[1]
    return f"steps: num_epochs {cfg.num_epochs:g} of the training data; {unknown}"
