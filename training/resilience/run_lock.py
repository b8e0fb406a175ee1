"""One run per output_dir: an exclusive lock file, ``output_dir/.run.lock``, held for a run's lifetime.

Two runs writing into one output_dir interleave metrics.jsonl and mix their files inside each
``global_stepN``. The lock works on one node and across nodes on a shared filesystem (NFS, Lustre),
so it relies only on what those give atomically: creating a file with ``O_CREAT | O_EXCL``,
``os.replace`` and ``os.unlink``; no ``flock``/``fcntl`` (not shared between NFS clients everywhere).

The file holds JSON: host, pid, run id (uuid), start time, last heartbeat and the command line. A
daemon thread rewrites the heartbeat every ``heartbeat_s``. A lock is stale, and is taken over with a
warning, when its host is this host and its pid is not running, or (any host) its heartbeat is older
than ``stale_after_s``; a damaged or empty file (a crash between create and write) is stale once its
mtime is ``DAMAGED_AFTER_S`` old.

Take-over is race-safe: a taker first creates a claim file named after the stale lock (its run id)
with ``O_EXCL``, so for a given stale lock only one claim can exist; with the claim it reads the lock
again and removes it only if it is still that same stale lock. Nobody but the one claimant of a
stale lock ever removes it, and a fresh lock is never removed by a taker: two runs noticing the same
stale lock cannot both win.

No deepspeed or torch import: rank 0 acquires the lock before anything else is written.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime

from training.resilience.all_ranks import WriteFailed, os_error_text, writing

LOCK_NAME = ".run.lock"
# A lock file is written right after it is created; one still damaged or empty after this long
# was left by a crash (or a take-over claim by a crashed taker).
DAMAGED_AFTER_S = 5.0
# How long acquire() keeps trying while another run takes over the same stale lock.
CLAIM_WAIT_S = 2 * DAMAGED_AFTER_S
_FIELDS = {"host": str, "pid": int, "run_id": str, "started": (int, float), "heartbeat": (int, float)}

# Run ids held by RunLock objects of this process: a lock naming this host and our own pid but
# none of these ids was left by an earlier process that had our pid (a restarted container).
_HELD_HERE: set[str] = set()


class RunLockedError(RuntimeError):
    """output_dir is in use by another run (or the lock could not be taken)."""


def _fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        # PermissionError: the pid exists but belongs to another user; anything else: do not guess.
        return True
    return True


def _read(path: str) -> tuple[dict | None, os.stat_result] | None:
    """(record, stat) of the lock file, record None if damaged; None if there is no file."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):  # no lock (output_dir's own problems are reported elsewhere)
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None, st
    valid = isinstance(record, dict) and all(
        isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in _FIELDS.items()
    )
    return (record if valid else None), st


def _key(record: dict | None, st: os.stat_result) -> str:
    """Names one lock file generation: its run id, or for a damaged file its inode and mtime."""
    return record["run_id"] if record else f"damaged-{st.st_ino}-{st.st_mtime_ns}"


