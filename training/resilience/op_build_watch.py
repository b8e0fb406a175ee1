"""No silent hang before the process group: the torch-extensions cache, stale op-build locks, a start-up watchdog.

DeepSpeed JIT-builds its C++ ops with ``torch.utils.cpp_extension.load``, which serialises builders with
torch's ``FileBaton``: the first process creates ``<build dir>/lock`` (``os.open(O_CREAT | O_EXCL)``),
keeps that descriptor open while ninja compiles in the build directory, then removes the file; every
other process polls until the file is gone, forever, printing nothing. A builder killed with SIGKILL (an
out-of-memory kill, a scheduler's timeout) leaves the file behind, and every later job using that cache
then hangs before the process group exists, where ``dist_timeout_s`` does not apply. The build directory
is ``$TORCH_EXTENSIONS_DIR/<op>`` when that variable is set, else
``~/.cache/torch_extensions/py311_cpu/<op>``: keyed by Python and torch version only, so two virtualenvs
share it and rewrite each other's build.

Hence:

- ``use_venv_extensions_dir``: one cache per virtualenv (``<venv>/torch_extensions``) unless the user set
  ``TORCH_EXTENSIONS_DIR``; ``scripts/setup.sh`` builds the ops there (``build_ops``) so jobs only load
  them.
- ``stale_build_locks``: the lock files nobody will ever remove. A lock counts as held by a live builder
  when any process on this host has the lock file open (the ``FileBaton`` holder keeps its descriptor
  until it removes the file) or has its working directory in the build directory (ninja and the compilers
  it runs do, even when their Python parent is gone), read from ``/proc/*/fd`` and ``/proc/*/cwd``. A
  lock is reported stale only when, in addition, nothing in its build directory (the lock included) has
  changed for ``min_age_s`` (default 60 s): ``/proc`` shows neither processes on other hosts sharing the
  directory over a network filesystem nor other users' processes, and a build writes its objects there.
  Without ``/proc`` (not Linux), no lock is reported: better no hint than telling the user to delete a
  lock in use. Nothing is removed automatically, for the same reason.
- ``StartupWatchdog``: a daemon thread that ends a rank whose start-up has not finished within
  ``timeout_s`` with one message naming what it was doing and any stale lock with the command to remove
  it. A stale lock found while waiting is also reported early, as a warning, once ``early_s`` (5 s) of
  start-up have passed: the rank would wait on it until the timeout, so the user can act at once. The
  rank itself is only ended at the timeout, since the rule above can be wrong for a builder on another
  host.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
import time

STALE_LOCK_MIN_AGE_S = 60.0
EARLY_WARNING_S = 5.0
POLL_S = 2.0

# DeepSpeed op builders (by accelerator-neutral class name) that a job may JIT-load, with the build time
# measured on 2 CPU cores. The shared-memory collectives load at every CPU ``init_distributed``;
# ``cpu_adam`` with optimizer offload; ``fused_adam`` with adamw_impl=deepspeed (on a GPU its CUDA op, built by the
# first job that uses it, with nvcc).
OP_BUILDERS = {"ShareMemCommBuilder": 30, "CPUAdamBuilder": 40, "FusedAdamBuilder": 60}
OPS_STAMP = "deepspeed-ops.json"  # in the virtualenv: which ops setup built, and where


def use_venv_extensions_dir() -> str:
    """Point ``TORCH_EXTENSIONS_DIR`` at ``<virtualenv>/torch_extensions`` unless it is set already; the
    directory in force. Call it before anything builds or loads a DeepSpeed op: ranks and their children
    inherit the variable. Outside a virtualenv torch's per-user default stays (its root is returned)."""
    current = os.environ.get("TORCH_EXTENSIONS_DIR")
    if current:  # an empty value would make torch build in the current directory: treated as unset
        return current
    if sys.prefix == sys.base_prefix:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return os.path.join(cache, "torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
    return os.environ["TORCH_EXTENSIONS_DIR"]


def _lock_files(ext_dir: str) -> list[str]:
    # <ext_dir>/<op>/lock with TORCH_EXTENSIONS_DIR set; <root>/py311_cpu/<op>/lock under torch's default root.
    found = glob.glob(os.path.join(ext_dir, "*", "lock")) + glob.glob(os.path.join(ext_dir, "*", "*", "lock"))
    return sorted(os.path.abspath(p) for p in found if os.path.isfile(p))


def _unchanged_for_s(build_dir: str) -> float:
    """Seconds since anything in ``build_dir`` (the directory itself, the lock, objects, the library) changed."""
    newest = os.stat(build_dir).st_mtime
    with os.scandir(build_dir) as entries:
        for entry in entries:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                pass
    return time.time() - newest


def _lock_holders(locks: list[str]) -> dict[str, list[int]] | None:
    """For each lock file, the ids of the processes on this host that have it open or work in its build
    directory; None when ``/proc`` is not there to tell."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    real = {os.path.realpath(lock): lock for lock in locks}
    dirs = {os.path.dirname(r): real[r] for r in real}
    holders: dict[str, list[int]] = {lock: [] for lock in locks}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        held: set[str] = set()
        # Processes that end, or belong to another user, while being read are skipped.
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            held.update(lock for d, lock in dirs.items() if cwd == d or cwd.startswith(d + os.sep))
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in real:
                held.add(real[target])
        for lock in held:
            holders[lock].append(int(pid))
    return holders


def stale_build_locks(ext_dir: str, min_age_s: float = STALE_LOCK_MIN_AGE_S) -> list[str]:
    """Absolute paths of the op-build lock files under ``ext_dir`` with no live builder (the rule is in the
    module docstring): each one blocks every later load of its op until it is removed."""
    locks = _lock_files(ext_dir)
    if not locks:
        return []
    holders = _lock_holders(locks)
    if holders is None:
        return []
    stale = []
    for lock in locks:
        try:
            if not holders[lock] and _unchanged_for_s(os.path.dirname(lock)) >= min_age_s:
                stale.append(lock)
        except FileNotFoundError:  # released while we looked
            pass
    return [lock for lock in stale if os.path.exists(lock)]


def stale_lock_advice(lock: str) -> str:
    return f"a DeepSpeed op build lock is held with no live builder: {lock}; remove it (rm {lock}) and start again"


class StartupWatchdog:
    """Ends this rank with exit code 1 and one message on stderr if start-up has not finished within
    ``timeout_s`` seconds of construction: ``<prog>: error: rank R has not finished start-up after N s:
    still <phase>``, then one line per stale op-build lock under ``ext_dir``. ``os._exit``, because the main
    thread is then blocked in C code (a rendezvous, a lock poll) and would never see an exception.
    ``timeout_s <= 0`` disables it. Use as a context manager or call ``stop()`` when start-up is done;
    ``phase(name)`` says what start-up is doing now, as "still <name>" reads."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        ext_dir: str,
        *,
        prog: str = "train.py",
        early_s: float = EARLY_WARNING_S,
        poll_s: float = POLL_S,
        min_lock_age_s: float = STALE_LOCK_MIN_AGE_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.ext_dir = ext_dir
        self.prog = prog
        self.early_s = early_s
        self.poll_s = poll_s
        self.min_lock_age_s = min_lock_age_s
        self._phase = "starting up"
        self._started = time.monotonic()
        self._stopped = threading.Event()
        self._firing = threading.Lock()  # stop() and the final message exclude each other
        self._warned: set[str] = set()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="startup-watchdog", daemon=True)
            self._thread.start()

    def phase(self, name: str) -> None:
        self._phase = name

    def stop(self) -> None:
        with self._firing:
            self._stopped.set()

    def __enter__(self) -> StartupWatchdog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _say(self, text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def _stale(self) -> list[str]:
        try:
            return stale_build_locks(self.ext_dir, self.min_lock_age_s)
        except OSError:  # the watchdog must still fire if the cache cannot be read
            return []

    def _watch(self) -> None:
        deadline = self._started + self.timeout_s
        while not self._stopped.wait(max(0.0, min(self.poll_s, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline:
                self._fire()
                return
            if now - self._started >= self.early_s:
                for lock in self._stale():
                    if lock not in self._warned:
                        self._warned.add(lock)
                        self._say(
                            f"{self.prog}: warning: rank {self.rank} is still {self._phase} after "
                            f"{now - self._started:.0f} s: {stale_lock_advice(lock)}"
                        )

    def _fire(self) -> None:
        lines = [
            f"{self.prog}: error: rank {self.rank} has not finished start-up after {self.timeout_s:g} s: "
            f"still {self._phase}"
        ]
        lines += [stale_lock_advice(lock) for lock in self._stale()]
        with self._firing:
            if self._stopped.is_set():
                return
            self._say("\n".join(lines))
            os._exit(1)


def _stamp_path() -> str:
    return os.path.join(sys.prefix, OPS_STAMP)


def ops_ready(ext_dir: str) -> bool:
    """Whether ``build_ops`` built its ops into ``ext_dir`` for this virtualenv and nothing since removed
    them or left a lock: a check in milliseconds (no deepspeed import) for setup.sh's fast path."""
    try:
        with open(_stamp_path()) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    if stamp.get("ext_dir") != ext_dir:
        return False
    return all(
        os.path.isfile(os.path.join(ext_dir, op, f"{op}.so")) and not os.path.exists(os.path.join(ext_dir, op, "lock"))
        for op in stamp.get("ops", [])
    )


def build_ops(ext_dir: str) -> list[str]:
    """Build (or check) the DeepSpeed ops a job of this project may JIT-load, with DeepSpeed's own builders,
    so that no job builds them; record them for ``ops_ready``. Raises SystemExit on a stale lock."""
    from deepspeed.accelerator import get_accelerator  # seconds to import: only here, in set-up

    built = []
    for class_name, build_s in OP_BUILDERS.items():
        builder = get_accelerator().create_op_builder(class_name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # not on this accelerator: DeepSpeed will not load it either
        op = builder.NAME
        lock = os.path.join(os.path.abspath(ext_dir), op, "lock")
        # Waiting here rather than in torch's silent poll, so that a lock whose builder is gone ends set-up
        # with the file to remove.
        waiting = False
        while os.path.exists(lock):
            if lock in stale_build_locks(ext_dir):
                raise SystemExit(f"[setup] error: {stale_lock_advice(lock)}")
            if not waiting:
                print(f"[setup] waiting for another process's build of DeepSpeed op {op} ({lock})", flush=True)
                waiting = True
            time.sleep(1)
        if os.path.isfile(os.path.join(ext_dir, op, f"{op}.so")):
            print(f"[setup] checking DeepSpeed op {op}", flush=True)
        else:
            print(f"[setup] building DeepSpeed op {op} (once, ~{build_s} s)", flush=True)
        start = time.monotonic()
        builder.load(verbose=False)
        print(f"[setup] DeepSpeed op {op} ready in {ext_dir} ({time.monotonic() - start:.0f} s)", flush=True)
        built.append(op)
    with open(_stamp_path(), "w") as f:
        json.dump({"ext_dir": ext_dir, "ops": built}, f)
    return built


def main(argv: list[str]) -> int:
    """``python -m training.resilience.op_build_watch ops-ready|build-ops``, for scripts/setup.sh."""
    ext_dir = use_venv_extensions_dir()
    if argv == ["ops-ready"]:
        return 0 if ops_ready(ext_dir) else 1
    if argv == ["build-ops"]:
        build_ops(ext_dir)
        return 0
    print("usage: python -m training.resilience.op_build_watch ops-ready|build-ops", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
