"""A write that fails during a run (a full disk) ends the job in one line naming the rank, the file and the cause,
the last complete checkpoint intact; a lost peer's survivors and the profiler's start and stop add nothing.

Fast tier: ``training.resilience.all_ranks.writing`` and the messages of gathered failures (``on_all_ranks``), the files
metrics.jsonl, the run lock and the tokenized cache name when their write fails, a hang dump that cannot be written,
and the profiler's native lines dropped from stderr (training/observation/logs.py).

Multi-rank (2 ranks, pipe 2, tiny fixtures; ``tests/ds_scripts/train_faults.py``'s ``FAULT_DISK_FULL``): rank 0's
``train_config.yaml`` at the second save (the one line, the other rank quiet, latest on the first checkpoint); rank
1's checkpoint file in a save; rank 1's background write (``save_async``, gathered at the next agreement); every
rank's profiler trace (one line for the job). A rank killed with ``kill -9`` is tests/test_run_failures.py's.
"""

from __future__ import annotations

import errno
import os

import pytest

from models.tiny import write_random_tokens
from tests.support.ranks import finish_deepspeed, start_deepspeed
from training.resilience.all_ranks import WriteFailed, failure_text, writing

FAULTS = "tests/ds_scripts/train_faults.py"
NO_SPACE = "[Errno 28] No space left on device"


def no_space(path=None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([path] if path else []))


def test_a_failed_write_names_the_rank_the_file_and_the_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    path = str(tmp_path / "train_config.yaml")
    with pytest.raises(WriteFailed) as err, writing(path):
        raise no_space()  # a file object's write: no file name of its own
    assert str(err.value) == f"rank 3: writing {path} failed: {NO_SPACE}"
    with pytest.raises(WriteFailed) as err, writing(str(tmp_path)):  # a directory of files: the one that failed
        raise no_space(str(tmp_path / "tokenizer.json"))
    assert err.value.what == f"writing {tmp_path / 'tokenizer.json'} failed: {NO_SPACE}"
    with pytest.raises(WriteFailed) as err, writing(path):  # torch.save's zip writer says no errno
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0")
    assert err.value.what.startswith(f"writing {path} failed: ") and "PytorchStreamWriter" in err.value.what
    with pytest.raises(ValueError), writing(path):  # not a write's failure: as it was
        raise ValueError("x")
    # what on_all_ranks says for a rank's failure (the ranks named by it)
    assert failure_text(no_space("/c/input_ids.bin")) == f"writing /c/input_ids.bin failed: {NO_SPACE}"
    assert failure_text(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x")) == (
        "/x: [Errno 2] No such file or directory"
    )


def test_metrics_the_run_lock_and_the_cache_name_the_file_they_could_not_write(tmp_path, monkeypatch):
    import builtins

    from data import cache
    from training.observation.metrics import StepLogger
    from training.resilience.run_lock import RunLock

    real_open = builtins.open

    def open_full(path, mode="r", *args, **kwargs):  # a full disk under tmp_path/full, as a failed open says it
        if "w" in mode and "full" in str(path):
            raise no_space(str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_full)
    full = tmp_path / "full"
    full.mkdir()
    with pytest.raises(WriteFailed, match=rf"^rank 0: writing {full / 'metrics.jsonl'} failed: \[Errno 28\]"):
        StepLogger(str(full), 4, 1, True)

    def fdopen_full(fd, *a, **k):
        os.close(fd)
        raise no_space()

    monkeypatch.setattr(os, "fdopen", fdopen_full)
    lock = RunLock(str(full))
    with pytest.raises(WriteFailed, match=rf"writing {full / lock.path.split(os.sep)[-1]} failed: \[Errno 28\]"):
        lock.acquire()
    assert not os.path.exists(lock.path)  # no half-written lock left to hold the next start

    class FullFile:
        name = str(full / "input_ids.bin")

        def write(self, data):
            raise no_space()

    with pytest.raises(OSError) as err:
        cache.named_write_errors(FullFile(), lambda: FullFile().write(b"x"))
    assert failure_text(err.value) == f"writing {full / 'input_ids.bin'} failed: {NO_SPACE}"


def torch_zip_error() -> RuntimeError:
    """What ``torch.save(obj, path)`` raises on a full disk (torch 2.x's zip writer): no errno, the stream's error
    hidden behind the one closing the zip raised."""
    try:
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")
    except RuntimeError as e:
        return e


