"""Whole runs are guarded: one run per output_dir, settings changed on resume applied exactly or refused, a stale
op-build lock and a busy master port named, one error line per job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from models.files.hf_convert import hf_to_stages
from models.tiny import write_random_tokens
from tests.support import REPO
from tests.support.ranks import child_env, finish_deepspeed, run_deepspeed, start_deepspeed
from tests.support.runs import read_metrics
from tools.launch import deepspeed_command
from training.resilience.ports import free_port

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_hf):
    root = tmp_path_factory.mktemp("safety")
    data = str(root / "train.jsonl")
    write_random_tokens(data, 64, 16, vocab_size=512)
    hf_to_stages(tiny_hf, str(root / "ckpt"))
    return root, data


def args(root, data: str, out, **overrides) -> list[str]:
    values = {
        "model_name_or_path": root / "ckpt",
        "output_dir": out,
        "data.train_file": data,
        "data.max_seq_length": 16,
        "data.cache_dir": root / "cache",
        "precision": "fp32",
        "micro_batch_size": 2,
        "max_steps": 4,
        "optim.lr": 1e-3,
        **overrides,
    }
    return [f"{k}={v}" for k, v in values.items()]


def launch(num_ranks: int, argv: list[str], log) -> subprocess.Popen:
    """The real ``deepspeed`` command (the harmless-lines test below reads what the launcher prints)."""
    cmd = deepspeed_command(num_ranks, "train.py", argv, free_port())
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, text=True)


def test_a_second_run_on_the_same_output_dir_is_refused_and_the_first_is_unaffected(setup):
    root, data = setup
    out = root / "shared"
    with open(root / "first.log", "w") as first_log:
        first = launch(2, args(root, data, out, max_steps=400, save_steps=200, seed=1), first_log)
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, (root / "first.log").read_text()[-3000:]
        second = run_deepspeed(2, "train.py", args(root, data, out, max_steps=400, seed=2), str(root / "second.log"))
        still_running = first.poll() is None
        assert first.wait(timeout=600) == 0, (root / "first.log").read_text()[-3000:]
    assert still_running  # the second run was refused while the first held the lock, not after it finished
    assert second.returncode == 1
    assert (
        f"output_dir {out} is in use by another run: host " in second.stderr
        and "Wait for it to finish" in second.stderr
    )
    assert second.stderr.count("train.py: error:") == 1  # once per job, not once per rank
    assert sorted(n for n in os.listdir(out) if n.startswith("global_step")) == ["global_step200", "global_step400"]
    assert "no longer this run's" not in (root / "first.log").read_text()  # the first run kept its lock throughout
    steps = [r["step"] for r in read_metrics(str(out))]
    assert steps == list(range(1, 401))  # one run's records, in order, readable
    assert not (out / ".run.lock").exists()  # released at exit


def test_resume_applies_a_changed_learning_rate_only_when_allowed(setup):
    root, data = setup
    out = root / "resumed"
    proc = run_deepspeed(
        2,
        "train.py",
        args(root, data, out, save_steps=2, num_stages=2, gradient_accumulation_steps=2),
        str(root / "r1.log"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = dict(max_steps=6, num_stages=2, gradient_accumulation_steps=2, **{"optim.lr": 5e-4})
    refused = run_deepspeed(2, "train.py", args(root, data, out, **changed), str(root / "r2.log"))
    assert refused.returncode == 1
    assert (
        "was saved with other optim settings: optim.lr 0.001 -> 0.0005: set the saved values, or add optim to "
        "resume_allow_changes" in refused.stderr
    )
    allowed = run_deepspeed(
        2, "train.py", args(root, data, out, resume_allow_changes="[optim]", **changed), str(root / "r3.log")
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert (
        "resume: changed since global_step4: optim.lr 0.001 -> 0.0005 (applied from step 5, the schedule recomputed)"
        in allowed.stdout
    )
    assert "resume: changed since global_step4: max_steps 4 -> 6, save_steps 2 -> 0 (as given)" in allowed.stdout
    lrs = {r["step"]: r["lr"] for r in read_metrics(str(out))}
    assert [lrs[s] for s in range(1, 7)] == [1e-3] * 4 + [5e-4] * 2  # without the fix: 1e-3 throughout


def test_a_stale_op_build_lock_is_named_within_the_startup_timeout(setup, tmp_path):
    """A job killed while DeepSpeed JIT-builds an op leaves its lock: every later job used to wait on it
    forever, printing nothing. Now the start-up watchdog names the file and exits."""
    root, data = setup
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    os.utime(lock.parent, (old, old))
    env = {**child_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("RANK", None)
    start, timeout_s = time.time(), 3  # the rank waits on the lock from the watchdog's start: 3 s name it as 900 would
    proc = subprocess.run(
        [sys.executable, "train.py", *args(root, data, tmp_path / "out", startup_timeout_s=timeout_s)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and time.time() - start < timeout_s + 30
    assert (
        f"train.py: error: rank 0 has not finished start-up after {timeout_s} s: still joining the process group"
        in proc.stderr
    )
    assert f"a DeepSpeed op build lock is held with no live builder: {lock}; remove it (rm {lock})" in proc.stderr


def test_a_busy_master_port_is_named(setup, tmp_path):
    import socket

    root, data = setup
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        job = start_deepspeed(2, "train.py", args(root, data, tmp_path / "out"), port=port)
        proc = finish_deepspeed(job, str(tmp_path / "busy.log"))
    assert proc.returncode != 0
    assert (
        f"train.py: error: the master port {port} is in use (another job on this machine?): launch with another "
        f"port, `deepspeed --master_port PORT ...`" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_known_harmless_lines_are_filtered_and_log_level_brings_them_back(setup):
    root, data = setup
    quiet = (root / "first.log").read_text()  # 2 ranks, data parallel 2, ZeRO-1, default log_level=warning
    # The launcher's two processes still say it (before train.py runs); the ranks no longer do.
    ranks_output = quiet[quiet.rindex("spawned with command") :]
    assert "Setting accelerator to CPU" not in ranks_output and quiet.count("Setting accelerator to CPU") == 2
    assert "SEED_LAYERS=" not in ranks_output and "is deprecated" not in ranks_output
    assert "built successfully" not in ranks_output
    assert "[train] engine:" in quiet and "step 400/400" in quiet  # the project's own lines still there
    loud = run_deepspeed(
        2, "train.py", args(root, data, root / "loud", log_level="info"), str(root / "loud.log"), launcher=True
    )
    assert loud.returncode == 0
    loud_ranks = (loud.stdout + loud.stderr)[(loud.stdout + loud.stderr).rindex("spawned with command") :]
    for line in (
        "SEED_LAYERS=",
        "Setting accelerator to CPU",
        "`torch.distributed.all_gather_into_tensor` is deprecated",
    ):
        assert line in loud_ranks, line
    records = [json.loads(line) for line in (root / "loud" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
