"""Settings that name steps are checked against the steps the run really takes (training/configuration/step_range.py).

The run's last step comes from max_steps, or from num_epochs and the data; a resumed run starts after its
checkpoint's step. A setting that cannot act in that range (a profile window past the end, count_step_memory in a
one-step run) is refused before training, naming the key, the range and how it was derived; one that still works at
the end (eval_steps, save_steps, log_steps past the last step; a warm-up longer than the run) is one warning; the data
order check covers a resumed run's first steps as a new run's.
Fast: the rules given a step range, resolve (max_steps decides), the preflight on tokenized data (num_epochs
decides). The multi-rank test: train.py refuses the num_epochs case after building its data, before training.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import data.order_guard
from data.cache import build_or_reuse
from data.tokenize_settings import data_settings
from models.families import load_config
from tests.support.ranks import run_deepspeed
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from training.configuration.preflight import check
from training.configuration.schema import DataConfig, OptimConfig, TrainConfig
from training.configuration.step_range import StepRange, planned_steps, step_setting_problems
from training.configuration.validate import resolve

# The case: 2240 samples / dp 2 / micro 2 / grad_acc 4 = 140 steps per epoch; 0.05 epochs = 7 steps.
EPOCHS = dict(max_steps=0, num_epochs=0.05, micro_batch_size=2, gradient_accumulation_steps=4)
SAMPLES = 2240
EPOCHS_HOW = (
    "step 7 = num_epochs 0.05 x 140 steps per epoch (2240 training samples / dp 2 / micro_batch_size 2 / "
    "gradient_accumulation_steps 4), rounded up"
)
PROFILE_PAST_EPOCHS = (
    f"profile_steps [50, 51] ends after the run's last step ({EPOCHS_HOW}): set last <= 7, or raise num_epochs"
)


def test_the_epochs_steps_refuse_a_profile_window_after_them():
    steps, per_epoch = planned_steps(TrainConfig(**EPOCHS), 2, SAMPLES)
    assert (steps.start, steps.last, steps.key, per_epoch) == (0, 7, "num_epochs", 140)
    problems, _ = step_setting_problems(TrainConfig(**EPOCHS, profile_steps=[50, 51]), steps)
    assert problems == [PROFILE_PAST_EPOCHS]
    assert step_setting_problems(TrainConfig(**EPOCHS, profile_steps=[6, 7]), steps) == ([], [])


def test_max_steps_first_of_the_two_is_named():
    steps, _ = planned_steps(TrainConfig(**{**EPOCHS, "max_steps": 5}), 2, SAMPLES)
    assert (steps.last, steps.key) == (5, "max_steps")
    assert steps.how == "max_steps 5, before num_epochs 0.05 ends at step 7"


def test_settings_a_run_too_short_cannot_act_on_are_refused(good):  # noqa: F811
    """max_steps decides: resolve refuses them (the preflight runs resolve)."""
    text = problems_of(dataclasses.replace(good, max_steps=1, count_step_memory=True), 4)
    assert (
        "count_step_memory=true measures the run's second step, and the run has 1 (max_steps 1): raise max_steps to "
        "2 steps or more, or drop count_step_memory"
    ) in text


def test_settings_that_still_act_at_the_end_are_one_warning_each(good):  # noqa: F811
    data = dataclasses.replace(good.data, eval_fraction=0.1)
    cfg = dataclasses.replace(good, max_steps=20, eval_steps=50, save_steps=30, log_steps=25, data=data)
    assert resolve(cfg, 4).warnings == [
        "eval_steps 50 > the run's last step (max_steps 20): no periodic evaluation; the run evaluates at its end only",
        "save_steps 30 > the run's last step (max_steps 20): no periodic checkpoint; the run saves its last step's "
        "checkpoint only",
        "log_steps 25 > the run's last step (max_steps 20): no periodic progress line; progress lines for its first "
        "and last steps only (metrics.jsonl gets every step)",
    ]
    assert resolve(dataclasses.replace(good, max_steps=10, optim=OptimConfig(warmup_steps=40)), 4).warnings == [
        "optim.warmup_steps 40 > the run's last step (max_steps 10): the learning rate never reaches optim.lr 0.0003 "
        "(it ends at 25% of it); for the full rate set optim.warmup_steps <= 10, or raise max_steps"
    ]
    cosine = OptimConfig(warmup_steps=9, scheduler="cosine", min_lr=1e-5)
    assert resolve(dataclasses.replace(good, max_steps=10, optim=cosine), 4).warnings == [
        "optim.scheduler=cosine with optim.warmup_steps 9 and the run's last step (max_steps 10): warm-up takes the "
        "whole run, the decay to optim.min_lr never runs; for a decay set optim.warmup_steps <= 8, or raise max_steps"
    ]
    assert not resolve(
        dataclasses.replace(good, max_steps=10, optim=dataclasses.replace(cosine, warmup_steps=8)), 4
    ).warnings
    _, warnings = step_setting_problems(
        dataclasses.replace(cfg, save_final=False), StepRange(0, 20, "max_steps 20", "")
    )
    assert warnings[1].endswith(
        "and with save_final=false the run saves no checkpoint: set save_steps <= the last step, or drop save_final"
    )


def test_a_resumed_run_is_checked_from_its_checkpoints_step():
    resumed = StepRange(50, 100, "max_steps 100", "max_steps")
    assert step_setting_problems(TrainConfig(profile_steps=[2, 3]), resumed) == (
        [],
        ["profile_steps [2, 3]: the run resumes after step 50, nothing to profile"],
    )
    assert step_setting_problems(TrainConfig(profile_steps=[49, 52]), resumed)[1] == [
        "profile_steps [49, 52]: the run resumes after step 50, steps 51..52 are profiled"
    ]
    last_one = StepRange(99, 100, "max_steps 100", "max_steps")
    assert step_setting_problems(TrainConfig(count_step_memory=True), last_one) == (
        [],
        [
            "count_step_memory=true measures a run's second step, and resumed after step 99 this run trains one "
            "(max_steps 100): no step peak is reported"
        ],
    )
    behind = StepRange(50, 30, "max_steps 30", "max_steps")
    assert step_setting_problems(TrainConfig(output_dir="out"), behind) == (
        [
            "output_dir out holds the checkpoint of step 50, after the run's last step (max_steps 30): nothing would "
            "train; raise max_steps to continue it, or choose another output_dir"
        ],
        [],
    )
    done = StepRange(100, 100, "max_steps 100", "max_steps")  # finished, started again: the start-up line says so
    assert step_setting_problems(TrainConfig(profile_steps=[2, 3], count_step_memory=True), done) == ([], [])


def test_a_resumed_run_checks_the_data_order_of_its_own_first_steps(monkeypatch):
    """data.order_check_steps counts the steps of this run: one resumed after step 50 compares steps 51..52."""
    compared = []

    def gather(out: list, mine) -> None:  # the first stage's fingerprints, and the last stage's, the same
        compared.append(mine)
        out[:] = [mine, (0, 1, 1, mine[3])]

    monkeypatch.setattr(data.order_guard.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(data.order_guard.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(data.order_guard.dist, "all_gather_object", gather)
    iterator = data.order_guard.FingerprintingIterator(iter(()))
    guard = data.order_guard.OrderGuard(iterator, check_steps=2, num_stages=2, pipeline=0, stage=0)
    guard.resumed_after(50)
    for step in range(51, 55):
        guard.after_step(step)
    assert len(compared) == 2 and guard.last_step == 52 and not iterator.active


def epochs_run(tmp_path, model: str) -> tuple:
    """(the training file, the overrides) of a run of 7 steps decided by num_epochs, at dp 2."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input_ids": [1, 2, 3, i % 500 + 4]}) + "\n" for i in range(SAMPLES)))
    return train, [
        f"model_name_or_path={model}",
        f"data.train_file={train}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_seq_length=8",
        "num_stages=2",
        f"output_dir={tmp_path / 'out'}",
        "max_steps=0",
        "num_epochs=0.05",
        "micro_batch_size=2",
        "gradient_accumulation_steps=4",
    ]


