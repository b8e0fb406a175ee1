"""A write that fails during a run (a full disk) ends the job in one line naming the rank, the file and the cause,
the last complete checkpoint intact; a lost peer's survivors and the profiler's start and stop add nothing.

Fast tier: ``training.distributed.writing`` and the messages of gathered failures (``on_all_ranks``), the files
metrics.jsonl, the run lock and the tokenized cache name when their write fails, a hang dump that cannot be written,
and the profiler's native lines dropped from stderr (training/logs.py).

Multi-rank (2 ranks, pipe 2, tiny fixtures; ``tests/ds_scripts/train_faults.py``'s ``FAULT_DISK_FULL``): rank 0's
``train_config.yaml`` at the second save (the one line, the other rank quiet, latest on the first checkpoint); rank
1's checkpoint file in a save; rank 1's background write (``save_async``, gathered at the next agreement); every
rank's profiler trace (one line for the job). A rank killed with ``kill -9`` is tests/test_reliability.py's.
"""

from __future__ import annotations

import errno
import os

import pytest

from tests.conftest import finish_deepspeed, start_deepspeed, write_random_tokens
from training.distributed import WriteFailed, failure_text, writing

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
    from training.metrics import StepLogger
    from training.run_lock import RunLock

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


def test_a_hang_dump_that_cannot_be_written_is_said_in_the_report(tmp_path, monkeypatch, capsys):
    from training import hang

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
    from training import logs

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
