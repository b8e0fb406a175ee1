"""DeepSpeed's CPU ranks for the tests, forked from the session's one fork server (tools/launch.py)."""

from __future__ import annotations

import os
import subprocess
import time

from tests.support import REPO
from tools.launch import Launcher, RankJob, deepspeed_command, remove_shm_leftovers
from training.resilience.ports import free_port

# Multi-rank CPU runs: one thread per rank (2 threads x 4 ranks on 2 cores ran 15-20x slower).
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of the whole CI run
FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others may finish before they are ended
# ... and how long a rank that ignores that SIGTERM lives on (DeepSpeed's launcher: 30 s; ranks here exit in under
# 1 s of it unless stuck, as the hung rank of tests/test_run_failures.py is).
KILL_AFTER_S = 5.0
LAUNCHER = Launcher()  # one fork server for the session, started by the first launch


def run_deepspeed(
    num_ranks: int, script: str, args: list[str], log_path: str, launcher: bool = False, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N script args`` (N CPU ranks) from the repo root, ``env`` added to the
    environment; output saved to ``log_path``. By default the ranks are started as DeepSpeed's launcher
    (``deepspeed/launcher/launch.py``) starts them, the same environment and command line, but without it,
    and forked from a process that has imported what they import (tools/launch.py): a launch takes 3 s
    here instead of 15. As the launcher does, a rank that fails ends the others and its exit status is the
    job's. ``launcher=True`` runs the real ``deepspeed`` command (tests of what the launcher itself prints or
    does; the demo, the multi-node and the killed-rank tests run it too).
    """
    if not launcher:
        return finish_deepspeed(start_deepspeed(num_ranks, script, args, env), log_path)
    port = free_port()
    try:
        cmd = deepspeed_command(num_ranks, script, args, port)
        proc = subprocess.run(
            cmd, cwd=REPO, env={**child_env(), **(env or {})}, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
        )
    finally:
        remove_shm_leftovers(port)
    return _logged(proc, log_path)


def start_deepspeed(
    num_ranks: int, script: str, args: list[str], env: dict | None = None, port: int | None = None
) -> RankJob:
    """``run_deepspeed``'s ranks (forked), started and not waited for: a test signals a rank (``job.ranks``)
    or reads the output (``job.output()``) while they run, then calls ``finish_deepspeed``."""
    return RankJob(LAUNCHER, num_ranks, script, args, {**child_env(), **(env or {})}, port or free_port())


def finish_deepspeed(job: RankJob, log_path: str) -> subprocess.CompletedProcess:
    """Wait for the ranks of ``start_deepspeed`` as ``run_deepspeed`` does; their output saved to ``log_path``."""
    try:
        proc = job.wait(LAUNCH_TIMEOUT_S, FAILURE_GRACE_S, KILL_AFTER_S)
    finally:
        remove_shm_leftovers(job.port)
    return _logged(proc, log_path)


def _logged(proc: subprocess.CompletedProcess, log_path: str) -> subprocess.CompletedProcess:
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def wait_for_first_step(output_dir) -> None:
    """Wait (up to 300 s) until a running job has logged its first step to ``output_dir/metrics.jsonl``."""
    metrics = os.path.join(str(output_dir), "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(metrics) and _lines(metrics) >= 1):
        time.sleep(0.05)


def _lines(path: str) -> int:
    with open(path) as f:
        return f.read().count("\n")


def train_run(root, name: str, ranks: int, args: list[str], ok: bool = True, launcher: bool = False):
    """``train.py args`` on ``ranks`` CPU ranks (``run_deepspeed``), its output saved to ``root/name.log``;
    with ``ok`` the run must succeed (the log's tail is the failure message). Returns the process."""
    proc = run_deepspeed(ranks, "train.py", list(args), os.path.join(str(root), f"{name}.log"), launcher=launcher)
    if ok:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def child_env() -> dict:
    """This process's environment, one thread per process, the repo on the module path: what launches get."""
    return {**os.environ, **RANK_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
