"""Stop signals sent twice, too early or to the wrong process, Ctrl-C, and a hang watchdog set too tight: each ends the
job cleanly, said once (training/resilience/preemption.py, training/resilience/hang.py).

Fast tier: hang_timeout_s too small to mean a hang is refused; a hang exit waits for the checkpoint save in
progress; a signal during start-up (or SIGINT) exits at once with code 76, said once; a rank whose job is
already exiting (``output_dir/.stopping``) exits quietly, on a signal or on a failed collective; rank 0's
output_dir lock is released before such an exit.

Multi-rank (tests/sleepy_rank.py: rank 3 sleeps in each forward from step 2, so a step lasts seconds): SIGTERM
twice to one rank mid-step -> exit 76, one line, no tracebacks from the other ranks; with the real ``deepspeed``
launcher, SIGUSR1 to the ``deepspeed`` command itself (which dies of it) -> its ranks notice, save after the step
in flight and exit, none left running; the same command resumes and finishes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from models.files.pipeline_dir import read_tag
from models.tiny import write_random_tokens
from tests.support import REPO
from tests.support.parity import SEQ, train_args
from tests.support.ranks import child_env, finish_deepspeed, run_deepspeed, start_deepspeed, wait_for_first_step
from tests.support.runs import read_metrics
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from tools.launch import deepspeed_command, remove_shm_leftovers
from training.resilience.hang import HANG_EXIT_CODE
from training.resilience.ports import free_port
from training.resilience.preemption import UNSAVED_EXIT_CODE


def python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("value", [0.001, 4.9])
def test_a_hang_timeout_too_small_to_mean_a_hang_is_refused(good, value):  # noqa: F811
    assert (
        f"hang_timeout_s {value:g} is too small to mean a hang: set hang_timeout_s >= 5 (seconds one training step "
        "may run), or 0 = automatic (20 x the median step so far, at least 600 s)"
    ) in problems_of(dataclasses.replace(good, hang_timeout_s=value), world_size=4)


@pytest.mark.e2e
def test_a_hang_exit_waits_for_the_save_in_progress(tmp_path):
    """The watchdog fires ~0.5-1 s into the step, during a 3 s save: it exits once the save is complete."""
    start = time.time()
    proc = python(
        "import time\nfrom training.resilience.hang import HangWatch\n"
        f"w = HangWatch({str(tmp_path)!r}, 0, 1, 0.5, 'exit')\nw.step_started(3)\n"
        "with w.saving():\n"
        f"    time.sleep(3)\n    open({str(tmp_path / 'saved')!r}, 'w').write('complete')\n"
        "time.sleep(30)\n"
    )
    took = time.time() - start
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert "train.py: error: step 3 has run" in proc.stderr
    assert (tmp_path / "saved").read_text() == "complete" and took < 25, took


EARLY = (
    "import os, signal, sys, time\nfrom training.resilience import preemption\n"
    "preemption.stop_at_once_on_signals({out!r}, {rank}, lambda: open({out!r} + '/released', 'w').close())\n"
)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM", "SIGINT"])
def test_a_signal_during_start_up_exits_at_once_said_once(tmp_path, name):
    proc = python(EARLY.format(out=str(tmp_path), rank=2) + f"os.kill(os.getpid(), signal.{name})\ntime.sleep(20)\n")
    assert proc.returncode == UNSAVED_EXIT_CODE, proc.stderr
    said = "SIGINT (Ctrl-C)" if name == "SIGINT" else name
    assert proc.stderr.strip() == (
        f"[train] rank 2: {said} during start-up, before the first step: exiting now, nothing trained yet to save "
        "(exit code 76); resume=auto continues from the last complete checkpoint"
    )
    assert os.readlink(tmp_path / ".stopping") == "76" and (tmp_path / "released").exists()


@pytest.mark.e2e
def test_the_peers_of_a_rank_that_exited_at_once_are_quiet(tmp_path):
    (tmp_path / ".stopping").symlink_to("76")  # a rank of the job exited at once (the test above)
    # a peer of the job, signalled too (or by the launcher ending it): quiet, same code
    proc = python(EARLY.format(out=str(tmp_path), rank=0) + "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(20)\n")
    assert (proc.returncode, proc.stderr) == (UNSAVED_EXIT_CODE, "")
    # a peer failing in a collective with the rank gone: no traceback
    proc = python(
        EARLY.format(out=str(tmp_path), rank=1)
        + "try:\n    raise RuntimeError('Connection closed by peer')\nexcept Exception:\n"
        "    preemption.exit_if_exiting()\n    raise\n"
    )
    assert (proc.returncode, proc.stderr) == (UNSAVED_EXIT_CODE, "")
    # the next job in that output_dir: rank 0 removes the marker before any rank can exit at once
    from training.resilience.preemption import clear_stale_marker

    clear_stale_marker(str(tmp_path))
    assert not os.path.lexists(tmp_path / ".stopping")


@pytest.mark.e2e
def test_ctrl_c_in_the_loop_exits_at_once(tmp_path):
    proc = python(
        "import os, signal, time\nfrom training.resilience.preemption import StopAndSave\n"
        "s = StopAndSave(0, 30, 1, 'cpu')\n"
        "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(20)\n"
    )
    assert proc.returncode == UNSAVED_EXIT_CODE
    assert proc.stderr.startswith("[train] rank 1: SIGINT (Ctrl-C): exiting now without a checkpoint of this step")


# -- multi-rank, the real launcher ----------------------------------------------------------------------


STEPS6 = 6


def sleepy_args(tmp_path, out: str) -> list[str]:
    return train_args(
        str(tmp_path / "ckpt"),
        str(tmp_path / "train.jsonl"),
        str(tmp_path / out),
        num_stages=2,
        gradient_accumulation_steps=2,
        ds_config="zero1",
        max_steps=STEPS6,
    )


def sleepy_env(seconds: str) -> dict:
    """tests/sleepy_rank.py's settings: rank 3 ``seconds`` asleep per forward from step 2."""
    return {"SLEEPY_RANK": "3", "SLEEPY_STEP": "2", "SLEEPY_SECONDS": seconds}


