"""Resuming output_dir's checkpoint: what changed since it was saved (its train_config.yaml against this
config), which changes are taken, refused or need ``resume_allow_changes``, whether its optimizer states
must be read per parameter (another layout), and whether its tensors still fit this model."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import yaml

from models.families import UnsupportedModelError, load_config
from models.files.pipeline_dir import LATEST_FILE, latest_tag
from models.llama_pipe import build_specs, expected_state_shapes, layer_file_name, spec_layout
from training.checkpoints.reshard import SavedOptimizerState
from training.configuration.model_source import SHAPE_FIELDS
from training.configuration.schema import ResumeChanges, TrainConfig, dotted, leaf_keys, plain

# How each setting may differ from the checkpoint being resumed (its train_config.yaml). Keys not listed
# are "free": they take effect as given (step counts, cadences, outputs, timeouts, eval data).
#   layout: taken as given. Where the optimizer states' layout changed (RESHARD_KEYS, or the world size)
#           they are read per parameter (training/checkpoints/reshard.py); the data position counts samples, so
#           the run continues at the next unseen one; a changed global batch is said at start.
#   optim:  refused unless resume_allow_changes has "optim"; then applied exactly from the next step
#           (train.py sets them on the restored optimizer and recomputes the schedule).
#   data:   refused unless resume_allow_changes has "data"; then the new sample stream continues at the
#           saved epoch and micro-batch position.
#   model:  refused unless resume_allow_changes has "model"; the checkpoint's weights are used either way
#           (shapes that differ are refused separately).
RESUME_KEY_CLASSES = {
    "layout": (
        "num_stages",
        "tensor_parallel",
        "sequence_parallel",
        "expert_parallel",
        "pipeline_schedule",
        "partition_method",
        "ds_config",
        "precision",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "adamw_impl",
    ),
    "optim": (
        "optim.lr",
        "optim.betas",
        "optim.eps",
        "optim.weight_decay",
        "optim.max_grad_norm",
        "optim.scheduler",
        "optim.warmup_steps",
        "optim.min_lr",
        "loss_normalization",
        "dpo.beta",
        "dpo.loss_type",
        "dpo.label_smoothing",
        # every GRPO setting: what is generated, how it is scored and what the loss makes of it, from the next step
        "grpo.num_generations",
        "grpo.max_completion_length",
        "grpo.temperature",
        "grpo.top_p",
        "grpo.top_k",
        "grpo.beta",
        "grpo.epsilon",
        "grpo.epsilon_high",
        "grpo.loss_type",
        "grpo.scale_rewards",
        "grpo.num_iterations",
        "grpo.mask_truncated_completions",
        "grpo.reward_funcs",
        "grpo.reward_weights",
        "grpo.generation_micro_batches",
        "moe.bias_update_speed",  # the router biases move at the new speed from the next step
        "moe.sequence_balance_coef",  # the loss's balance term at the new weight from the next step
    ),
    "data": (
        "data.train_file",
        "data.sources",
        "data.text_field",
        "data.prompt_field",
        "data.response_field",
        "data.messages_field",
        "data.input_ids_field",
        "data.chosen_field",
        "data.rejected_field",
        "train_objective",
        "data.format",
        "data.max_seq_length",
        "data.packing",
        "data.shuffle",
        "data.eval_fraction",
        "data.skip_bad_lines",
        "data.group_by_length",
        "seed",
    ),
    "model": ("model_name_or_path", "model.name", "model.architecture", "model.tokenizer"),
}


ACCEPTABLE_CHANGES = ("optim", "data", "model")


# Layout keys that change how optimizer states are cut into files: with any of them (or the world size)
# changed, resume reads the saved states per parameter instead of DeepSpeed's own load.
RESHARD_KEYS = (
    "num_stages",
    "tensor_parallel",
    "expert_parallel",
    "pipeline_schedule",
    "partition_method",
    "ds_config",
    "precision",
    "adamw_impl",  # torch's AdamW and DeepSpeed's FusedAdam: each one's states set per parameter, not loaded whole
)


RESUME_EFFECT = {
    "optim": "apply them exactly from the next step (the schedule recomputed from the new settings)",
    "data": "continue the new sample stream at the saved epoch and micro-batch position",
    "model": "resume the checkpoint's weights under the new model settings",
}


def find_resume(cfg: TrainConfig, model_config) -> tuple[Optional[str], ResumeChanges, list[str]]:
    """(tag to resume from, settings changed since it was saved, problems) for output_dir's ``latest``
    checkpoint, if any."""
    tag = latest_tag(cfg.output_dir)
    if tag is None:
        return None, ResumeChanges(), []
    if cfg.resume == "never":
        return (
            None,
            ResumeChanges(),
            [
                f"output_dir {cfg.output_dir} already holds a checkpoint ({tag}): set resume=auto to continue "
                f"it, or choose another output_dir"
            ],
        )
    problems = []
    if not os.path.isdir(os.path.join(cfg.output_dir, tag)):
        problems.append(f"{os.path.join(cfg.output_dir, LATEST_FILE)} names {tag}, which is not in {cfg.output_dir}")
    saved = os.path.join(cfg.output_dir, "config.json")
    if model_config is not None and os.path.isfile(saved):
        try:
            old = load_config(cfg.output_dir)
        except UnsupportedModelError as e:
            return None, ResumeChanges(), problems + [str(e)]
        problems += [
            f"output_dir {cfg.output_dir} holds a checkpoint with {f}={getattr(old, f)}, this model has "
            f"{getattr(model_config, f)}: choose another output_dir"
            for f in SHAPE_FIELDS
            if getattr(old, f) != getattr(model_config, f)
        ]
        problems += [
            f"output_dir {cfg.output_dir}/{tag}: {line}" for line in tensor_shape_differences(old, model_config)
        ]
    changes, change_problems = resume_changes(cfg, tag)
    return tag, changes, problems + change_problems


def resume_changes(cfg: TrainConfig, tag: str) -> tuple[ResumeChanges, list[str]]:
    """(what changed since ``output_dir/tag`` was saved, problems) from its train_config.yaml."""
    path = os.path.join(cfg.output_dir, tag, "train_config.yaml")
    if not os.path.isfile(path):
        return ResumeChanges(), []  # not written by train.py (a converted checkpoint has no optimizer states)
    with open(path) as f:
        saved = yaml.safe_load(f) or {}
    now = dataclasses.asdict(cfg)
    changes, classed = ResumeChanges(), {k for keys in RESUME_KEY_CLASSES.values() for k in keys}
    free = tuple(sorted(set(leaf_keys(now)) - classed - {"resume_allow_changes"}))  # the knob itself is no change
    for cls, keys in [*RESUME_KEY_CLASSES.items(), ("free", free)]:
        for key in keys:
            try:
                old = dotted(saved, key)
            except (KeyError, TypeError):
                continue  # a checkpoint from a version without this key (or without its section)
            new = plain(dotted(now, key))
            if old != new and not (isinstance(new, (list, tuple)) and list(old or []) == list(new)):
                changes.changed.setdefault(cls, {})[key] = (old, new)
    problems = []
    where = f"{cfg.output_dir}/{tag}"
    for cls in ACCEPTABLE_CHANGES:
        if changes.changed.get(cls) and cls not in cfg.resume_allow_changes:
            problems.append(
                f"{where} was saved with other {cls} settings: {', '.join(changes.lines(cls))}: set the saved "
                f"values, or add {cls} to resume_allow_changes (resume_allow_changes=[{cls}]) to "
                f"{RESUME_EFFECT[cls]}"
            )
    return changes, problems


def reshard_reason(
    cfg: TrainConfig, tag: str, changes: ResumeChanges, world_size: int, model_config
) -> tuple[str, list[str]]:
    """(why ``output_dir/tag``'s optimizer states must be read per parameter, "" when DeepSpeed's own load
    applies; problems of those states: files of some rank missing, an unreadable or unsafe file), before
    any process group starts."""
    path = os.path.join(cfg.output_dir, tag, "trainer_state_rank00000.json")
    if not os.path.isfile(path):
        return "", []  # not written by train.py: read_trainer_state says so once the ranks run
    with open(path) as f:
        saved = json.load(f)
    if saved.get("portable"):
        reasons = ["portable, written by convert2ckpt.py --reshard"]
    else:
        layout = changes.changed.get("layout", {})
        reasons = [f"{key} {old!r} -> {new!r}" for key, (old, new) in layout.items() if key in RESHARD_KEYS]
        if saved["world_size"] != world_size:
            reasons.append(f"world size {saved['world_size']} -> {world_size}")
        if cfg.expert_parallel > 1 and not reasons:  # DeepSpeed's load would give every rank all the experts' states
            reasons.append(f"expert_parallel {cfg.expert_parallel}: each rank reads its own experts' states")
    if not reasons:
        return "", []
    saved_states = SavedOptimizerState(os.path.join(cfg.output_dir, tag))
    found = saved_states.problems + (saved_states.missing_layer_files(model_config) if model_config else [])
    # not "on this layout": a missing or damaged file is the checkpoint's, whatever the layout (each line says which)
    problems = [f"cannot resume {cfg.output_dir}/{tag}: {p}" for p in found]
    return ", ".join(reasons), problems


def tensor_shape_differences(old, new, limit: int = 3) -> list[str]:
    """Layer files whose tensors would change shape between two configs: file, tensor, both shapes.

    Compared spec by spec when both have the same layer list (same layer count and tying); otherwise
    the layer files do not even correspond and the config fields say it all.
    """
    if old.num_hidden_layers != new.num_hidden_layers or old.tie_word_embeddings != new.tie_word_embeddings:
        return []
    old_specs, new_specs, lines = build_specs(old), build_specs(new), []
    for info in spec_layout(new):
        if info.owns_file:
            a, b = expected_state_shapes(old_specs[info.index]), expected_state_shapes(new_specs[info.index])
            lines += [
                f"{layer_file_name(info.index)} tensor {k!r} has shape {tuple(a[k])} in the checkpoint, "
                f"{tuple(b[k])} in this model"
                for k in b
                if k in a and tuple(a[k]) != tuple(b[k])
            ]
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more tensors of other shapes"]
    return lines