def test_torchs_errnoless_write_error_is_a_full_disk_where_the_disk_is_full(tmp_path, monkeypatch):
    import shutil

    path = str(tmp_path / ".global_step4.partial" / "layer_01-model_states.pt")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(used=usage.total, free=0))
    with pytest.raises(WriteFailed) as err, writing(path):
        raise torch_zip_error()
    # the directory asked is the nearest that exists: the staging directory had not been made
    assert err.value.what == f"writing {path} failed: {NO_SPACE} (0 bytes free in {tmp_path})"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 << 30))  # not full: torch's words
    with pytest.raises(WriteFailed) as err, writing(path):
        raise torch_zip_error()
    assert err.value.what == (
        f"writing {path} failed: torch.save: basic_ios::clear: iostream error (the file system refused the write; "
        "check its free space and quota)"
    )
    with pytest.raises(WriteFailed) as err, writing(str(tmp_path)):  # a copy's error names its source first
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/src/tokenizer.json", None, str(tmp_path / "t.json"))
    assert err.value.what == f"writing {tmp_path / 't.json'} failed: {NO_SPACE}"
    with pytest.raises(RuntimeError, match="^not a write$"), writing(path):  # other errors pass as they are
        raise RuntimeError("not a write")


@pytest.fixture
def full_disk(tmp_path):
    """A real full disk: a 256 KiB tmpfs mounted in tmp_path, filled (needs root; skipped where it cannot mount)."""
    import subprocess

    full = tmp_path / "full"
    full.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a real full disk (needs root): {mount.stderr.decode().strip()}")
    try:
        with open(full / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"x" * 65536)
        yield full
    finally:
        subprocess.run(["umount", "-l", str(full)], check=True)


def test_every_write_of_a_run_on_a_real_full_disk_names_the_rank_the_file_and_no_space(full_disk, monkeypatch):
    import types

    import torch

    from data import cache
    from training.checkpoints import save_restore
    from training.checkpoints.async_save import CheckpointEngine
    from training.configuration.schema import TrainConfig
    from training.observation.metrics import StepLogger
    from training.observation.profiling import check_trace_written
    from training.resilience import preemption
    from training.resilience.run_lock import RunLock

    monkeypatch.setenv("RANK", "1")
    fail = rf"^rank 1: writing {full_disk}/%s failed: \[Errno 28\] No space left on device"
    engine = CheckpointEngine()
    engine.zipfile_serialization = True  # as a run's config has it: torch's zip writer, which names no errno
    staging = full_disk / ".global_step4.partial"
    staging.mkdir()
    with pytest.raises(WriteFailed, match=fail % r"\.global_step4\.partial/layer_01-model_states\.pt"):
        engine.save({"w": torch.zeros(1000)}, str(staging / "layer_01-model_states.pt"))
    with pytest.raises(WriteFailed, match=fail % "latest"):
        save_restore.make_latest(types.SimpleNamespace(output_dir=str(full_disk), save_total_limit=0), "global_step4")
    with pytest.raises(WriteFailed, match=fail % "train_config.yaml"):
        save_restore.write_train_config(TrainConfig(), str(full_disk))
    with pytest.raises(WriteFailed, match=fail % "metrics.jsonl"):
        StepLogger(str(full_disk), 4, 1, True)._write({"step": 1})
    lock = RunLock(str(full_disk))
    with pytest.raises(WriteFailed, match=fail % lock.path.split(os.sep)[-1]):
        lock.acquire()
    assert not os.path.exists(lock.path)
    with pytest.raises(OSError) as err:
        cache.write_rows(str(full_disk), iter([([1] * 8, [1] * 8, [0] * 8, 8)] * 64), None, lambda n: None)
    assert failure_text(err.value).startswith(f"writing {full_disk}/") and NO_SPACE in failure_text(err.value)
    trace = full_disk / "profile" / "rank1.json"
    trace.parent.mkdir()
    trace.write_bytes(b"")  # the profiler's native export on a full disk: nothing written, nothing said
    with pytest.raises(WriteFailed, match=fail % "profile/rank1.json"), writing(str(trace)):
        check_trace_written(str(trace))
    # the job's exit code, for its peers (training/resilience/preemption.py): said on a full disk too (a file's write of
    # it failed there, and its peers exited 76, "resume continues", instead of the failure's 1)
    monkeypatch.setitem(preemption._job, "marker", str(full_disk / preemption.STOPPING_FILE))
    monkeypatch.setattr(preemption, "_exiting", [])
    assert preemption._first_to_exit(1)
    preemption._exiting.clear()
    assert preemption.peers_exiting() == 1


