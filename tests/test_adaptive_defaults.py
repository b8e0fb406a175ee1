"""Defaults adapt to the feature the user set (a value the user set is refused instead), and degenerate data or a
setting that cannot act is said, not trained without a word.

Unit tier: the defaults DualPipeV and sequence parallelism adapt (and the values a user set, refused instead), the
eval split of a preference entry sharing its reference, identical pairs counted and refused or warned about, and
data.group_by_length's one warning per reason it cannot act. One multi-rank run (pipe 2, DualPipeV set alone, DPO
with an eval split, some identical pairs, group_by_length) shows each of them in a real run's log, and the final
checkpoint written before the final eval.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from data.preference_pairs import PairBlocks, PreferenceRenderer, identical_pairs_report
from data.sources import SourceStats
from models.tiny import write_preference_pairs
from parallel.layout import Layout
from parallel.sequence_parallel import SequenceParallelPlan
from tests.support.parity import parity_args
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics
from tests.test_config import good  # noqa: F401 (a fixture)
from training.configuration.overrides import given_keys
from training.configuration.schema import ConfigError, TrainConfig
from training.configuration.validate import adapt_defaults, inert_settings, resolve

# ---------- class 4: a default the user did not set adapts to the feature they did set ----------


def test_dualpipev_alone_adapts_gradient_accumulation_and_the_pad_multiple(good):  # noqa: F811
    cfg = dataclasses.replace(good, pipeline_schedule="dualpipev", gradient_accumulation_steps=1)
    resolved = resolve(cfg, world_size=4, given={"pipeline_schedule", "num_stages"})
    assert resolved.adapted == [
        "gradient_accumulation_steps 1 -> 4 (the default; DualPipeV keeps 2 x num_stages = 4 in flight): set "
        "gradient_accumulation_steps to choose",
        "data.pad_to_multiple_of 8 -> 0 (the default; DualPipeV sends activation shapes once: rows fed whole): set "
        "data.pad_to_multiple_of to choose",
    ]
    assert resolved.layout.grad_accum == 4 and resolved.cfg.data.pad_to_multiple_of == 0


def test_values_the_user_set_are_refused_not_adapted(good):  # noqa: F811
    cfg = dataclasses.replace(good, pipeline_schedule="dualpipev", gradient_accumulation_steps=1)
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size=4, given=given_keys(["gradient_accumulation_steps=1", "++data.pad_to_multiple_of=8"]))
    assert "needs gradient_accumulation_steps >= 2 x num_stages = 4" in str(err.value)
    assert "pipeline_schedule=dualpipev with data.pad_to_multiple_of 8" in str(err.value)


def test_given_keys_are_the_overrides_keys():
    overrides = ["num_stages=2", "+data.x=1", "++data.pad_to_multiple_of=8", "~foo=1", "data=dpo", "--cfg"]
    assert given_keys(overrides) == {"num_stages", "data.x", "data.pad_to_multiple_of", "foo", "data"}


@pytest.mark.parametrize(
    "sp, pad, seq",
    [(16, 16, 512), (4, 8, 512), (3, 24, 510)],  # 8 is a multiple of 4: nothing changes
)
def test_sequence_parallel_alone_adapts_the_pad_multiple_and_the_row_length(sp, pad, seq):
    cfg = TrainConfig(sequence_parallel=sp)
    lines = adapt_defaults(cfg, given={"sequence_parallel"})
    assert (cfg.data.pad_to_multiple_of, cfg.data.max_seq_length) == (pad, seq)
    assert len(lines) == (pad != 8) + (seq != 512)
    if sp == 16:
        assert lines == [
            "data.pad_to_multiple_of 8 -> 16 (the default; a multiple of sequence_parallel 16): set "
            "data.pad_to_multiple_of to choose"
        ]
    assert SequenceParallelPlan.defaults(TrainConfig(sequence_parallel=sp), lambda key: True) == []


def test_a_set_pad_multiple_stays_and_is_refused_with_sequence_parallel():
    cfg = TrainConfig(sequence_parallel=16)
    assert adapt_defaults(cfg, given={"data.pad_to_multiple_of"}) == []
    found = SequenceParallelPlan.problems(cfg, None, Layout.of(cfg, 16, {}))
    assert any("data.pad_to_multiple_of 8 is not a multiple of sequence_parallel 16" in p for p in found), found


# ---------- class 8: settings that do nothing, and pairs that teach nothing ----------


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(pipeline_schedule="dualpipev", num_stages=2), "but DualPipeV feeds every row whole"),
        (dict(packing=True), "but packed rows are all data.max_seq_length long"),
        (dict(pad_to_multiple_of=0), "but data.pad_to_multiple_of=0 feeds every row whole"),
        (dict(), None),
    ],
)
def test_group_by_length_where_it_cannot_act_is_said_once(change, reason):
    cfg = TrainConfig(pipeline_schedule=change.pop("pipeline_schedule", "1f1b"), num_stages=change.pop("num_stages", 1))
    cfg.data.group_by_length = True
    for key, value in change.items():
        setattr(cfg.data, key, value)
    problems, warnings = inert_settings(cfg, Layout.of(cfg, 2, {}))
    lines = [w for w in warnings if w.startswith("data.group_by_length")]
    assert problems == [] and len(lines) == (reason is not None), lines
    assert reason is None or reason in lines[0]


def test_identical_pairs_are_counted_when_tokenized(tokenizer_dir):
    from transformers import AutoTokenizer

    stats = SourceStats()
    renderer = PreferenceRenderer(AutoTokenizer.from_pretrained(tokenizer_dir), 64, stats)
    renderer.pair("f:1", {"prompt": "Say", "chosen": "the same", "rejected": "the same"})
    renderer.pair("f:2", {"prompt": "Say", "chosen": "this", "rejected": "that"})
    assert stats.identical_pairs == 1
    # completions that part only past max_seq_length are the same rows once truncated (keep_start)
    long = " ".join(["word"] * 80)
    renderer.pair("f:3", {"prompt": "Say", "chosen": long + " this", "rejected": long + " that"})
    assert stats.identical_pairs == 2 and stats.truncated == 2


def test_identical_pairs_are_refused_when_all_and_warned_about_when_some():
    error, warning = identical_pairs_report("p.jsonl", 8, 8)
    assert warning == "" and error == (
        "p.jsonl: 8 of 8 preference pairs have chosen == rejected (the same tokens): DPO learns nothing from them "
        "(loss log 2, gradient 0); check the data's chosen/rejected"
    )
    error, warning = identical_pairs_report("p.jsonl", 3, 8)
    assert error == "" and warning.startswith("p.jsonl: 3 of 8 preference pairs have chosen == rejected")
    assert identical_pairs_report("p.jsonl", 0, 8) == ("", "")


# ---------- class 1: the eval split of a preference entry ----------


class _Rows:
    """Stands in for an entry's TokenBlocks: 2 rows per pair."""

    entry = "cache/entry"

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        import torch

        one = torch.ones(4, dtype=torch.long)
        return {"input_ids": one * i, "labels": one, "position_ids": one, "num_tokens": 4}


