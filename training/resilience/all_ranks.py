"""Start-up steps that must succeed on every rank or fail on every rank.

If one rank fails (a missing layer file, bad data) while the others go on into the next collective,
the job hangs until the collective times out. ``on_all_ranks`` gathers every rank's outcome so all
ranks raise the same error together, naming the ranks that failed.

What bounds a wait when a rank is gone (measured on 4 CPU ranks, pipe 2 x data 2, in
``tests/test_run_failures.py``):

- a rank that dies (``kill -9``, out-of-memory kill, segfault): the DeepSpeed launcher polls its
  children every second and, on the first non-zero exit, sends SIGTERM to every other rank of its
  node (SIGKILL after 30 s) and exits non-zero; the surviving ranks also fail at once in their next
  collective with gloo's "Connection reset by peer" (ranks on other nodes too). The job exited
  1.3-1.8 s after ``kill -9`` of a rank mid-training or in the middle of a save (two runs each).
- a rank that hangs, or a node that disappears without closing its connections: every collective
  fails after ``dist_timeout_s`` (passed to ``deepspeed.init_distributed``), then the launcher stops
  the rest as above: 33-35 s after a rank hung, with ``dist_timeout_s=30``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class StartupError(RuntimeError):
    """A start-up step failed on at least one rank; the message names each failing rank."""


class TrainingStopped(RuntimeError):
    """Training must stop (a non-finite loss); raised on every rank alike, from values all ranks share."""


# Errors that say the write itself failed (the disk, a quota, the file system), not the path given.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


class WriteFailed(RuntimeError):
    """A file this rank writes during a run could not be written (a full disk, a quota, a read-only file system);
    ``str``: ``rank R: writing PATH failed: [Errno 28] No space left on device``, ``what`` the same without the
    rank (for a message that names the ranks itself)."""

    def __init__(self, path: str, cause: str):
        self.path, self.cause, self.rank = path, cause, int(os.environ.get("RANK", "0"))
        self.what = f"writing {path} failed: {cause}"
        super().__init__(f"rank {self.rank}: {self.what}")


def os_error_text(e: OSError) -> str:
    """``[Errno 28] No space left on device``: an OSError without the file name Python appends."""
    return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else str(e)


# What torch.save says when its zip writer, given a path, cannot write (a full disk): no errno, the file system's
# cause lost in C++. ``basic_ios::clear: iostream error`` from the write of a record, then, from closing the zip,
# ``[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662`` (or PytorchStreamWriter's own words).
TORCH_WRITE_TEXTS = (
    "PytorchStreamWriter failed",
    "file write failed",
    "basic_ios::clear",
    "iostream error",
    "unexpected pos",
)
FULL_BELOW_BYTES = 1 << 20  # a write failed with less than this free on its file system: the disk is full


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling (torch's second error hides its first)."""
    chain: list[BaseException] = []
    while e is not None and all(e is not seen for seen in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def is_write_error(e: BaseException) -> bool:
    """An OSError, or torch's error when ``torch.save`` cannot write its zip file (a RuntimeError naming no errno,
    ``TORCH_WRITE_TEXTS``, or raised while handling a full disk's OSError: a file object's write)."""
    if isinstance(e, OSError):
        return True
    return isinstance(e, RuntimeError) and any(
        (isinstance(x, OSError) and x.errno in WRITE_ERRNOS)
        or (isinstance(x, RuntimeError) and any(t in str(x) for t in TORCH_WRITE_TEXTS))
        for x in _chain(e)
    )


def disk_full_cause(path: str) -> str | None:
    """``[Errno 28] No space left on device (0 bytes free in DIR)`` where the file system of ``path`` (a file or
    directory, or its nearest existing parent) has less than ``FULL_BELOW_BYTES`` free (or no free inode); None
    otherwise (or when it cannot be asked)."""
    directory = os.path.abspath(path)
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        free = shutil.disk_usage(directory).free
        st = os.statvfs(directory)
    except OSError:
        return None
    if free >= FULL_BELOW_BYTES and not (st.f_files and st.f_favail == 0):
        return None
    what = f"{free} bytes free" if free < FULL_BELOW_BYTES else "no free inode"
    return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({what} in {directory})"


def write_failed(path: str, e: BaseException) -> WriteFailed:
    """:class:`WriteFailed` for ``e`` (``is_write_error``), raised writing ``path``: the file an OSError names (the
    destination of a copy), its errno; torch's errno-less error confirmed as a full disk by the free space
    (``disk_full_cause``), else said in torch's own first words."""
    for x in _chain(e):
        if isinstance(x, OSError):
            named = x.filename2 if x.filename2 is not None and x.errno in WRITE_ERRNOS else x.filename
            return WriteFailed(str(named or path), os_error_text(x))
    first = str(_chain(e)[-1]).strip().splitlines()[-1]
    full = disk_full_cause(path)
    if full is not None:
        return WriteFailed(path, full)
    return WriteFailed(path, f"torch.save: {first} (the file system refused the write; check its free space and quota)")


@contextlib.contextmanager
def writing(path: str):
    """Around this rank's write of ``path`` (a file, or a directory of files): a failure of the write is raised as
    :class:`WriteFailed` naming the rank, the file and the cause (train.py then ends the job with that one line)."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:
        if not is_write_error(e):
            raise
        raise write_failed(path, e) from e


def failure_text(e: BaseException) -> str:
    """What a rank's failure says in a message naming the ranks (``on_all_ranks``): a known error's own text, a
    file's OSError as ``writing PATH failed: [Errno ...] ...`` (or ``PATH: [Errno ...] ...`` for a read), anything
    else its traceback."""
    if isinstance(e, WriteFailed):
        return e.what
    if isinstance(e, OSError) and e.filename is not None:
        if e.errno in WRITE_ERRNOS:
            return f"writing {e.filename} failed: {os_error_text(e)}"
        return f"{e.filename}: {os_error_text(e)}"
    if type(e).__module__.split(".")[0] in ("models", "parallel", "data", "training"):
        return f"{e}"
    return traceback.format_exc().rstrip()


def on_all_ranks(step: str, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on every rank; return every rank's result (index = global rank) or raise on all."""
    try:
        outcome = (fn(), None)
    except Exception as e:  # any failure must reach the other ranks, not leave them waiting
        outcome = (None, failure_text(e))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    errors = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if errors:
        first = errors[0][1]
        ranks = ", ".join(str(r) for r, e in errors if e == first)
        others = [f"rank {r}: {e}" for r, e in errors if e != first]
        raise StartupError("\n".join([f"{step} failed on rank(s) {ranks}: {first}", *others]))
    return [result for result, _ in gathered]


def release_cpu_comm_buffer() -> None:
    """Unlink this rank's DeepSpeed shared-memory allreduce segment, if there is one.

    On the CPU accelerator, DeepSpeed's shm collectives create a 66 MB segment per rank in /dev/shm,
    named ``deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<local rank>``, and never
    remove it: every job leaks RAM, and a later job on the same address and port can attach to the
    stale segment. Call after the final barrier; the mappings of other ranks stay valid.
    """
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(),
        os.environ.get("MASTER_ADDR", ""),
        os.environ.get("MASTER_PORT", ""),
        os.environ.get("LOCAL_RANK", "0"),
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def exit_finished_run(code: int = 0) -> None:
    """End a rank whose run has finished (everything saved, process groups destroyed) with status ``code`` (0;
    75 after a stop signal, training/resilience/preemption.py), skipping the interpreter's teardown.

    After a ZeRO-3 offload run on the CPU accelerator, a rank now and then aborts in that teardown
    ("terminate called without an active exception", SIGABRT, after ``main`` has returned on every rank):
    a C++ destructor at interpreter exit, failing a job whose work was saved. atexit handlers (a caller's
    hooks, logging's shutdown) still run and output is flushed first; DeepSpeed's monitors need neither,
    they flush on every write.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def counted_sum(stats, counts: bool):
    """The sum over all ranks of the ranks' ``stats`` (a tensor) where ``counts`` (one rank per micro-batch counts it,
    the others add zeros), back on the CPU. A collective: every rank calls it."""
    from deepspeed.accelerator import get_accelerator

    stats = (stats * float(counts)).to(get_accelerator().current_device_name())  # NCCL: on the GPU
    dist.all_reduce(stats)
    return stats.cpu()