class RunLock:
    """Exclusive lock on ``output_dir`` for one run (see the module docstring).

    ``acquire()`` returns None, or the warning to print once when a stale lock was taken over; it
    raises ``RunLockedError`` when another live run holds the lock. The ``with`` form passes that
    warning to ``warn`` instead. ``release()`` (or leaving the
    ``with`` block) stops the heartbeat and removes the lock file if it still holds our run id.
    If another run takes the lock over meanwhile, the heartbeat stops and ``lost`` holds a message
    (also passed to ``warn`` if given, from the heartbeat thread).
    """

    def __init__(
        self,
        output_dir: str,
        heartbeat_s: float = 30.0,
        stale_after_s: float = 120.0,
        warn: Callable[[str], None] | None = None,
    ):
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"need 0 < heartbeat_s < stale_after_s, got {heartbeat_s} and {stale_after_s}")
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.warn = warn
        self._beat_failed = False  # the heartbeat's write failed once: said then, not at every beat
        self.host = socket.gethostname()
        self.run_id = uuid.uuid4().hex
        self.lost: str | None = None
        self.held = False
        self._record: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        message = self.acquire()
        if message and self.warn:
            self.warn(message)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- acquiring -----------------------------------------------------------------------------

    def acquire(self) -> str | None:
        """Takes the lock, creating output_dir if needed; returns the take-over warning or None.
        Raises RunLockedError, having written nothing but output_dir, if another run holds it."""
        if self.held:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        os.makedirs(self.output_dir, exist_ok=True)
        now = time.time()
        self._record = {
            "host": self.host,
            "pid": os.getpid(),
            "run_id": self.run_id,
            "started": now,
            "heartbeat": now,
            "command": shlex.join(sys.argv),
        }
        warning = None
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            if self._create():
                break
            seen = _read(self.path)
            if seen is None:
                continue  # released (or taken over) between our create and our read: try again
            record, st = seen
            reason = self._stale_reason(record, st)
            if reason is None:
                raise RunLockedError(self._in_use_message(record, st))
            if self._take_over(_key(record, st)):
                warning = f"warning: taking over a stale lock on {self.output_dir}: {reason}"
                break
            if time.monotonic() > deadline:
                raise RunLockedError(
                    f"output_dir {self.output_dir}: could not take over the stale lock {self.path} within "
                    f"{CLAIM_WAIT_S:.0f} s (another run was taking it over); try again, or choose another output_dir."
                )
            time.sleep(0.02)
        self.held = True
        _HELD_HERE.add(self.run_id)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return warning

    def holder(self) -> str | None:
        """Read only: the in-use message when a live run holds the lock now, else None (no lock, or a stale
        one that acquire() would take over). Lets validation report it before any process group starts."""
        seen = _read(self.path)
        if seen is None or self._stale_reason(*seen) is not None:
            return None
        return self._in_use_message(*seen)

    def _create(self) -> bool:
        """Creates the lock file with our record; False if one exists (or ours was taken meanwhile)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with writing(self.path), os.fdopen(fd, "w") as f:
                json.dump(self._record, f)
        except WriteFailed:
            self._remove_quietly(self.path)  # a half-written lock would hold the next start for DAMAGED_AFTER_S
            raise
        # If our write was delayed past DAMAGED_AFTER_S, a taker may have removed our file as damaged.
        seen = _read(self.path)
        return bool(seen and seen[0] and seen[0]["run_id"] == self.run_id)

    def _take_over(self, key: str) -> bool:
        """Replaces the stale lock generation ``key`` with ours: True if we did, False if the lock
        changed under us or another run is taking it over right now (look again)."""
        claim = f"{self.path}.takeover-{key}"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                abandoned = time.time() - os.stat(claim).st_mtime > DAMAGED_AFTER_S
            except FileNotFoundError:
                return False
            if abandoned:  # its taker crashed within the take-over
                self._remove_quietly(claim)
            return False
        try:
            # Only the holder of this claim replaces generation `key`, so if the lock still is that
            # generation, and still stale, nobody else can change it before we replace it.
            seen = _read(self.path)
            if seen is None or _key(*seen) != key or self._stale_reason(*seen) is None:
                return False
            # Replace it in one step: unlinking first would let a plain create win without a warning.
            new = f"{claim}.new"
            try:
                with writing(self.path), open(new, "w") as f:
                    json.dump(self._record, f)
            except WriteFailed:
                self._remove_quietly(new)
                raise
            os.replace(new, self.path)
            if seen[0]:
                self._remove_quietly(self._tmp_path(seen[0]["run_id"]))
            return True
        finally:
            self._remove_quietly(claim)

    def _stale_reason(self, record: dict | None, st: os.stat_result) -> str | None:
        """Why this lock is stale (the warning's text), or None if its run may still be going."""
        now = time.time()
        if record is None:
            age = now - st.st_mtime
            if age <= DAMAGED_AFTER_S:
                return None
            return (
                f"its lock file {self.path} is damaged or empty ({st.st_size} bytes, last written "
                f"{age:.0f} s ago: a run crashed while creating it)"
            )
        gone = f"its run (host {record['host']}, pid {record['pid']}, started {_fmt_time(record['started'])}) is gone"
        if record["host"] == self.host:
            if record["pid"] == os.getpid() and record["run_id"] not in _HELD_HERE:
                return f"{gone} (pid not running: pid {record['pid']} is now this process)"
            if not _pid_alive(record["pid"]):
                return f"{gone} (pid not running)"
        quiet = self._heartbeat_age(record, st, now)
        if quiet > self.stale_after_s:
            return f"{gone} (no heartbeat for {quiet:.0f} s)"
        return None

    @staticmethod
    def _heartbeat_age(record: dict, st: os.stat_result, now: float) -> float:
        # The newer of the recorded heartbeat (the writer's clock) and the file's mtime (the file
        # server's clock): a clock skew between hosts then never makes a live run look stale.
        return now - max(record["heartbeat"], st.st_mtime)

    def _in_use_message(self, record: dict | None, st: os.stat_result) -> str:
        now = time.time()
        if record is None:
            return (
                f"output_dir {self.output_dir} is in use by another run that is creating its lock file "
                f"right now ({self.path}, {st.st_size} bytes, written {now - st.st_mtime:.0f} s ago). "
                "Wait for it to finish, or choose another output_dir."
            )
        return (
            f"output_dir {self.output_dir} is in use by another run: host {record['host']}, pid {record['pid']}, "
            f"started {_fmt_time(record['started'])} ({now - record['started']:.0f} s ago), last heartbeat "
            f"{self._heartbeat_age(record, st, now):.0f} s ago ({self.path}). "
            "Wait for it to finish, or choose another output_dir."
        )

    # -- holding and releasing -----------------------------------------------------------------

    def _tmp_path(self, run_id: str) -> str:
        return f"{self.path}.tmp-{run_id}"

    @staticmethod
    def _remove_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _still_ours(self) -> bool:
        seen = _read(self.path)
        if seen is not None and seen[0] and seen[0]["run_id"] == self.run_id:
            return True
        other = seen[0] if seen else None
        who = f"host {other['host']}, pid {other['pid']}" if other else "no readable lock file"
        self.lost = (
            f"warning: the lock on {self.output_dir} is no longer this run's ({who} in {self.path}): "
            "another run took it over, so two runs may now write into this output_dir"
        )
        return False

    def _heartbeat_loop(self) -> None:
        tmp = self._tmp_path(self.run_id)
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._still_ours():
                    if self.warn:
                        self.warn(self.lost)
                    return
                self._record["heartbeat"] = time.time()
                with open(tmp, "w") as f:
                    json.dump(self._record, f)
                os.replace(tmp, self.path)
            except OSError as e:
                # A transient filesystem error (NFS hiccup): the next beat tries again, and a lock
                # left quiet too long is only taken over after stale_after_s. Said once (a full disk stays full).
                if not self._beat_failed:
                    self._beat_failed = True
                    print(
                        f"[train] warning: rank 0: writing {self.path} failed: {os_error_text(e)}: the run lock's "
                        f"heartbeat tries again every {self.heartbeat_s:g} s (a lock quiet for "
                        f"{self.stale_after_s:g} s may be taken over by another run)",
                        file=sys.stderr,
                        flush=True,
                    )
                continue

    def release(self) -> None:
        """Stops the heartbeat and removes the lock file if it still holds our run id."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.held = False
        _HELD_HERE.discard(self.run_id)
        self._remove_quietly(self._tmp_path(self.run_id))
        if self._still_ours():
            os.unlink(self.path)
