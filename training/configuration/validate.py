"""``resolve``: every rule of a training config checked before any process group starts, all problems reported
at once, each with the numbers involved and the knob to change. The rules live beside what they protect (the
layout's in parallel/layout.py, each axis's in its parallel/ module, the data's in data/checks.py, the DeepSpeed
JSON's in training/configuration/ds_json.py, resuming's in training/configuration/resume_rules.py); this module collects
them and holds the ones of the config as a whole: ranges, the objective, and settings that cannot act where they are
set."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import fields

from data.checks import data_problems, default_packing
from data.order_guard import ORDER_CHECK_RULE
from data.rewards import reward_function_problems
from data.tokenize_settings import prepared_problems, vocab_problems
from models.families import moe_spec
from models.family_gemma4 import training_problems as gemma4_training_problems
from models.family_qwen3_5 import objective_problems as qwen3_5_objective_problems
from models.files.pipeline_dir import tags_newer_than_latest
from models.fp8 import RECIPES, fp8_objective_problems, fp8_problems
from models.kernels import kernel_problems, loss_impl_problems
from models.lora_rules import peft_change_problems, peft_problems
from models.loss import logit_softcap
from parallel.axes import AXES, fp8_layout_problems, grpo_layout_problems
from parallel.layout import Layout, layout_problems
from parallel.partition import frozen_stage_problems
from training.compile import compile_problems, compile_warnings
from training.configuration.ds_json import ds_json_conflicts, load_ds_json, precision_problems
from training.configuration.float_keys import nonfinite_problems
from training.configuration.model_source import input_checkpoint_problems, resolve_model
from training.configuration.output_checks import disk_problems, output_dir_problems
from training.configuration.resume_rules import ACCEPTABLE_CHANGES, RESUME_KEY_CLASSES, find_resume, reshard_reason
from training.configuration.schema import (
    ConfigError,
    DPOConfig,
    GRPOConfig,
    PeftConfig,
    Resolved,
    TrainConfig,
    dotted,
    plain,
)
from training.configuration.step_range import known_steps, step_setting_problems
from training.moe_balance import balance_loss_problems, bias_update_problems
from training.observation.profiling import profile_problems
from training.observation.tracking import wandb_problems
from training.optim import adamw_problems
from training.resilience.run_lock import RunLock

HANG_TIMEOUT_MIN_S = 5.0  # hang_timeout_s below this (other than 0) is refused: see resolve's range checks
SEED_MAX = 2**63 - 1  # seed: numpy takes no negative seed, torch.Generator.manual_seed none past int64
# mfu_peak_tflops other than 0 (the known-GPU table): one device's peak TFLOP/s, from a CPU core's to past any GPU's
MFU_PEAK_TFLOPS = (0.01, 100_000.0)


def adapt_defaults(cfg: TrainConfig, given: set[str] | None) -> list[str]:
    """Defaults the user left that a feature they set cannot run with, changed in ``cfg`` to values it runs with
    (each axis's ``defaults``, parallel/axis.py): one line each, for the start-up log. Only a value the user left
    adapts; one they set (an override naming it, or a value other than the default) stays, and the rule beside the
    feature refuses it."""
    now, default = dataclasses.asdict(cfg), dataclasses.asdict(TrainConfig())

    def is_set(key: str) -> bool:
        return key in (given or ()) or plain(dotted(now, key)) != plain(dotted(default, key))

    lines, adapted = [], set()
    for key, value, why in [one for axis in AXES for one in axis.defaults(cfg, is_set)]:
        if key in adapted:  # two axes the rules refuse together: the first's value stands
            continue
        adapted.add(key)
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        lines.append(f"{key} {getattr(node, name)} -> {value} (the default; {why}): set {key} to choose")
        setattr(node, name, value)
    return lines


def resolve(
    cfg: TrainConfig,
    world_size: int,
    problems: list[str] | None = None,
    given: set[str] | None = None,
    count_data: bool = False,
) -> Resolved:
    """Check every cross-field rule; raise :class:`ConfigError` listing all problems together (with
    ``problems`` found before, such as unknown keys). ``given``: the keys the user set (their overrides), so that
    a default they left adapts to the features they set (:func:`adapt_defaults`, which changes ``cfg``).
    ``count_data`` (the preflight): count already tokenized training data, so that the settings naming steps are
    checked against num_epochs' steps too (training/configuration/step_range.py; train.py checks them once its data is
    built)."""
    adapted = adapt_defaults(cfg, given)
    in_use = RunLock(cfg.output_dir).holder()  # acquired after the process group starts; said here first
    problems, warnings = ([in_use] if in_use else []) + list(problems or []), []
    nonfinite, cfg = nonfinite_problems(cfg)  # the rules below see finite numbers (the defaults in place of the rest)
    problems += nonfinite
    model_config, model_problems = resolve_model(cfg)
    problems += model_problems + input_checkpoint_problems(cfg, model_config)
    resume_tag, resume_changes_, resume_problems = find_resume(cfg, model_config)
    problems += resume_problems
    reshard = ""
    if resume_tag and not resume_problems:
        reshard, reshard_problems = reshard_reason(cfg, resume_tag, resume_changes_, world_size, model_config)
        problems += reshard_problems
    ds_json, ds_problem = load_ds_json(cfg.ds_config)
    if ds_problem:
        problems.append(ds_problem)

    # The layout's rules (sizes, stages, ZeRO stage, offload, partition method) live beside the Layout, shared
    # with preflight and scripts/estimate_memory.py.
    layout = Layout.of(cfg, world_size, ds_json or {})
    num_layers = model_config.num_hidden_layers if model_config is not None else None
    problems += layout_problems(layout, world_size, cfg.partition_method, num_layers)
    for name, minimum in (
        ("max_steps", 0),
        ("num_epochs", 0),
        ("activation_checkpoint_interval", 0),
        ("log_steps", 1),
        ("eval_steps", 0),
        ("save_steps", 0),
        ("save_total_limit", 0),
        ("save_every_minutes", 0),
        ("dist_timeout_s", 1),
        ("preempt_grace_s", 1),
        ("hang_timeout_s", 0),
    ):
        if getattr(cfg, name) < minimum:
            problems.append(f"{name} {getattr(cfg, name)} is out of range: set {name} >= {minimum}")
    # A bound below a few seconds names healthy steps hung (the first step alone warms up for seconds; the watchdog
    # looks every 0.5 s) and its exit lands anywhere, e.g. in the middle of the run's work.
    if 0 < cfg.hang_timeout_s < HANG_TIMEOUT_MIN_S:
        problems.append(
            f"hang_timeout_s {cfg.hang_timeout_s:g} is too small to mean a hang: set hang_timeout_s >= "
            f"{HANG_TIMEOUT_MIN_S:g} (seconds one training step may run), or 0 = automatic (20 x the median step "
            "so far, at least 600 s)"
        )
    low, high = MFU_PEAK_TFLOPS
    if cfg.mfu_peak_tflops and not low <= cfg.mfu_peak_tflops <= high:
        problems.append(
            f"mfu_peak_tflops {cfg.mfu_peak_tflops:g} is not one device's peak TFLOP/s: set it in [{low:g}, {high:g}] "
            "(989 for an H100's or H200's bf16), or 0 for the known-GPU table"
        )
    if cfg.startup_timeout_s < 0:
        problems.append(f"startup_timeout_s {cfg.startup_timeout_s} < 0: set it >= 0 (0 = no limit)")
    if not 0 <= cfg.seed <= SEED_MAX:  # numpy's default_rng takes no negative seed, torch's Generator none past int64
        problems.append(f"seed {cfg.seed} is out of range: set seed in [0, 2**63 - 1] (e.g. 42)")
    if cfg.optim.warmup_steps < 0:
        problems.append(
            f"optim.warmup_steps {cfg.optim.warmup_steps} is out of range: set optim.warmup_steps >= 0 (0 = no warm-up)"
        )
    unknown_classes = sorted(set(cfg.resume_allow_changes) - set(ACCEPTABLE_CHANGES))
    if unknown_classes:
        problems.append(
            f"resume_allow_changes {unknown_classes} unknown: choose from {list(ACCEPTABLE_CHANGES)} "
            f"({', '.join(RESUME_KEY_CLASSES['layout'])} may change on resume without it)"
        )
    if model_config is not None and cfg.data.max_seq_length > model_config.max_position_embeddings:
        rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
        kind = rope.get("rope_type", "default")
        scaling = (
            "no rope scaling"
            if kind == "default"
            else f"rope scaling {kind}: " + ", ".join(f"{k}={v}" for k, v in rope.items() if k != "rope_type")
        )
        warnings.append(
            f"data.max_seq_length {cfg.data.max_seq_length} > max_position_embeddings "
            f"{model_config.max_position_embeddings} of the model ({scaling}): positions past "
            f"{model_config.max_position_embeddings} were never trained; lower data.max_seq_length unless "
            f"this run is meant to extend the context"
        )
    problems += precision_problems(cfg.precision)
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        problems.append(
            f"optim.betas {list(cfg.optim.betas)} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]"
        )
    if cfg.optim.weight_decay < 0:
        problems.append(f"optim.weight_decay {cfg.optim.weight_decay} < 0: set it >= 0")
    if cfg.optim.eps <= 0:  # AdamW divides by sqrt(v) + eps: 0 / 0 where a gradient and its moments are 0
        problems.append(
            f"optim.eps {cfg.optim.eps:g} <= 0: AdamW divides each update by sqrt(v) + eps, which is 0 (a NaN update) "
            "wherever a weight's gradients have been 0; set it in (0, 1) (AdamW's 1e-8)"
        )
    elif cfg.optim.eps >= 1:  # 1e8 for 1e-8: the update shrinks by that much
        problems.append(f"optim.eps {cfg.optim.eps:g} >= 1 swamps every update: set it in (0, 1) (AdamW's 1e-8)")
    lr_valid = 0 < cfg.optim.lr <= 1  # else its own line, and no rule measures another key against it
    if cfg.optim.lr > 1:
        problems.append(f"optim.lr {cfg.optim.lr:g} > 1 is no AdamW learning rate: set it in (0, 1] (1e-5 to 1e-3)")
    elif cfg.optim.lr < 0:
        problems.append(
            f"optim.lr {cfg.optim.lr:g} < 0 climbs the loss instead of descending it: set it in (0, 1] (1e-5 to 1e-3)"
        )
    elif lr_valid and cfg.optim.lr * cfg.optim.weight_decay >= 1:
        problems.append(
            f"optim.weight_decay {cfg.optim.weight_decay:g} x optim.lr {cfg.optim.lr:g} >= 1: decoupled weight decay "
            "multiplies each weight by 1 - lr x weight_decay every step, which zeroes or flips it; set "
            f"optim.weight_decay < {1 / cfg.optim.lr:g} (0.01 to 0.1 are common)"
        )
    if cfg.optim.max_grad_norm < 0:
        problems.append(f"optim.max_grad_norm {cfg.optim.max_grad_norm} < 0: set it >= 0 (0 = no clipping)")
    if cfg.optim.min_lr < 0 or (lr_valid and cfg.optim.min_lr > cfg.optim.lr):
        problems.append(f"optim.min_lr {cfg.optim.min_lr} must be in [0, optim.lr={cfg.optim.lr}]")
    if cfg.monitor.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("monitor.tensorboard=true needs the tensorboard package: pip install tensorboard")
    if cfg.monitor.wandb and importlib.util.find_spec("wandb") is None:
        problems.append("monitor.wandb=true needs the wandb package: pip install wandb==0.31.0")
    elif cfg.monitor.wandb and int(os.environ.get("RANK", "0")) == 0:  # the rank that logs (train.py's tracking_run)
        problems += wandb_problems(cfg.output_dir)
    problems += data_problems(cfg) + prepared_problems(cfg, model_config) + vocab_problems(cfg, model_config)
    problems += objective_problems(cfg, layout)
    if cfg.min_free_disk_gb < 0 and cfg.min_free_disk_gb != -1:
        problems.append(
            f"min_free_disk_gb {cfg.min_free_disk_gb} < 0: set it to -1 (one checkpoint's estimated size), 0 (no "
            "check) or a size in GB"
        )
    output_problems = output_dir_problems(cfg)
    problems += output_problems
    if not output_problems and ds_json is not None:
        disk, disk_warnings = disk_problems(cfg, model_config, layout.engine.weight_copies, world_size)
        problems += disk
        warnings += disk_warnings
    warnings += (
        [
            f"{cfg.output_dir}/{tag} is not a complete checkpoint (newer than the one `latest` names: a save "
            f"was interrupted): not resumed from; it is replaced or removed when this run saves"
            for tag in tags_newer_than_latest(cfg.output_dir)
        ]
        if not resume_problems
        else []
    )
    for axis in AXES:
        problems += axis.problems(cfg, model_config, layout, ds_json)
    problems += profile_problems(cfg.profile_steps)
    steps = known_steps(cfg, layout.dp, None if resume_problems else resume_tag, model_config, count_data)
    if steps is not None:  # else train.py checks them once num_epochs' steps are known (training/loop.py)
        step_problems, step_warnings = step_setting_problems(cfg, steps)
        problems += step_problems
        warnings += step_warnings
    problems += kernel_problems(cfg.kernels, model_config)
    problems += loss_impl_problems(
        cfg.loss_impl, cfg.loss_chunk_tokens, layout.engine, softcap=logit_softcap(model_config)
    )
    problems += adamw_problems(cfg.adamw_impl)
    problems += compile_problems(cfg, model_config, layout)
    problems += fp8_setting_problems(cfg, model_config, layout)
    problems += bias_update_problems(cfg.moe.bias_update_speed, model_config)
    problems += balance_loss_problems(cfg.moe, model_config, layout.engine, cfg.train_objective)
    problems += qwen3_5_objective_problems(getattr(model_config, "model_type", None), cfg.train_objective)
    problems += gemma4_training_problems(getattr(model_config, "model_type", None), gemma4_settings(cfg))
    warnings += compile_warnings(cfg, layout)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    for axis in AXES:
        warnings += axis.warnings(layout, local_world_size)
    inert, harmless = inert_settings(cfg, layout)
    problems += inert + noop_value_problems(cfg)
    warnings += harmless

    if layout.dp and ds_json is not None:
        problems += ds_json_conflicts(cfg, ds_json, layout)
    problems += peft_change_problems(cfg, resume_changes_)
    if cfg.peft.method != "none":
        peft = peft_problems(cfg, model_config, layout)
        if model_config is not None and layout.stages >= 1 and not peft:
            peft = frozen_stage_problems(cfg, model_config, layout)  # where the split leaves a stage nothing to train
        problems += peft
    if problems:
        # dict.fromkeys: a rule two checks share (layout_problems and ds_json_conflicts or data_problems) said once
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return Resolved(cfg, layout, ds_json, model_config, warnings, resume_tag, resume_changes_, reshard, adapted)


def fp8_setting_problems(cfg: TrainConfig, model_config, layout: Layout) -> list[str]:
    """What ``fp8`` does not run with: its own rules and the objectives' (models/fp8.py), each axis's, and the
    engine's."""
    moe = model_config is not None and moe_spec(model_config) is not None
    model_type = getattr(model_config, "model_type", None)
    problems = fp8_problems(cfg.fp8, cfg.precision, cfg.peft.method, model_type, moe, cfg.kernels)
    problems += fp8_objective_problems(cfg.fp8, cfg.train_objective)
    if cfg.fp8 not in RECIPES:  # off, or a name that is no recipe (said once, above)
        return problems
    return problems + fp8_layout_problems(layout, cfg.fp8, cfg.ds_config)


