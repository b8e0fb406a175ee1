"""Weighted mixtures of sources (data.sources, data/mixture.py) give each source its share, deterministically and
resumably, in one process and through train.py.

Each epoch draws every source its weight's share, evenly through the epoch, each source from its own seeded stream;
deterministic and resumable; refusals before start; through train.py (pipe 2 x data 2): tokens per source in
metrics.jsonl, an eval loss per eval source, and a run resumed mid-epoch continues exactly."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest

from data.mixture import MixtureDataset, interleave, shares
from data.order_guard import fingerprint
from data.sampling import MicroBatchIterator
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from tests.test_data import varied_blocks, write_jsonl
from training.configuration.schema import SourceConfig


def test_shares_are_exact_and_spread_evenly():
    assert shares(10, [3, 1]).tolist() == [8, 2] and shares(10, [1, 1, 1]).tolist() == [4, 3, 3]
    counts = shares(1000, [0.7, 0.2, 0.1])
    where = interleave(counts)
    assert counts.tolist() == [700, 200, 100] and np.bincount(where).tolist() == [700, 200, 100]
    for window in (10, 37, 100):  # any window holds each source in proportion, within 2 samples
        for start in range(0, 1000 - window, 13):
            got = np.bincount(where[start : start + window], minlength=3)
            assert np.all(np.abs(got - window * counts / 1000) <= 2), (start, window, got)


@pytest.fixture
def two_sources(tmp_path, tokenizer_dir):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = varied_blocks(tmp_path / "a", tokenizer_dir, [5 + i % 9 for i in range(40)])  # 40 rows
    b = varied_blocks(tmp_path / "b", tokenizer_dir, [20 + i % 7 for i in range(10)])  # 10 rows, upweighted
    return MixtureDataset([a, b], [1.0, 1.0], ["a", "b"])


def test_each_source_gets_its_share_from_its_own_stream(two_sources):
    mix = two_sources
    assert len(mix) == 50 and mix.counts.tolist() == [25, 25]
    epochs = [mix.epoch_order(e, seed=3, shuffle=True) for e in range(2)]
    for order in epochs:
        assert (order < 40).sum() == 25 and (order >= 40).sum() == 25  # the weights, not the sizes
    a_rows = np.concatenate([o[o < 40] for o in epochs])  # 50 draws from a's 40 rows: one pass, then 10 more
    assert sorted(a_rows[:40].tolist()) == list(range(40)) and len(set(a_rows[40:].tolist())) == 10
    assert a_rows[25:40].tolist() == [r for r in epochs[1] if r < 40][:15]  # epoch 1 continues where 0 stopped
    b_rows = np.concatenate([o[o >= 40] for o in epochs]) - 40  # 10 rows drawn 50 times: 5 passes, reshuffled
    passes = b_rows.reshape(5, 10)
    assert all(sorted(p.tolist()) == list(range(10)) for p in passes) and len({tuple(p) for p in passes}) > 1
    assert np.array_equal(mix.epoch_order(1, 3, True), epochs[1]) and not np.array_equal(
        mix.epoch_order(1, 4, True), epochs[1]
    )
    # Shuffled within runs of 64 (here the whole epoch of 50): data-parallel ranks each see both sources.
    assert {int(r >= 40) for r in epochs[0][1::2]} == {0, 1} and {int(r >= 40) for r in epochs[0][0::2]} == {0, 1}
    assert mix[45]["source"] == 1 and mix[3]["source"] == 0


def test_a_mixture_resumes_mid_epoch(two_sources):
    reference = [fingerprint(b) for b in itertools.islice(MicroBatchIterator(two_sources, 2, 1, 2, True, 5), 30)]
    it = MicroBatchIterator(two_sources, 2, 1, 2, True, 5)
    seen = [fingerprint(b) for b in itertools.islice(it, 7)]
    resumed = MicroBatchIterator(two_sources, 2, 1, 2, True, 5)
    resumed.load_state_dict(json.loads(json.dumps(it.state_dict())))
    assert seen + [fingerprint(b) for b in itertools.islice(resumed, 23)] == reference  # crosses epochs
    assert set(it.tokens_by_source) == {0, 1} and sum(it.tokens_by_source.values()) == it.tokens_read


def test_every_mixture_problem_is_named_before_start(good, tmp_path):  # noqa: F811
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"input_ids": [1, 2, 3]}])
    (tmp_path / "empty.jsonl").write_text("")
    other = write_jsonl(tmp_path / "other.jsonl", [{"ids": [1, 2, 3]}])
    sources = [
        SourceConfig(path=ok, weight=0.0),
        SourceConfig(path=str(tmp_path / "empty.jsonl")),
        SourceConfig(path=other, name="ok"),
        SourceConfig(path=str(tmp_path / "missing.jsonl")),
        SourceConfig(),
    ]
    data = dataclasses.replace(good.data, sources=sources, eval_sources=[SourceConfig(path=ok)], eval_fraction=0.1)
    problems = problems_of(dataclasses.replace(good, data=data), 4)
    for expected in (
        "data.train_file and data.sources are both set: use one",
        "data.sources[0] (ok.jsonl) has weight 0.0: weights must be > 0",
        f"data.sources[1] {tmp_path}/empty.jsonl: file is empty",
        f"data.sources[2] {other}: data.format=tokens reads a 'input_ids' column, and its first record's keys are ids",
        f"data.sources[3] {tmp_path}/missing.jsonl does not exist",
        "data.sources[4] has no path",
        "data.eval_sources with data.eval_file or data.eval_fraction: use one way",
        "data.eval_fraction splits data.train_file, not a mixture",
    ):
        assert expected in problems, (expected, problems)
    names = [SourceConfig(path=ok), SourceConfig(path=ok)]
    twice = dataclasses.replace(good, data=dataclasses.replace(good.data, train_file="", sources=names))
    assert "data.sources: the name(s) ok.jsonl name several sources: give each a name" in problems_of(twice, 4)


@pytest.mark.multirank
def test_train_py_draws_a_mixture_reports_each_source_and_resumes_exactly(tmp_path, tiny_ckpt):
    from models.tiny import write_random_tokens
    from tests.support.parity import parity_args
    from tests.support.ranks import train_run
    from tests.support.runs import read_metrics

    for name, n, seed in (("code", 24, 1), ("web", 40, 2), ("eval_code", 8, 3), ("eval_web", 8, 4)):
        write_random_tokens(str(tmp_path / f"{name}.jsonl"), n, 32, vocab_size=512, seed=seed)
    mixture = f"[{{path:{tmp_path}/code.jsonl,weight:3,name:code}},{{path:{tmp_path}/web.jsonl,weight:1,name:web}}]"
    evals = f"[{{path:{tmp_path}/eval_code.jsonl,name:code}},{{path:{tmp_path}/eval_web.jsonl,name:web}}]"
    common = {
        "num_stages": 2,
        "gradient_accumulation_steps": 2,
        "loss_chunk_tokens": 16,
        "data.train_file": "",
        "data.sources": mixture,
        "data.eval_sources": evals,
        "data.shuffle": "true",
        "eval_steps": 4,
        "save_steps": 4,
    }

    def launch(name: str, steps: int):
        args = parity_args(tiny_ckpt, "", str(tmp_path / name), 32, 2, steps, {}, **common)  # tiny_ckpt read only
        return train_run(tmp_path, name, 4, args).stdout

    log = launch("straight", 8)  # one epoch of the mixture: 8 steps of 8 samples
    assert "data: a mixture of code (weight 3: 48 of each epoch's 64 samples, 24 rows), web (weight 1: 16" in log
    train = read_metrics(str(tmp_path / "straight"))
    assert all(sum(m["source_tokens"].values()) == m["tokens"] for m in train)
    assert sum(m["source_tokens"]["code"] for m in train) == 3 * sum(m["source_tokens"]["web"] for m in train)  # epoch
    evals = read_metrics(str(tmp_path / "straight"), kind="eval")
    assert [(e["step"], e["source"]) for e in evals] == [(4, "code"), (4, "web"), (8, "code"), (8, "web")]
    # Step 4's checkpoint resumed: steps 5-8 and the final evals as the straight run.
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed", ignore=shutil.ignore_patterns("global_step8"))
    (tmp_path / "resumed" / "latest").write_text("global_step4")
    launch("resumed", 8)
    again = {m["step"]: m["loss"] for m in read_metrics(str(tmp_path / "resumed"))}
    assert [again[s] for s in (5, 6, 7, 8)] == [m["loss"] for m in train[4:]]
    final = [e["eval_loss"] for e in read_metrics(str(tmp_path / "resumed"), kind="eval") if e["step"] == 8]
    assert final == [e["eval_loss"] for e in evals if e["step"] == 8]


def test_a_shuffled_mixture_keeps_the_proportions_in_every_run_of_64():
    mix = MixtureDataset([list(range(500)), list(range(300)), list(range(200))], [0.7, 0.2, 0.1], ["a", "b", "c"])
    order = mix.epoch_order(0, seed=1, shuffle=True)
    source = np.searchsorted(mix.offsets, order, side="right") - 1
    assert sorted(order.tolist())[:5] != order.tolist()[:5] and np.bincount(source).tolist() == [700, 200, 100]
    for start in range(0, 1000 - 64, 64):
        got = np.bincount(source[start : start + 64], minlength=3)
        assert np.all(np.abs(got - 64 * mix.counts / 1000) <= 1.5), (start, got)