def test_the_preflight_checks_the_epochs_steps_of_tokenized_data(tmp_path, tiny_hf):
    train, overrides = epochs_run(tmp_path, tiny_hf)
    lines = check(4, [*overrides, "profile_steps=[50,51]"])  # not tokenized yet: train.py checks at start
    assert (
        f"steps: num_epochs 0.05 of the training data; {train} is not tokenized yet: train.py counts its samples at "
        "start and checks the settings naming steps then"
    ) in lines
    cfg = TrainConfig(data=DataConfig(max_seq_length=8))
    build_or_reuse(str(train), data_settings(cfg, load_config(tiny_hf)), tiny_hf, str(tmp_path / "cache"), print)
    assert f"steps 1..7 ({EPOCHS_HOW})" in check(4, overrides)
    with pytest.raises(ValueError) as err:
        check(4, [*overrides, "profile_steps=[50,51]"])
    assert str(err.value) == f"invalid configuration:\n  {PROFILE_PAST_EPOCHS}"


# ------------------------------------------------------------------------------------------------ multi-rank


@pytest.mark.multirank
def test_train_py_refuses_a_profile_window_after_the_epochs_steps_before_training(tmp_path, tiny_ckpt):
    _, overrides = epochs_run(tmp_path, tiny_ckpt)
    args = [*overrides, "precision=fp32", "profile_steps=[50,51]"]
    proc = run_deepspeed(4, "train.py", args, str(tmp_path / "log.txt"))
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr.count("train.py: error: invalid configuration:") == 1, proc.stderr[-3000:]
    assert f"train.py: error: invalid configuration:\n  {PROFILE_PAST_EPOCHS}" in proc.stderr
    assert "step 1/" not in proc.stdout and not os.path.exists(tmp_path / "out" / "metrics.jsonl")