def objective_problems(cfg: TrainConfig, layout: Layout) -> list[str]:
    """train_objective=dpo and grpo: each one's data, its settings and what it does not run with."""
    problems, dpo, grpo = [], cfg.train_objective == "dpo", cfg.train_objective == "grpo"
    if dpo != (cfg.data.format == "dpo"):
        problems.append(
            f"train_objective={cfg.train_objective} with data.format={cfg.data.format}: preference pairs train with "
            "the DPO loss and nothing else does; use data=dpo (it sets both), or set both to sft"
        )
    if grpo != (cfg.data.format == "grpo"):
        problems.append(
            f"train_objective={cfg.train_objective} with data.format={cfg.data.format}: GRPO generates completions "
            "for prompts (data.format=grpo) and prompts have nothing else to train on; use data=grpo (it sets "
            "both), or set both to sft"
        )
    for key in ("sources", "eval_sources"):  # the same rule for each source's own format
        for i, source in enumerate(getattr(cfg.data, key)):
            if source.format == "dpo" and not dpo:
                problems.append(
                    f"data.{key}[{i}] ({source.path}) has format dpo, and train_objective is {cfg.train_objective}: "
                    "its preference pairs would train as two SFT rows each (the rejected completion a target); drop "
                    f"the source from the mixture, or train on it alone (data=dpo data.train_file={source.path})"
                )
            if source.format == "grpo" and not grpo:
                problems.append(
                    f"data.{key}[{i}] ({source.path}) has format grpo, and train_objective is {cfg.train_objective}: "
                    "its prompts have no completion to train on; drop the source from the mixture, or train on it "
                    f"alone (data=grpo data.train_file={source.path})"
                )
    if not (dpo or grpo):
        return problems
    if dpo:
        return problems + dpo_problems(cfg) + [p for axis in AXES for p in axis.objective_problems(layout, "dpo")]
    return problems + grpo_problems(cfg, layout) + grpo_layout_problems(layout, cfg.ds_config)