def into_step_2(output_dir) -> None:
    """Wait until step 1 is logged, then a moment more: rank 3 is asleep in its forward of step 2."""
    wait_for_first_step(output_dir)
    time.sleep(0.5)


LAUNCH_PORTS: list[int] = []


@pytest.fixture(autouse=True)
def leftovers_removed():
    yield
    while LAUNCH_PORTS:
        remove_shm_leftovers(LAUNCH_PORTS.pop())


def sleepy_launch(tmp_path, out: str, seconds: str, **popen):
    """The real ``deepspeed --num_gpus 4 tests/sleepy_rank.py`` (train.py, ``sleepy_env(seconds)``) as a Popen;
    returns (the launcher, its args, the ranks) once rank 3 is asleep in step 2. Ranks that exit on a signal leave
    their /dev/shm segments: removed by the job's port when the test ends (``leftovers_removed``)."""
    args = sleepy_args(tmp_path, out)
    env = {**child_env(), **sleepy_env(seconds)}
    port = free_port()
    LAUNCH_PORTS.append(port)
    cmd = deepspeed_command(4, "tests/sleepy_rank.py", args, port)
    launcher = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    into_step_2(tmp_path / out)
    ranks = [
        p for p in psutil.Process(launcher.pid).children(recursive=True) if "--local_rank=" in " ".join(p.cmdline())
    ]
    assert len(ranks) == 4
    return launcher, args, ranks


