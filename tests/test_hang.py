"""Hung and slow ranks are named: a hang ends the job with every rank's stacks (exit 78), a straggler each step.

Hangs (training/resilience/hang.py): a rank asleep inside a step (tests/sleepy_rank.py) makes every rank
dump its stacks after hang_timeout_s, rank 0 print where each rank is, and the job exit with code 78. A rank that
is merely slow (0.3 s more per forward) is named in every step's straggler view (training/observation/straggler.py); the
same run saves on save_every_minutes's clock too."""

from __future__ import annotations

import os
import time

import pytest

from models.tiny import write_random_tokens
from tests.support.parity import SEQ, train_args
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics
from training.resilience import hang
from training.resilience.hang import HANG_EXIT_CODE, HangWatch, where

DUMP = """rank 2, step 3, 5 s into it
Thread 0x00007f (most recent call first):
  File "/x/threading.py", line 320 in wait

Current thread 0x00007e (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2799 in recv
  File "/x/deepspeed/runtime/pipe/p2p.py", line 80 in recv
  File "/x/deepspeed/runtime/pipe/engine.py", line 1100 in _exec_recv_activations
  File "/x/train.py", line 700 in <module>
"""


def test_where_names_the_instruction_and_the_collective():
    assert where(DUMP) == "pipeline instruction _exec_recv_activations, in recv, at distributed_c10d.py:2799 recv"


def test_the_bound_follows_the_median_step_with_a_floor(tmp_path):
    watch = HangWatch(str(tmp_path), 0, 1, 0.0, "wait")
    assert watch.timeout_s() == 600.0  # no step yet: the floor
    watch.steps = [40.0, 50.0, 45.0]
    assert watch.timeout_s() == 900.0  # 20 x the median
    assert HangWatch(str(tmp_path), 0, 1, 7.0, "wait").timeout_s() == 7.0


def test_a_hung_step_dumps_this_ranks_stacks(tmp_path, monkeypatch):
    monkeypatch.setattr(hang, "WATCH_EVERY_S", 0.02)
    watch = HangWatch(str(tmp_path), 1, 2, 0.1, "wait")  # rank 1: writes its file, no report
    watch.step_started(4)
    path, deadline = tmp_path / "hang" / "rank1.txt", time.time() + 10  # written 0.1 s into the step
    while not (path.exists() and "test_a_hung_step" in path.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    dump = path.read_text()
    assert dump.startswith("rank 1, step 4, ") and "test_a_hung_step_dumps_this_ranks_stacks" in dump


def sleepy_run(tmp_path, tiny_ckpt, monkeypatch, rank: int, seconds: str | None, **overrides):
    """tests/sleepy_rank.py on 4 ranks, pipe 2 x data 2: rank ``rank`` sleeps ``seconds`` (default an hour) in each
    forward pass from step 2 on. Returns (the process, its output_dir, seconds it took)."""
    data = str(tmp_path / "train.jsonl")
    write_random_tokens(data, 64, SEQ, vocab_size=512)
    monkeypatch.setenv("SLEEPY_RANK", str(rank))
    monkeypatch.setenv("SLEEPY_STEP", "2")
    if seconds is not None:
        monkeypatch.setenv("SLEEPY_SECONDS", seconds)
    out = tmp_path / "run"
    args = train_args(tiny_ckpt, data, str(out), num_stages=2, gradient_accumulation_steps=2, **overrides)
    start = time.time()
    proc = run_deepspeed(4, "tests/sleepy_rank.py", args, str(tmp_path / "run.log"))
    return proc, out, time.time() - start


@pytest.mark.multirank
def test_a_rank_asleep_in_a_step_is_named(tmp_path, tiny_ckpt, monkeypatch):
    proc, out, took = sleepy_run(
        tmp_path, tiny_ckpt, monkeypatch, 3, None, ds_config="zero1", hang_timeout_s=5, max_steps=4
    )
    assert proc.returncode == HANG_EXIT_CODE, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(os.listdir(out / "hang")) == [f"rank{r}.txt" for r in range(4)] + ["report.txt"]
    report = proc.stderr[proc.stderr.index("train.py: error: step 2 has run") :]
    print(f"[hang] job ended {took:.0f} s after start:\n{report}")
    assert "past hang_timeout_s (5 s): every rank's Python stacks are in" in report
    lines = dict(line.strip().split(": ", 1) for line in report.splitlines() if line.startswith("  rank "))
    assert lines["rank 3"].startswith("pipeline instruction _exec_schedule, at sleepy_rank.py:")  # its forward
    assert lines["rank 3"].endswith(" asleep_in_forward") and " in " not in lines["rank 3"]
    assert all(" in " in lines[f"rank {r}"] for r in range(3)), lines  # the others wait in a collective
    assert report.count("train.py: error:") == 1 and f"exiting with code {HANG_EXIT_CODE}" in report
    assert "SIGTERM" not in proc.stderr and "Error executing job" not in proc.stderr  # the others end quietly
    assert report.startswith(open(out / "hang" / "report.txt").read().strip())  # the file holds what was printed


@pytest.mark.multirank
def test_a_slow_rank_is_named_the_straggler(tmp_path, tiny_ckpt, monkeypatch):
    proc, out, _ = sleepy_run(
        tmp_path,
        tiny_ckpt,
        monkeypatch,
        2,
        "0.3",
        max_steps=3,
        save_every_minutes=0.005,  # 0.3 s: step 2 (0.6 s slower) is past it
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    compute = [m["compute_s"] for m in read_metrics(str(out))]
    print(f"[straggler] {compute}")
    assert [c["slowest_rank"] for c in compute[1:]] == [2, 2]  # two forwards per step: 0.6 s more
    assert all(c["slowest"] > 0.6 > c["median"] for c in compute[1:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("step 3/3"))
    assert " | slowest rank 2 0." in line and " s compute (median 0." in line
    # save_every_minutes on the same run: rank 0's clock, agreed by all ranks, saved after step 2 as well
    assert f"saved checkpoint global_step2 in {out}, 0.005 minutes since the last (" in proc.stdout
    assert {"global_step2", "global_step3"} <= set(os.listdir(out))