def dpo_problems(cfg: TrainConfig) -> list[str]:
    """train_objective=dpo: its data and its settings."""
    problems = []
    if cfg.data.packing:
        problems.append("data.packing=true with train_objective=dpo: each pair's rows stand alone; drop data.packing")
    if cfg.data.sources or cfg.data.eval_sources:
        problems.append(
            "data.sources/eval_sources with train_objective=dpo: the reference pass covers one source; use "
            "data.train_file (and data.eval_file or data.eval_fraction)"
        )
    if not cfg.dpo.beta > 0:
        problems.append(f"dpo.beta {cfg.dpo.beta} must be > 0 (TRL's default: 0.1)")
    if not 0 <= cfg.dpo.label_smoothing < 0.5:
        problems.append(f"dpo.label_smoothing {cfg.dpo.label_smoothing} must be in [0, 0.5)")
    elif cfg.dpo.label_smoothing and cfg.dpo.loss_type != "sigmoid":
        problems.append(
            f"dpo.label_smoothing {cfg.dpo.label_smoothing} smooths the sigmoid loss, and dpo.loss_type is "
            f"{cfg.dpo.loss_type}: drop dpo.label_smoothing or set dpo.loss_type=sigmoid"
        )
    return problems


def grpo_problems(cfg: TrainConfig, layout: Layout) -> list[str]:
    """train_objective=grpo: its data, what it does not run with (the axes' own rules aside) and its settings."""
    problems = []
    if cfg.data.packing:
        problems.append(
            "data.packing=true with train_objective=grpo: each prompt's completions are rows of their own; drop "
            "data.packing"
        )
    if cfg.data.sources or cfg.data.eval_sources:
        problems.append(
            f"data.sources/eval_sources ({len(cfg.data.sources)} and {len(cfg.data.eval_sources)} sources) with "
            "train_objective=grpo: the prompts come from one source; use data.train_file (and data.eval_file or "
            "data.eval_fraction)"
        )
    if cfg.num_epochs > 0:
        problems.append(
            f"num_epochs {cfg.num_epochs:g} with train_objective=grpo: a GRPO run counts max_steps (each step "
            "generates its own completions); set num_epochs=0 and max_steps"
        )
    if cfg.compile:
        problems.append(
            "compile=true with train_objective=grpo: generation and the GRPO loss are not built compiled; set "
            "compile=false"
        )
    if cfg.data.group_by_length:
        problems.append(
            "data.group_by_length=true with train_objective=grpo: a step's rows are its prompts' completions, "
            "generated in order; drop data.group_by_length"
        )
    if cfg.loss_chunk_tokens == 0:
        problems.append(
            "loss_chunk_tokens 0 with train_objective=grpo: the GRPO loss takes the chunked LM head; set "
            "loss_chunk_tokens > 0 (e.g. 1024)"
        )
    return problems + grpo_setting_problems(cfg.grpo, cfg.data.max_seq_length, layout)


