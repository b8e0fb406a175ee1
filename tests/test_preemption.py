"""A preempted job (a stop signal) saves after its step and resumes bit for bit, and checkpoints follow the clock too
(training/resilience/preemption.py).

Fast tier: a rank's handlers (first signal: stop after the step; a second signal or the grace running out:
exit 76 at once; after the checkpoint: exit 75), the per-step agreement (signalled ranks, rank 0's
save_every_minutes clock) on a one-rank process group, the config's ranges.

Multi-rank (pipe 2 x data 2, fp32, ZeRO-1, 6 steps, eval every 2): SIGUSR1 sent to one rank (rank 3) while
step 2 runs; the job saves after that step on every rank and exits with code 75; the same command resumes
and finishes; every step's loss and grad norm, every eval loss and every trained weight equal an
uninterrupted run's bit for bit; the stopped run's W&B run (offline), one across the stop and the resume,
holds every record of its metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from models.files.pipeline_dir import load_layer_file, read_tag
from models.tiny import write_random_tokens
from tests.support import REPO
from tests.support.parity import SEQ, train_args
from tests.support.ranks import finish_deepspeed, run_deepspeed, start_deepspeed, wait_for_first_step
from tests.support.runs import read_metrics
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from tests.test_tracking import assert_holds_metrics
from training.resilience.preemption import PREEMPTED_EXIT_CODE, UNSAVED_EXIT_CODE, StopAndSave


def handler_process(script: str) -> subprocess.CompletedProcess:
    code = "import os, signal, time\nfrom training.resilience.preemption import StopAndSave\n" + script
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.e2e
def test_a_second_signal_exits_at_once_without_a_checkpoint():
    proc = handler_process(
        "s = StopAndSave(0, 30, 2, 'cpu')\nos.kill(os.getpid(), signal.SIGUSR1)\nassert s.received == 'SIGUSR1'\n"
        "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(20)\n"
    )
    assert proc.returncode == UNSAVED_EXIT_CODE, proc.stderr
    assert proc.stderr.strip() == (
        "[train] rank 2: a second SIGTERM arrived before the checkpoint was complete: exiting now without a "
        "checkpoint of this step (exit code 76); resume=auto continues from the last complete checkpoint"
    )


@pytest.mark.e2e
def test_no_checkpoint_within_the_grace_exits_and_a_signal_after_it_keeps_75():
    proc = handler_process("s = StopAndSave(0, 0.5, 0, 'cpu')\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(20)\n")
    assert proc.returncode == UNSAVED_EXIT_CODE
    assert "no checkpoint within preempt_grace_s=0.5 of SIGTERM" in proc.stderr
    proc = handler_process(
        "s = StopAndSave(0, 0.5, 0, 'cpu')\nos.kill(os.getpid(), signal.SIGTERM)\ns.saved()\ntime.sleep(1)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(20)\n"
    )
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr  # saved: the timer cancelled, the code is 75


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_ranks_agree_on_signals_and_on_rank_0s_clock(one_rank_group):
    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stopper = StopAndSave(save_every_minutes=0.002, grace_s=30, rank=0, device="cpu")  # 0.12 s
        assert stopper.after_step(0.25) == ([], False, [0.25], 0)
        time.sleep(0.2)
        assert stopper.after_step(writing=True) == ([], True, [0.0], 1)  # 1 rank's checkpoint writer still busy
        stopper.snapshot_taken()  # save_async: the clock starts again at the host copy
        assert stopper.after_step() == ([], False, [0.0], 0)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stopper.after_step() == ([0], False, [0.0], 0)
        stopper.snapshot_taken()
        assert stopper.timer is not None  # a copy still being written meets no deadline
        stopper.saved()  # cancels the grace timer
        assert stopper.timer is None
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        signal.signal(signal.SIGINT, previous[2])  # StopAndSave takes Ctrl-C too
    assert StopAndSave(save_every_minutes=0, grace_s=30, rank=0, device="cpu").after_step() == ([], False, [0.0], 0)
    signal.signal(signal.SIGUSR1, previous[0])
    signal.signal(signal.SIGTERM, previous[1])
    signal.signal(signal.SIGINT, previous[2])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(save_every_minutes=-1.0), "save_every_minutes -1.0 is out of range: set save_every_minutes >= 0"),
        (dict(preempt_grace_s=0.0), "preempt_grace_s 0.0 is out of range: set preempt_grace_s >= 1"),
    ],
)
def test_bad_values_are_refused(good, change, message):  # noqa: F811
    assert message in problems_of(dataclasses.replace(good, **change), world_size=4)


# -- multi-rank ---------------------------------------------------------------------------------------


STEPS6 = 6


def weights(out: str) -> dict[str, torch.Tensor]:
    tag_dir = os.path.join(out, read_tag(out))
    files = sorted(f for f in os.listdir(tag_dir) if f.startswith("layer_"))
    return {f"{f}:{k}": v for f in files for k, v in load_layer_file(os.path.join(tag_dir, f)).items()}


@pytest.mark.multirank
def test_a_signalled_rank_stops_the_job_saved_and_the_resume_is_exact(tmp_path, tiny_ckpt, monkeypatch):
    """With eval every 2 steps and, on the stopped run, W&B (offline): its one run, across the stop and the
    resume, holds every record of metrics.jsonl."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = str(tmp_path / "train.jsonl")
    write_random_tokens(data, 64, SEQ, vocab_size=512)

    def args(name: str, **extra) -> list[str]:
        return train_args(
            tiny_ckpt,  # read only
            data,
            str(tmp_path / name),
            num_stages=2,
            gradient_accumulation_steps=2,
            ds_config="zero1",
            max_steps=STEPS6,
            eval_steps=2,
            **{"data.eval_fraction": 0.125},
            **extra,
        )

    straight = run_deepspeed(4, "train.py", args("straight"), str(tmp_path / "straight.log"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    # The ranks forked as the launcher starts them: the signal goes to one of them, and the job ends with their
    # status (that the real launcher passes 75 on: tests/test_run_failures.py's SIGUSR1 run).
    job = start_deepspeed(4, "train.py", args("stopped", **{"monitor.wandb": "true"}))
    wait_for_first_step(tmp_path / "stopped")
    job.ranks[3].send_signal(signal.SIGUSR1)
    signalled = time.time()
    stopped = finish_deepspeed(job, str(tmp_path / "stopped.log"))
    took, out = time.time() - signalled, stopped.stdout + stopped.stderr
    assert stopped.returncode == PREEMPTED_EXIT_CODE, out[-3000:]
    stopped_at = len(read_metrics(str(tmp_path / "stopped")))
    assert 2 <= stopped_at < STEPS6, stopped_at
    line = next(x for x in out.splitlines() if "stop signal" in x)
    assert f"stop signal (SIGTERM/SIGUSR1) on rank(s) [3]: checkpoint global_step{stopped_at} saved after step " in line
    assert f"exiting with code {PREEMPTED_EXIT_CODE}. The same command (resume=auto) continues from it exactly." in line
    assert read_tag(str(tmp_path / "stopped")) == f"global_step{stopped_at}"
    print(f"[preemption] signal -> exit {took:.1f} s (stopped after step {stopped_at}): {line}")

    resumed = run_deepspeed(4, "train.py", args("stopped", **{"monitor.wandb": "true"}), str(tmp_path / "resumed.log"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "stopped"))
    assert [m["step"] for m in b] == list(range(1, STEPS6 + 1))
    assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]
    wa, wb = weights(str(tmp_path / "straight")), weights(str(tmp_path / "stopped"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    evals = read_metrics(str(tmp_path / "stopped"), "eval")
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in read_metrics(str(tmp_path / "straight"), "eval")]
    assert_holds_metrics(str(tmp_path / "stopped"), b + evals)
