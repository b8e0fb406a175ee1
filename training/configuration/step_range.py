"""The steps a run really takes, and every setting that names steps checked against them.

The run's last step is ``max_steps``, or ``num_epochs`` passes over the training data, whichever comes first
(``planned_steps``); a resumed run starts after its checkpoint's step. Where ``max_steps`` alone decides, the range
is known from the config and training.configuration.validate.resolve checks it (so the preflight does too); where
``num_epochs`` decides it is known once the data is: train.py checks it after building the data (training/loop.py's
plan_steps), and the preflight where the data is already tokenized (a scripts/prepare_data.py directory or the tokenized
cache), else against ``max_steps`` as a bound. A setting that cannot act in the range is refused with the range and how
it was derived (``step_setting_problems``); one that still does its work at the run's end is a warning."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from data.cache import DataSettings, cache_key
from data.sources import is_prepared
from data.tokenize_settings import data_settings, tokenizer_dir
from models.files.pipeline_dir import TAG_PATTERN
from training.configuration.schema import TrainConfig
from training.data_setup import cache_dir, split_eval, training_sources


@dataclass(frozen=True)
class StepRange:
    """Steps ``start + 1 .. last`` of a run; ``how``: where ``last`` comes from, in the config's words; ``key``:
    the setting that decides it (the one to raise)."""

    start: int
    last: int
    how: str
    key: str

    def line(self) -> str:
        """The preflight's line: the steps to train and where the count comes from."""
        resumed = f", resumed after step {self.start}" if self.start else ""
        return f"steps {self.start + 1}..{self.last} ({self.how}{resumed})"


def resumed_step(resume_tag: str | None) -> int:
    """The step a run resumed from ``resume_tag`` continues after (0: a new run)."""
    match = TAG_PATTERN.match(resume_tag or "")
    return int(match.group(1)) if match else 0


def planned_steps(cfg: TrainConfig, dp: int, train_samples: int, start: int = 0) -> tuple[StepRange, float]:
    """(the run's steps, steps per epoch) for ``train_samples`` training samples over ``dp`` data-parallel groups:
    ``max_steps``, or ``num_epochs`` passes, whichever is first."""
    micro, accum = cfg.micro_batch_size, cfg.gradient_accumulation_steps
    per_epoch = train_samples // dp // micro / accum  # micro-batches per data-parallel rank, per optimizer step
    if not cfg.num_epochs:
        return by_max_steps(cfg, start), per_epoch
    epoch_steps = math.ceil(cfg.num_epochs * per_epoch)
    if cfg.max_steps and cfg.max_steps <= epoch_steps:
        how = f"max_steps {cfg.max_steps}, before num_epochs {cfg.num_epochs:g} ends at step {epoch_steps}"
        return StepRange(start, cfg.max_steps, how, "max_steps"), per_epoch
    how = (
        f"step {epoch_steps} = num_epochs {cfg.num_epochs:g} x {per_epoch:g} steps per epoch ({train_samples} training "
        f"samples / dp {dp} / micro_batch_size {micro} / gradient_accumulation_steps {accum}), rounded up"
    )
    return StepRange(start, epoch_steps, how, "num_epochs"), per_epoch


def by_max_steps(cfg: TrainConfig, start: int = 0) -> StepRange:
    """The steps when ``max_steps`` alone decides (num_epochs 0)."""
    return StepRange(start, cfg.max_steps, f"max_steps {cfg.max_steps}", "max_steps")


def bounded_by_max_steps(cfg: TrainConfig, start: int, unknown: str) -> StepRange:
    """``max_steps`` as the bound of a run whose ``num_epochs`` may end it sooner, its data not yet counted."""
    how = f"max_steps {cfg.max_steps}, or sooner where num_epochs {cfg.num_epochs:g} ends: {unknown}"
    return StepRange(start, cfg.max_steps, how, "max_steps")


_COUNTED: dict[tuple, int] = {}  # (path, settings, tokenizer, cache) -> samples: the files are hashed once


def _tokenized_samples(path: str, settings: DataSettings, tokenizer: str | None, cache: str) -> int | None:
    """Samples of ``path`` as train.py reads it, where that is known without tokenizing: a prepared directory's,
    or a tokenized cache entry's count (the cache key hashes the files, as train.py's start does)."""
    key = (path, settings, tokenizer, cache)
    if key not in _COUNTED:
        if is_prepared(path):
            meta = os.path.join(path, "meta.json")
        else:
            meta = os.path.join(cache, cache_key(path, settings, tokenizer), "meta.json")
            if not os.path.isfile(meta):
                return None
        with open(meta) as f:
            rows = json.load(f)["num_samples"]
        _COUNTED[key] = rows // 2 if settings.format == "dpo" else rows  # a preference pair is two rows
    return _COUNTED[key]


def known_train_samples(cfg: TrainConfig, model_config) -> tuple[int | None, str]:
    """(training samples, "") where every training source is already tokenized; else (None, why not)."""
    total = 0
    for _, path, _, fmt in training_sources(cfg):
        try:
            samples = _tokenized_samples(
                path, data_settings(cfg, model_config, fmt), tokenizer_dir(cfg) or None, cache_dir(cfg)
            )
        except (OSError, ValueError, KeyError):
            samples = None
        if samples is None:
            return (
                None,
                f"{path} is not tokenized yet: train.py counts its samples at start and checks the settings naming "
                "steps then",
            )
        total += samples
    if cfg.data.eval_fraction > 0:
        total -= len(split_eval(total, cfg.data.eval_fraction)[1])
    return total, ""


