"""training/resilience/op_build_watch.py: the per-virtualenv torch-extensions cache, stale op-build locks, the start-up
watchdog; and training/resilience/all_ranks.exit_finished_run, how a finished rank ends.

Unit tier (seconds): fake extension directories and tiny watchdog timeouts; every watchdog that may fire
runs in a subprocess, since firing ends the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from training.resilience.op_build_watch import StartupWatchdog, stale_build_locks, use_venv_extensions_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_lock(ext_dir, *parts: str, age_s: float | None = 3600) -> str:
    """A build directory under ``ext_dir`` holding a library and ``lock``, all last changed ``age_s`` ago."""
    build_dir = os.path.join(str(ext_dir), *parts)
    os.makedirs(build_dir)
    for name in ("build.ninja", "lock"):
        open(os.path.join(build_dir, name), "w").close()
    if age_s is not None:
        for name in ("build.ninja", "lock", ""):  # the directory last: creating files touched it
            os.utime(os.path.join(build_dir, name), (time.time() - age_s,) * 2)
    return os.path.join(build_dir, "lock")


def test_use_venv_extensions_dir_respects_a_value_already_set(monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert use_venv_extensions_dir() == "/somewhere/else"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/else"


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtualenv")
@pytest.mark.parametrize("value", [None, ""])
def test_use_venv_extensions_dir_defaults_to_the_virtualenv(monkeypatch, value):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # recorded, so the value set below is undone afterwards
    if value is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", value)
    expected = os.path.join(sys.prefix, "torch_extensions")
    assert use_venv_extensions_dir() == expected
    assert os.environ["TORCH_EXTENSIONS_DIR"] == expected


def test_old_lock_without_builder_is_stale_in_both_layouts(tmp_path):
    flat = make_lock(tmp_path, "deepspeed_shm_comm")
    nested = make_lock(tmp_path, "py311_cpu", "cpu_adam")
    make_lock(tmp_path, "fused_adam")
    os.remove(os.path.join(str(tmp_path), "fused_adam", "lock"))  # built and released: no lock
    assert stale_build_locks(str(tmp_path)) == sorted([flat, nested])


def test_recent_lock_is_not_stale_until_min_age(tmp_path):
    lock = make_lock(tmp_path, "deepspeed_shm_comm", age_s=None)
    assert stale_build_locks(str(tmp_path)) == []
    assert stale_build_locks(str(tmp_path), min_age_s=0) == [lock]


def test_lock_held_open_by_a_live_process_is_not_stale(tmp_path):
    lock = make_lock(tmp_path, "deepspeed_shm_comm")
    fd = os.open(lock, os.O_RDONLY)  # what torch's FileBaton holds while its owner builds
    try:
        assert stale_build_locks(str(tmp_path)) == []
    finally:
        os.close(fd)
    assert stale_build_locks(str(tmp_path)) == [lock]


def test_process_working_in_the_build_directory_keeps_the_lock_live(tmp_path):
    lock = make_lock(tmp_path, "deepspeed_shm_comm")
    # ninja and the compilers it runs work in the build directory, and outlive a killed Python parent.
    compiler = subprocess.Popen(["sleep", "30"], cwd=os.path.dirname(lock))
    try:
        assert stale_build_locks(str(tmp_path)) == []
    finally:
        compiler.kill()
        compiler.wait()
    assert stale_build_locks(str(tmp_path)) == [lock]


def run_watchdog(script: str, ext_dir: str, timeout_s: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    code = (
        "import os, sys, time\nfrom training.resilience.op_build_watch import StartupWatchdog\n"
        "EXT = os.environ['EXT']\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code + textwrap.dedent(script)],
        cwd=REPO,
        env={**os.environ, "EXT": ext_dir},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return proc, time.monotonic() - start


@pytest.mark.e2e
def test_watchdog_ends_a_stuck_start_up_naming_the_phase_and_the_stale_lock(tmp_path):
    lock = make_lock(tmp_path, "deepspeed_shm_comm")
    proc, elapsed = run_watchdog(
        """
        StartupWatchdog(1.0, rank=3, ext_dir=EXT).phase("building or loading DeepSpeed op")
        time.sleep(30)
        """,
        str(tmp_path),
    )
    assert proc.returncode == 1, proc.stderr
    assert elapsed < 1.0 + 2.0
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "train.py: error: rank 3 has not finished start-up after 1 s: still building or loading DeepSpeed op",
        f"a DeepSpeed op build lock is held with no live builder: {lock}; remove it (rm {lock}) and start again",
    ]


@pytest.mark.e2e
def test_watchdog_without_stale_lock_names_the_phase_only(tmp_path):
    proc, _ = run_watchdog(
        """
        w = StartupWatchdog(0.5, rank=0, ext_dir=EXT)
        w.phase("joining the process group (rendezvous at 127.0.0.1:29500)")
        time.sleep(30)
        """,
        str(tmp_path),
    )
    assert proc.returncode == 1
    assert proc.stderr == (
        "train.py: error: rank 0 has not finished start-up after 0.5 s: "
        "still joining the process group (rendezvous at 127.0.0.1:29500)\n"
    )


@pytest.mark.e2e
def test_watchdog_stopped_in_time_does_not_fire(tmp_path):
    make_lock(tmp_path, "deepspeed_shm_comm")
    proc, _ = run_watchdog(
        """
        with StartupWatchdog(0.5, rank=0, ext_dir=EXT) as w:
            w.phase("tokenizing data / waiting for the data cache")
        w2 = StartupWatchdog(0.5, rank=0, ext_dir=EXT)
        w2.stop()
        time.sleep(1.5)
        print("finished")
        """,
        str(tmp_path),
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "finished\n", "")


@pytest.mark.e2e
def test_watchdog_warns_early_of_a_stale_lock_once(tmp_path):
    lock = make_lock(tmp_path, "deepspeed_shm_comm")
    proc, _ = run_watchdog(
        """
        w = StartupWatchdog(30, rank=1, ext_dir=EXT, early_s=0.2, poll_s=0.1)
        w.phase("building or loading DeepSpeed op")
        time.sleep(1.0)
        w.stop()
        """,
        str(tmp_path),
    )
    assert proc.returncode == 0
    [line] = proc.stderr.splitlines()
    assert line.startswith("train.py: warning: rank 1 is still building or loading DeepSpeed op after ")
    assert line.endswith(
        f" s: a DeepSpeed op build lock is held with no live builder: {lock}; remove it (rm {lock}) and start again"
    )


def test_watchdog_with_no_timeout_starts_no_thread(tmp_path):
    w = StartupWatchdog(0, rank=0, ext_dir=str(tmp_path))
    w.phase("importing deepspeed")
    w.stop()
    assert w._thread is None


@pytest.mark.e2e
def test_a_finished_run_exits_0_after_its_atexit_hooks_without_the_interpreter_teardown():
    """train.py ends a finished rank with os._exit (a C++ destructor in the teardown aborted ZeRO-3 offload
    runs now and then): a caller's atexit hook still runs, buffered output is flushed, nothing after the call."""
    code = """
        import atexit, sys
        from training.resilience.all_ranks import exit_finished_run
        atexit.register(print, "hook ran")  # unflushed: exit_finished_run flushes
        sys.stdout.write("buffered, no newline")
        exit_finished_run()
        print("after the exit")
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "buffered, no newlinehook ran\n"