def grpo_setting_problems(g: GRPOConfig, max_seq_length: int, layout: Layout) -> list[str]:
    """grpo.*: each setting in its range (TRL's rules where it has one), the step's completions whole groups, and
    the reward functions importable with TRL's call (data/rewards.py)."""
    problems = []
    if g.num_generations < 2:
        problems.append(
            f"grpo.num_generations {g.num_generations} must be >= 2: each completion's advantage is measured against "
            "the other completions of its prompt (TRL's rule); set grpo.num_generations=8 (TRL's default)"
        )
    elif layout.global_batch and layout.global_batch % g.num_generations:
        fits = [n for n in range(2, layout.global_batch + 1) if layout.global_batch % n == 0]
        problems.append(
            f"the global batch micro_batch_size {layout.micro_batch} x gradient_accumulation_steps "
            f"{layout.grad_accum} x data-parallel {layout.dp} = {layout.global_batch} is not a multiple of "
            f"grpo.num_generations {g.num_generations}: it is the step's completions, num_generations per prompt; "
            f"set gradient_accumulation_steps or micro_batch_size to make it a multiple of {g.num_generations}, or "
            f"grpo.num_generations to one of {fits[:12]}"
        )
    if g.max_completion_length < 1:
        problems.append(
            f"grpo.max_completion_length {g.max_completion_length} must be >= 1 (TRL's default: 512): the tokens "
            "generated per completion"
        )
    elif g.max_completion_length >= max_seq_length:
        problems.append(
            f"grpo.max_completion_length {g.max_completion_length} leaves no token of data.max_seq_length "
            f"{max_seq_length} for the prompt (its budget is max_seq_length - max_completion_length = "
            f"{max_seq_length - g.max_completion_length}): raise data.max_seq_length above "
            f"{g.max_completion_length}, or lower grpo.max_completion_length below {max_seq_length}"
        )
    for bad, line in (
        (not g.temperature > 0, f"grpo.temperature {g.temperature:g} must be > 0 (TRL's default: 1.0)"),
        (not 0 < g.top_p <= 1, f"grpo.top_p {g.top_p:g} must be in (0, 1] (1: off, TRL's default)"),
        (g.top_k < 0, f"grpo.top_k {g.top_k} must be >= 0 (0: off, TRL's default)"),
        (g.beta < 0, f"grpo.beta {g.beta:g} must be >= 0 (0: no KL penalty, TRL's default)"),
        (not g.epsilon > 0, f"grpo.epsilon {g.epsilon:g} must be > 0 (TRL's default: 0.2)"),
        (
            g.epsilon_high is not None and g.epsilon_high < 0,
            f"grpo.epsilon_high {g.epsilon_high} must be >= 0, or None (= grpo.epsilon, TRL's default)",
        ),
        (g.num_iterations < 1, f"grpo.num_iterations {g.num_iterations} must be >= 1 (TRL's default: 1)"),
        (
            g.generation_micro_batches < 0,
            f"grpo.generation_micro_batches {g.generation_micro_batches} must be >= 0 (0: one chunk of rows per "
            "pipeline stage)",
        ),
    ):
        if bad:
            problems.append(line)
    return problems + reward_function_problems(list(g.reward_funcs), g.reward_weights)