def known_steps(cfg: TrainConfig, dp: int, resume_tag: str | None, model_config, count_data: bool) -> StepRange | None:
    """The run's steps as far as they are known before the data is built: from ``max_steps`` alone; with
    ``num_epochs``, only where ``count_data`` (the preflight): from the tokenized data, else ``max_steps`` as a bound.
    None where nothing is known yet (train.py checks once its data is built)."""
    if cfg.max_steps < 0 or cfg.num_epochs < 0 or dp < 1:  # out of range: resolve says so
        return None
    start = resumed_step(resume_tag)
    if not cfg.num_epochs:
        return by_max_steps(cfg, start)
    if not count_data or model_config is None:
        return None
    samples, unknown = known_train_samples(cfg, model_config)
    if samples is not None:
        return planned_steps(cfg, dp, samples, start)[0]
    return bounded_by_max_steps(cfg, start, unknown) if cfg.max_steps else None


def step_setting_problems(cfg: TrainConfig, steps: StepRange) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the settings that name steps, in the run's ``steps``. A problem: the setting cannot
    do what it says in this run (refused before training, with the fix); a warning: it still does its work at the
    run's end, or in the steps a resumed run has left."""
    start, last, how = steps.start, steps.last, steps.how
    problems, warnings = [], []
    if start > last:
        return [
            f"output_dir {cfg.output_dir} holds the checkpoint of step {start}, after the run's last step ({how}): "
            f"nothing would train; raise {steps.key} to continue it, or choose another output_dir"
        ], []
    if last == 0 or start == last:  # nothing to train: the start-up line says so (training/observation/announce.py)
        if cfg.profile_steps and last == 0:
            problems.append(
                f"profile_steps {list(cfg.profile_steps)} with max_steps=0: no step is trained; drop profile_steps"
            )
        return problems, warnings
    raise_key = f"raise {steps.key}"
    if len(cfg.profile_steps) == 2 and cfg.profile_steps[0] <= cfg.profile_steps[1]:  # else: profile_problems
        first, end = cfg.profile_steps
        window = list(cfg.profile_steps)
        if end > last:
            problems.append(
                f"profile_steps {window} ends after the run's last step ({how}): set last <= {last}, or {raise_key}"
            )
        elif end <= start:
            warnings.append(f"profile_steps {window}: the run resumes after step {start}, nothing to profile")
        elif first <= start:
            warnings.append(
                f"profile_steps {window}: the run resumes after step {start}, steps {start + 1}..{end} are profiled"
            )
    # training/observation/memory_census.py's StepPeak: the run's second step
    if cfg.count_step_memory and last < start + 2:
        if start:
            warnings.append(
                f"count_step_memory=true measures a run's second step, and resumed after step {start} "
                f"this run trains one ({how}): no step peak is reported"
            )
        else:
            problems.append(
                f"count_step_memory=true measures the run's second step, and the run has {last} ({how}): "
                f"{raise_key} to 2 steps or more, or drop count_step_memory"
            )
    warnings += warmup_warnings(cfg, steps)
    has_evals = cfg.data.eval_file or cfg.data.eval_fraction or cfg.data.eval_sources  # else an inert-setting rule
    for key, value, what, still in (
        ("eval_steps", cfg.eval_steps, "evaluation", "the run evaluates at its end only" if has_evals else ""),
        ("save_steps", cfg.save_steps, "checkpoint", save_at_end(cfg)),
        (
            "log_steps",
            cfg.log_steps,
            "progress line",
            "progress lines for its first and last steps only (metrics.jsonl gets every step)",
        ),
    ):
        if value > last and still:
            warnings.append(f"{key} {value} > the run's last step ({how}): no periodic {what}; {still}")
    return problems, warnings


def save_at_end(cfg: TrainConfig) -> str:
    """What saves a run whose save_steps never comes, in the words of save_steps' warning."""
    if cfg.save_every_minutes:
        return f"checkpoints every {cfg.save_every_minutes:g} minutes (save_every_minutes)" + (
            " and at the end" if cfg.save_final else ""
        )
    if cfg.save_final:
        return "the run saves its last step's checkpoint only"
    return "and with save_final=false the run saves no checkpoint: set save_steps <= the last step, or drop save_final"


def warmup_warnings(cfg: TrainConfig, steps: StepRange) -> list[str]:
    """optim.warmup_steps against the run's last step (training/optim.py's lr_lambda: warm-up to optim.lr, then a
    linear or cosine decay that reaches optim.min_lr at the last step, from the step after warm-up). Warnings: the
    run still follows its schedule, cut short (a smoke run of a long run's settings)."""
    o, last, how = cfg.optim, steps.last, steps.how
    warmup = o.warmup_steps
    if warmup > last:
        return [
            f"optim.warmup_steps {warmup} > the run's last step ({how}): the learning rate never reaches optim.lr "
            f"{o.lr:g} (it ends at {last / warmup:.0%} of it); for the full rate set optim.warmup_steps <= {last}, or "
            f"raise {steps.key}"
        ]
    if o.scheduler != "constant" and warmup and warmup > last - 2:
        return [
            f"optim.scheduler={o.scheduler} with optim.warmup_steps {warmup} and the run's last step ({how}): warm-up "
            f"takes the whole run, the decay to optim.min_lr never runs; for a decay set optim.warmup_steps <= "
            f"{max(0, last - 2)}, or raise {steps.key}"
        ]
    return []