def test_the_eval_split_of_a_preference_entry_shares_its_reference():
    """data.eval_fraction cuts train and eval from one entry before the reference pass attaches the table to the
    training split: the eval split must see it (it did not: a RuntimeError at the first eval lost the run)."""
    whole = PairBlocks(_Rows())
    train, held_out = whole.subset(np.array([0, 1, 3])), whole.subset(np.array([2]))
    table = np.arange(8, dtype=np.float64).reshape(4, 2)
    train.attach_reference(table)
    assert held_out[0]["reference"].tolist() == [4.0, 5.0] and "reference" in train[2]


# ---------- one multi-rank run showing classes 1, 4 and 8 ----------

PAIRS, IDENTICAL, SEQ = 32, 4, 64


@pytest.mark.multirank
def test_a_dpo_run_with_an_eval_split_and_dualpipev_alone(tmp_path, tiny_ckpt):
    """pipe 2 (2 ranks), `pipeline_schedule=dualpipev` with nothing else it needs, `data=dpo` with
    `data.eval_fraction=0.25`, 4 of 32 pairs identical, data.group_by_length=true: the defaults adapt (one line
    each), group_by_length and the identical pairs are said once, the eval runs on pairs with their reference,
    and the final checkpoint is saved before the final eval."""
    ckpt, data, out = tiny_ckpt, str(tmp_path / "pairs.jsonl"), str(tmp_path / "run")  # tiny_ckpt read only
    write_preference_pairs(data, PAIRS, seed=3)
    with open(data) as f:
        rows = [json.loads(line) for line in f]
    for row in rows[:IDENTICAL]:
        row["rejected"] = row["chosen"]
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    args = ["data=dpo", *parity_args(ckpt, data, out, SEQ, 1, 2, {"lr": 1e-3}, num_stages=2)]
    args += ["pipeline_schedule=dualpipev", "data.eval_fraction=0.25", "data.group_by_length=true"]
    proc = run_deepspeed(2, "train.py", args, str(tmp_path / "run.log"))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[train] adapted: gradient_accumulation_steps 1 -> 4 (the default; DualPipeV keeps" in log
    assert "[train] adapted: data.pad_to_multiple_of 8 -> 0 (the default; DualPipeV sends" in log
    assert (
        log.count(
            "data.group_by_length=True: groups rows of similar length so micro-batches are cut short, "
            "but DualPipeV feeds every row whole"
        )
        == 1
    )
    assert log.count(f"[data] warning: {data}: {IDENTICAL} of {PAIRS} preference pairs have chosen == rejected") == 1
    assert "every row fed whole\n" in log  # no cure offered that this run refuses (packing with DPO, a pad multiple)
    evals = read_metrics(out, "eval")
    assert [e["step"] for e in evals] == [2] and math.isfinite(evals[0]["eval_loss"])
    assert "eval_rewards/margins" in evals[0]
    assert os.path.isfile(os.path.join(out, "latest"))
    saved, evaluated = log.index("saved checkpoint global_step2"), log.index("eval @ step 2")
    assert saved < evaluated, "the final checkpoint must be written before the final eval"