# How the losses other than the next-token one are normalised, for the loss_normalization rule below.
OBJECTIVE_LOSS = {
    "dpo": "DPO's loss is the mean over the global batch's pairs (TRL's)",
    "grpo": "GRPO's loss is normalised as grpo.loss_type says (TRL's)",
}


# Settings that act only in some configurations: (keys, whether they act in ``cfg``, why not and the fix: a string, or a
# function of ``cfg`` where the words name its values).
# A key set away from its default where it cannot act is refused before start: the user believes in a
# setting they would not get (QLoRA settings without peft.method=lora train the full model, or run out of
# memory, with no word).
INERT_RULES = (
    (
        tuple(f"peft.{f.name}" for f in fields(PeftConfig) if f.name != "method"),
        lambda cfg, layout: cfg.peft.method != "none",
        "LoRA settings, but LoRA is off (peft.method=none): add peft.method=lora, or drop them",
    ),
    (
        tuple(f"dpo.{f.name}" for f in fields(DPOConfig)),
        lambda cfg, layout: cfg.train_objective == "dpo",
        lambda cfg: (
            f"DPO settings, but train_objective is {cfg.train_objective}: use data=dpo (preference pairs, "
            "train_objective=dpo), or drop them"
        ),
    ),
    (
        tuple(f"grpo.{f.name}" for f in fields(GRPOConfig)),
        lambda cfg, layout: cfg.train_objective == "grpo",
        lambda cfg: (
            f"GRPO settings, but train_objective is {cfg.train_objective}: use data=grpo (prompts, "
            "train_objective=grpo), or drop them"
        ),
    ),
    (
        ("loss_normalization",),
        lambda cfg, layout: cfg.train_objective == "sft",
        lambda cfg: (
            f"normalises the next-token loss over label tokens; {OBJECTIVE_LOSS[cfg.train_objective]}: drop "
            "loss_normalization"
        ),
    ),
    (
        ("optim.min_lr",),
        lambda cfg, layout: cfg.optim.scheduler != "constant",
        "where linear and cosine decay end, but the constant schedule stays at optim.lr: set "
        "optim.scheduler=linear or cosine, or drop it",
    ),
    (
        ("model.tokenizer",),
        lambda cfg, layout: not cfg.model_name_or_path,
        "for training from scratch, but the tokenizer in model_name_or_path is the one used: drop model.tokenizer "
        "(or copy that tokenizer into the checkpoint)",
    ),
    (
        ("eval_steps",),
        lambda cfg, layout: bool(cfg.data.eval_file or cfg.data.eval_fraction or cfg.data.eval_sources),
        "evaluation needs eval data, and there is none: set data.eval_file, data.eval_fraction or data.eval_sources, "
        "or drop eval_steps",
    ),
    (
        ("resume_allow_changes",),
        lambda cfg, layout: cfg.resume != "never",
        "applies when a run is resumed, but resume=never never resumes: drop one of them",
    ),
)