def test_a_hang_dump_that_cannot_be_written_is_said_in_the_report(tmp_path, monkeypatch, capsys):
    from training.resilience import hang

    watch = hang.HangWatch.__new__(hang.HangWatch)
    watch.dir, watch.rank, watch.world, watch.fixed, watch.action = str(tmp_path / "hang"), 0, 1, 5.0, "wait"
    watch.step, watch.steps, watch.dump_error = 3, [], None

    def dump_full(*args, **kwargs):
        raise no_space()

    monkeypatch.setattr(hang.faulthandler, "dump_traceback", dump_full)
    monkeypatch.setattr(hang.time, "monotonic", iter(range(0, 10**6, 100)).__next__)  # no waiting for other ranks
    watch._dump(6.0)
    err = capsys.readouterr().err
    assert f"  rank 0: writing {tmp_path / 'hang' / 'rank0.txt'} failed: {NO_SPACE}" in err, err


def test_the_profilers_native_start_and_stop_lines_are_dropped(capfd, monkeypatch):
    from training.observation import logs

    monkeypatch.setitem(logs._filtering, "on", True)
    with logs.native_lines_dropped():
        os.write(2, b"USDT:2026-11-29 00:53:29 7067:7067 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-11-29 00:53:29 7067:7067 kept\n")
    assert capfd.readouterr().err == "ERROR:2026-11-29 00:53:29 7067:7067 kept\n"
    monkeypatch.setitem(logs._filtering, "on", False)  # log_level=info: everything
    with logs.native_lines_dropped():
        os.write(2, b"USDT:x profiler_stop\n")
    assert capfd.readouterr().err == "USDT:x profiler_stop\n"


# ---------- multi-rank: the job's one line ----------


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_ckpt):
    root = tmp_path_factory.mktemp("write-failures")
    write_random_tokens(str(root / "train.jsonl"), 32, 16, vocab_size=512)
    return root, tiny_ckpt


def args_for(root, ckpt, out, **overrides) -> list[str]:
    args = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data.train_file": root / "train.jsonl",
        "data.max_seq_length": 16,
        "data.cache_dir": root / "cache",
        "num_stages": 2,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "precision": "fp32",
        "save_steps": 2,
        "min_free_disk_gb": 0,
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]


CASES = {
    # the issue's case: rank 0's train_config.yaml (output_dir's, then the checkpoint's) at the second save
    "train_config": ("0:train_config.yaml:3", {}, "rank 0: writing {out}/train_config.yaml failed", "global_step2"),
    "checkpoint_file": ("1:global_step4.partial", {}, "rank 1: writing {out}/.global_step4.partial/", "global_step2"),
    "background": (
        "1:global_step2.partial:2",  # its first: the trainer state, written at once
        {"save_async": "true", "save_steps": 1},
        "train.py: error: checkpoint global_step2 could not be written (rank 1: writing {out}/.global_step2.partial/",
        "global_step1",
    ),
    "profile_every_rank": (
        "0+1:profile/rank",
        {"profile_steps": "[2,3]"},
        "writing {out}/profile/rank",
        "global_step2",
    ),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_a_full_disk_ends_the_job_in_one_line_naming_the_rank_the_file_and_the_cause(setup, case):
    root, ckpt = setup
    fault, overrides, expected, latest = CASES[case]
    out = root / case
    job = start_deepspeed(2, FAULTS, args_for(root, ckpt, out, **overrides), env={"FAULT_DISK_FULL": fault})
    proc = finish_deepspeed(job, str(root / f"{case}.log"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower() or "Errno" in line]
    assert len(errors) == 1, errors
    assert expected.format(out=out) in errors[0] and NO_SPACE in errors[0], errors[0]
    assert "Traceback" not in output and "Error executing job" not in output, output[-3000:]
    assert (out / "latest").read_text() == latest  # the last complete checkpoint, named
    assert f"latest names {out / latest} (resume=auto continues from it)" in errors[0]
