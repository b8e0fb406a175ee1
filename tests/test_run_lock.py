"""training/resilience/run_lock.py: one run per output_dir.

Fast: small heartbeat and stale times.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from training.resilience import run_lock
from training.resilience.run_lock import LOCK_NAME, RunLock, RunLockedError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()

# Holds the lock in another process (started in REPO: `python -c` imports from there) until a line arrives
# on stdin, then says whether it lost it.
HOLDER = """
import sys
from training.resilience.run_lock import RunLock
lock = RunLock(sys.argv[1], heartbeat_s=0.05, stale_after_s=5.0)
lock.acquire()
print(lock.run_id, flush=True)
sys.stdin.readline()
lost = lock.lost
lock.release()
print("lost" if lost else "kept", flush=True)
"""


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (polled every 10 ms): a heartbeat of 0.05 s shows
    in a few of them, where a fixed sleep waited 0.3 s for it."""
    deadline = time.time() + timeout_s
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def lock_path(output_dir) -> str:
    return os.path.join(output_dir, LOCK_NAME)


def read_lock(output_dir) -> dict:
    with open(lock_path(output_dir)) as f:
        return json.load(f)


def write_lock(output_dir, host: str, pid: int, age_s: float = 0.0, text: str | None = None) -> str:
    """A lock file of another run whose last heartbeat (and mtime) is ``age_s`` old; ``text`` replaces
    the record (a damaged file). Returns the lock's run id."""
    os.makedirs(output_dir, exist_ok=True)
    now = time.time()
    run_id = uuid.uuid4().hex
    record = {
        "host": host,
        "pid": pid,
        "run_id": run_id,
        "started": now - age_s - 60,
        "heartbeat": now - age_s,
        "command": "train.py other",
    }
    with open(lock_path(output_dir), "w") as f:
        f.write(json.dumps(record) if text is None else text)
    os.utime(lock_path(output_dir), (now - age_s, now - age_s))
    return run_id


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_acquire_writes_record_and_release_removes_it(tmp_path):
    out = tmp_path / "run" / "nested"
    lock = RunLock(str(out), heartbeat_s=0.05, stale_after_s=1.0)
    assert lock.acquire() is None
    record = read_lock(out)
    assert record["host"] == HOST and record["pid"] == os.getpid() and record["run_id"] == lock.run_id
    assert record["started"] <= record["heartbeat"] <= time.time()
    assert os.path.basename(sys.argv[0]) in record["command"]
    with pytest.raises(RuntimeError, match="already held"):
        lock.acquire()
    lock.release()
    lock.release()  # a second release is a no-op
    assert os.listdir(out) == [] and lock.lost is None


def test_context_manager_heartbeat_advances(tmp_path):
    with RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=1.0) as lock:
        first = read_lock(tmp_path)["heartbeat"]
        assert wait_for(lambda: read_lock(tmp_path)["heartbeat"] > first)
        assert read_lock(tmp_path)["run_id"] == lock.run_id
    assert not os.path.exists(lock_path(tmp_path))


def test_heartbeat_must_be_shorter_than_stale_time(tmp_path):
    with pytest.raises(ValueError, match="heartbeat_s < stale_after_s"):
        RunLock(str(tmp_path), heartbeat_s=5.0, stale_after_s=5.0)


@pytest.mark.slow  # a second and more: a second process holding the lock
def test_second_run_refused_first_unaffected(tmp_path):
    out = str(tmp_path / "out")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, out], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        holder_run_id = holder.stdout.readline().strip()
        assert read_lock(out)["run_id"] == holder_run_id
        beat = read_lock(out)["heartbeat"]
        with pytest.raises(RunLockedError) as refused:
            RunLock(out, heartbeat_s=0.05, stale_after_s=5.0).acquire()
        message = str(refused.value)
        assert message.startswith(f"output_dir {out} is in use by another run: host {HOST}, pid {holder.pid}, started ")
        assert "s ago), last heartbeat " in message and f"({lock_path(out)})" in message
        assert message.endswith("Wait for it to finish, or choose another output_dir.")
        # The refused run wrote nothing, and the first one's lock and heartbeat go on.
        assert wait_for(lambda: read_lock(out)["heartbeat"] > beat)
        assert read_lock(out)["run_id"] == holder_run_id
        assert [n for n in os.listdir(out) if ".tmp-" not in n] == [LOCK_NAME]
        stdout, _ = holder.communicate("\n", timeout=30)
    finally:
        holder.kill()
    assert holder.returncode == 0 and stdout.strip() == "kept"
    assert os.listdir(out) == []