# Harmless where they cannot act (a check or a report with nothing to do): one warning line each.
HARMLESS_RULES = (
    # data.group_by_length: one rule per reason it cannot act, exclusive, so that one line says the first (a layout
    # that feeds rows whole: its axis's own rule, harmless_settings in parallel.axes.AXES)
    (
        ("data.group_by_length",),
        lambda cfg, layout: layout.feeds_rows_whole or not default_packing(cfg.data),
        "groups rows of similar length, but packed rows are all data.max_seq_length long (it only reorders the "
        "samples): drop data.group_by_length, or set data.packing=false",
    ),
    (
        ("data.group_by_length",),
        lambda cfg, layout: cfg.data.pad_to_multiple_of > 0 or layout.feeds_rows_whole or default_packing(cfg.data),
        "groups rows of similar length so micro-batches are cut short, but data.pad_to_multiple_of=0 feeds every "
        "row whole (it only reorders the samples): set data.pad_to_multiple_of=8",
    ),
    (
        ("save_async",),
        lambda cfg, layout: bool(cfg.save_steps or cfg.save_every_minutes),
        "writes checkpoints in the background while training goes on, but with save_steps=0 and "
        "save_every_minutes=0 only the last step's is saved, and that one is written at once: set save_steps or "
        "save_every_minutes",
    ),
    (
        ("save_final",),
        lambda cfg, layout: bool(cfg.save_steps or cfg.save_every_minutes),
        "saves no checkpoint after the last step, and with save_steps=0 and save_every_minutes=0 none at all (a stop "
        "signal's aside): the trained weights are gone when the run ends; set save_steps, or drop save_final",
    ),
    ORDER_CHECK_RULE,
)