@pytest.mark.multirank
def test_signals_to_the_wrong_process_or_twice(tmp_path, tiny_ckpt):
    write_random_tokens(str(tmp_path / "train.jsonl"), 64, SEQ, vocab_size=512)
    (tmp_path / "ckpt").symlink_to(tiny_ckpt)  # read only

    # 1. SIGTERM twice to one rank before the checkpoint: 76, said once; the other ranks end without tracebacks
    # (ranks started directly: a rank that fails ends the others, as the launcher does, test 2 runs the launcher)
    job = start_deepspeed(4, "tests/sleepy_rank.py", sleepy_args(tmp_path, "twice"), sleepy_env("60"))
    into_step_2(tmp_path / "twice")
    job.ranks[3].send_signal(signal.SIGTERM)
    time.sleep(0.5)
    job.ranks[3].send_signal(signal.SIGTERM)
    signalled = time.time()
    proc = finish_deepspeed(job, str(tmp_path / "twice.log"))
    took, out = time.time() - signalled, proc.stdout + proc.stderr
    assert proc.returncode == UNSAVED_EXIT_CODE, out[-3000:]
    said = [x for x in out.splitlines() if "exiting now" in x]
    print(f"[signals] second SIGTERM -> exit {proc.returncode} in {took:.1f} s: {said}")
    assert said == [
        "[train] rank 3: a second SIGTERM arrived before the checkpoint was complete: exiting now without a "
        "checkpoint of this step (exit code 76); resume=auto continues from the last complete checkpoint"
    ]
    assert "Traceback" not in out and "Error executing job" not in out, out[-5000:]
    assert not (tmp_path / "twice" / "latest").exists()

    # 2. SIGUSR1 to the `deepspeed` command: it dies of it (138 in a shell); its ranks save after the step in
    # flight and exit, none left running; the same command resumes and finishes
    launcher, args, ranks = sleepy_launch(tmp_path, "launcher", "1")
    launch_py = psutil.Process(launcher.pid).children()[0]
    launcher.send_signal(signal.SIGUSR1)
    signalled = time.time()
    out, _ = launcher.communicate(timeout=300)
    gone, alive = psutil.wait_procs([*ranks, launch_py], timeout=60)
    took = time.time() - signalled
    assert launcher.returncode == -signal.SIGUSR1 and not alive, (alive, out[-3000:])
    stopped_at = len(read_metrics(str(tmp_path / "launcher")))
    assert 2 <= stopped_at < STEPS6, stopped_at
    assert read_tag(str(tmp_path / "launcher")) == f"global_step{stopped_at}"
    said = [x for x in out.splitlines() if "DeepSpeed launcher" in x or "stop signal" in x]
    print(f"[signals] SIGUSR1 to deepspeed -> ranks gone {took:.1f} s later:\n" + "\n".join(said))
    assert len(said) == 2 and said[0].startswith("[train] the DeepSpeed launcher (pid ")
    assert f"checkpoint global_step{stopped_at} saved after step {stopped_at} of {STEPS6}" in said[1]
    assert "Traceback" not in out, out[-5000:]
    resumed = run_deepspeed(4, "train.py", args, str(tmp_path / "resumed.log"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(str(tmp_path / "launcher"))] == list(range(1, STEPS6 + 1))


@pytest.mark.multirank
def test_ctrl_c_in_the_terminal_of_a_launch(tmp_path, tiny_ckpt):
    """SIGINT to every process of the launch (its own process group, as a terminal's Ctrl-C): the ranks exit at
    once with 76, said once; the only traceback is DeepSpeed's runner's own KeyboardInterrupt."""
    write_random_tokens(str(tmp_path / "train.jsonl"), 64, SEQ, vocab_size=512)
    (tmp_path / "ckpt").symlink_to(tiny_ckpt)  # read only
    launcher, _, ranks = sleepy_launch(tmp_path, "ctrl_c", "60", start_new_session=True)
    os.killpg(launcher.pid, signal.SIGINT)
    out, _ = launcher.communicate(timeout=120)
    gone, alive = psutil.wait_procs(ranks, timeout=60)
    said = [x for x in out.splitlines() if "exiting now" in x]
    print(f"[signals] Ctrl-C -> deepspeed exit {launcher.returncode}: {said}")
    assert not alive and len(said) == 1, out[-5000:]
    assert said[0].endswith(
        ": SIGINT (Ctrl-C): exiting now without a checkpoint of this step (exit code 76); resume=auto continues "
        "from the last complete checkpoint"
    )
    tracebacks = out.split("Traceback")[1:]
    assert all("deepspeed/launcher/runner.py" in t and "train.py" not in t for t in tracebacks), out[-5000:]
    assert remove_shm_leftovers(LAUNCH_PORTS[-1]) == []  # each rank removed its /dev/shm segment on the way out