def test_dead_pid_on_this_host_taken_over(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, HOST, pid)  # a fresh heartbeat: the dead pid alone makes it stale
    lock = RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=60.0)
    warning = lock.acquire()
    assert warning.startswith(
        f"warning: taking over a stale lock on {tmp_path}: its run (host {HOST}, pid {pid}, started "
    )
    assert warning.endswith("is gone (pid not running)")
    assert read_lock(tmp_path)["run_id"] == lock.run_id
    lock.release()


def test_own_pid_left_by_an_earlier_process_taken_over(tmp_path):
    # A restarted container: same host name, and our pid was the old run's pid.
    write_lock(tmp_path, HOST, os.getpid())
    with RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=60.0) as first:
        assert read_lock(tmp_path)["run_id"] == first.run_id
        # ... but a lock held by this very process is not taken over.
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=60.0).acquire()


def test_stale_heartbeat_from_another_host_taken_over(tmp_path):
    write_lock(tmp_path, "other-node-7", 4242, age_s=10)
    messages = []
    with RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0, warn=messages.append) as lock:
        assert read_lock(tmp_path)["run_id"] == lock.run_id
    assert len(messages) == 1
    assert messages[0].startswith(
        f"warning: taking over a stale lock on {tmp_path}: its run (host other-node-7, pid 4242"
    )
    assert messages[0].endswith("is gone (no heartbeat for 10 s)")


def test_fresh_lock_from_another_host_refused(tmp_path):
    # Its pid is not running here, which says nothing about another host: only the heartbeat counts.
    write_lock(tmp_path, "other-node-7", dead_pid(), age_s=1)
    before = open(lock_path(tmp_path)).read()
    with pytest.raises(RunLockedError) as refused:
        RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=5.0).acquire()
    assert "in use by another run: host other-node-7, pid " in str(refused.value)
    assert "last heartbeat 1 s ago" in str(refused.value)
    assert open(lock_path(tmp_path)).read() == before


def test_heartbeat_uses_newer_of_record_and_mtime(tmp_path):
    # A writer whose clock is behind: its recorded heartbeat looks old, the file was just written.
    write_lock(tmp_path, "other-node-7", 4242, age_s=30)
    os.utime(lock_path(tmp_path))
    with pytest.raises(RunLockedError, match="last heartbeat 0 s ago"):
        RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=5.0).acquire()


@pytest.mark.parametrize("text", ["", '{"host": "other-node-7", "pid"', "[1, 2]"])
def test_damaged_lock(tmp_path, text):
    write_lock(tmp_path, HOST, 0, text=text)
    # Fresh: its run may be writing it right now.
    with pytest.raises(RunLockedError, match="creating its lock file right now"):
        RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=60.0).acquire()
    old = time.time() - run_lock.DAMAGED_AFTER_S - 5
    os.utime(lock_path(tmp_path), (old, old))
    lock = RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=60.0)
    warning = lock.acquire()
    assert warning.startswith(
        f"warning: taking over a stale lock on {tmp_path}: its lock file {lock_path(tmp_path)} "
        f"is damaged or empty ({len(text)} bytes, last written "
    )
    assert read_lock(tmp_path)["run_id"] == lock.run_id
    lock.release()


def _race_worker(output_dir, barrier, results, done):
    lock = RunLock(output_dir, heartbeat_s=0.05, stale_after_s=2.0)
    barrier.wait()
    try:
        warning = lock.acquire()
    except RunLockedError as e:
        results.put(("refused", str(e)))
        return
    results.put(("won", lock.run_id, warning))
    done.wait(60)
    lock.release()