def inert_settings(cfg: TrainConfig, layout: Layout) -> tuple[list[str], list[str]]:
    """(problems, warnings): settings given a non-default value where they cannot take effect."""
    now, default = dataclasses.asdict(cfg), dataclasses.asdict(TrainConfig())
    out = []
    harmless = HARMLESS_RULES + tuple(rule for axis in AXES if axis.used(layout) for rule in axis.harmless_settings)
    for rules in (INERT_RULES, harmless):
        found = []
        for keys, acts, why in rules:
            given = [k for k in keys if plain(dotted(now, k)) != plain(dotted(default, k))]
            if given and not acts(cfg, layout):
                words = why(cfg) if callable(why) else why
                found.append(", ".join(f"{k}={plain(dotted(now, k))}" for k in given) + f": {words}")
        out.append(found)
    return out[0], out[1]


def noop_value_problems(cfg: TrainConfig) -> list[str]:
    """Values that would make the whole run train nothing, refused rather than run for nothing (peft.alpha 0:
    models.lora_rules.peft_problems)."""
    problems = []
    if cfg.optim.lr == 0:  # below 0: resolve's range line
        problems.append(
            f"optim.lr {cfg.optim.lr} trains nothing: set optim.lr > 0 (to load and evaluate without training, "
            "set max_steps=0)"
        )
    return problems


def gemma4_settings(cfg: TrainConfig) -> dict:
    """The settings models/family_gemma4.py's training rules read, by their TrainConfig names."""
    return {  # the parallel axes' own: in their plans (parallel/)
        "peft.method": cfg.peft.method,
        "compile": cfg.compile,
        "train_objective": cfg.train_objective,
        "activation_checkpoint_interval": cfg.activation_checkpoint_interval,
    }