@pytest.mark.e2e  # nine rounds of three forked processes racing for the lock
def test_racing_for_a_stale_lock_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    stale_kinds = {
        "dead pid": lambda out: write_lock(out, HOST, dead_pid()),
        "old heartbeat": lambda out: write_lock(out, "other-node-7", 4242, age_s=10),
        "damaged": lambda out: write_lock(out, HOST, 0, age_s=run_lock.DAMAGED_AFTER_S + 5, text=""),
    }
    for round_ in range(9):
        kind = list(stale_kinds)[round_ % 3]
        out = str(tmp_path / f"round{round_}")
        stale_kinds[kind](out)
        barrier, results, done = ctx.Barrier(3), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race_worker, args=(out, barrier, results, done)) for _ in range(3)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        winners = [o for o in outcomes if o[0] == "won"]
        assert len(winners) == 1, (kind, outcomes)
        assert "taking over a stale lock" in winners[0][2]
        assert read_lock(out)["run_id"] == winners[0][1]
        for o in outcomes:
            if o[0] == "refused":
                assert "in use by another run" in o[1], o[1]
        done.set()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert os.listdir(out) == [], (kind, os.listdir(out))


def test_late_taker_leaves_the_new_lock_alone(tmp_path):
    # A run that judged the old lock stale only gets to take it over after another run did.
    write_lock(tmp_path, "other-node-7", 4242, age_s=10)
    seen = run_lock._read(lock_path(tmp_path))
    late = RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0)
    assert late._stale_reason(*seen) is not None
    with RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0) as winner:
        assert late._take_over(run_lock._key(*seen)) is False
        assert read_lock(tmp_path)["run_id"] == winner.run_id
        assert winner.lost is None


def test_take_over_claims(tmp_path, monkeypatch):
    run_id = write_lock(tmp_path, "other-node-7", 4242, age_s=10)
    claim = f"{lock_path(tmp_path)}.takeover-{run_id}"
    open(claim, "w").close()
    monkeypatch.setattr(run_lock, "CLAIM_WAIT_S", 0.1)
    # A fresh claim: another run is taking the lock over; we neither race it nor wait forever.
    with pytest.raises(RunLockedError, match="could not take over the stale lock"):
        RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0).acquire()
    assert read_lock(tmp_path)["run_id"] == run_id
    # An old claim: its taker crashed in the take-over; it is cleared.
    old = time.time() - run_lock.DAMAGED_AFTER_S - 5
    os.utime(claim, (old, old))
    with RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0) as lock:
        assert read_lock(tmp_path)["run_id"] == lock.run_id
    assert os.listdir(tmp_path) == []


def test_release_keeps_a_lock_another_run_took_over(tmp_path):
    messages = []
    lock = RunLock(str(tmp_path), heartbeat_s=0.05, stale_after_s=2.0, warn=messages.append)
    lock.acquire()
    # Another run's take-over, as the lock's file shows it (our heartbeat seemed stale to it).
    other = write_lock(tmp_path, "other-node-7", 4242)
    wait_for(lambda: lock.lost is not None)
    assert lock.lost and "host other-node-7, pid 4242" in lock.lost and messages == [lock.lost]
    time.sleep(0.2)
    assert read_lock(tmp_path)["run_id"] == other  # the heartbeat stopped rewriting it
    lock.release()
    assert read_lock(tmp_path)["run_id"] == other


def test_holder_reports_a_live_lock_read_only(tmp_path):
    """What validation asks before any process group starts: the in-use message, and no file written."""
    out = str(tmp_path / "out")
    assert RunLock(out).holder() is None and not os.path.exists(out)
    with RunLock(out):
        message = RunLock(out).holder()
        assert message.startswith(
            f"output_dir {out} is in use by another run: host {socket.gethostname()}, pid {os.getpid()}"
        )
    assert RunLock(out).holder() is None
