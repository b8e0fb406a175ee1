"""train.py with faults injected at chosen moments (test-only; nothing here is in train.py itself).

Launched like train.py (`deepspeed --num_gpus 4 tests/ds_scripts/train_faults.py key=value ...`), with
environment variables choosing the faults:

- ``FAULT_CRASH_IN_SAVE=<step>:<rank>``: that rank SIGKILLs itself right after writing its first file
  of checkpoint ``global_step<step>`` (a rank dying in the middle of a save); the time of the kill
  is written to ``FAULT_KILL_TIME_FILE`` first, so the test can time the job's exit from it.
- ``FAULT_SLOW_WRITE=<step>:<rank>:<seconds>``: with ``save_async=true``, that rank's background writer
  waits that long before writing its files of checkpoint ``global_step<step>`` (a slow file system),
  after printing ``[fault] rank R: writing global_stepN in the background``.
- ``FAULT_NAN_AT_STEPS=<step>[,<step>...]``: the loss of those optimizer steps is NaN (the last
  stage's loss function multiplies it by NaN, so the gradients are NaN too).
- ``FAULT_HANG_AT_STEP=<step>:<rank>``: that rank stops responding at the start of that step (it
  sleeps forever, like a rank stuck in I/O), while the others wait for it in a collective; the line saying
  so ends with the time it began.
- ``FAULT_DISK_FULL=<ranks>:<text>[:<nth>]``: those ranks (``0`` or ``0+1``) find the disk full from their ``nth``
  (1 by default) write of a file whose path contains ``text``, and every one after it, as a real full disk says it:
  ``open`` and ``os.open`` raise ``[Errno 28] No space left on device``; ``torch.save`` to a path raises torch's
  errno-less ``RuntimeError``s (``basic_ios::clear: iostream error``, then ``unexpected pos``); a profiler trace is
  left cut short without a word (the native export's way); and ``shutil.disk_usage`` reports 0 bytes free once the
  disk is full.
"""

import builtins
import errno
import io
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from models.loss import CausalLMLoss  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
CURRENT = {"step": 0}  # the optimizer step being trained (1-based)


def parse_pair(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    step, rank = value.split(":")
    return int(step), int(rank)


crash = parse_pair("FAULT_CRASH_IN_SAVE")
slow = [int(v) for v in os.environ.get("FAULT_SLOW_WRITE", "").split(":") if v]
hang = parse_pair("FAULT_HANG_AT_STEP")
nan_steps = {int(s) for s in os.environ.get("FAULT_NAN_AT_STEPS", "").split(",") if s}

if crash and crash[1] == RANK:
    _save = torch.save
    tag_dir = (
        f"{os.sep}.global_step{crash[0]}.partial{os.sep}"  # where a save writes (training/checkpoints/save_restore.py)
    )

    def save_then_die(obj, f, *args, **kwargs):
        _save(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)) and tag_dir in os.fspath(f):
            with open(os.environ["FAULT_KILL_TIME_FILE"], "w") as out:
                out.write(f"{time.time()}\n{os.fspath(f)}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_then_die

if slow and slow[1] == RANK:
    import training.checkpoints.async_save  # noqa: E402

    _write_file = training.checkpoints.async_save.write_file
    slow_dir = f"{os.sep}.global_step{slow[0]}.partial{os.sep}"
    announced = []

    def slow_write_file(engine, path, obj):
        if slow_dir in path and not announced:
            announced.append(path)
            print(f"[fault] rank {RANK}: writing global_step{slow[0]} in the background", flush=True)
            time.sleep(slow[2])
        _write_file(engine, path, obj)

    training.checkpoints.async_save.write_file = slow_write_file

disk_full = os.environ.get("FAULT_DISK_FULL", "").split(":")
if disk_full[0] and str(RANK) in disk_full[0].split("+"):
    full_text, full_from, full_seen = disk_full[1], int(disk_full[2]) if len(disk_full) > 2 else 1, [0]

    def is_full(path) -> bool:
        if isinstance(path, (str, os.PathLike)) and full_text in os.fspath(path):
            full_seen[0] += 1
        return full_seen[0] >= full_from and full_text in os.fspath(path)

    def no_space(path) -> None:
        if isinstance(path, (str, os.PathLike)) and is_full(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    def torch_save_full(obj, f, *args, **kwargs):
        if not (isinstance(f, (str, os.PathLike)) and is_full(f)):
            return _torch_save(obj, f, *args, **kwargs)
        try:  # torch's zip writer, given a path: its stream's error, then another from closing the zip
            raise RuntimeError("basic_ios::clear: iostream error")
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")

    def export_full(self, path):
        _export(self, path)
        if is_full(path):  # the native export ignores a failed write: the trace is cut short, nothing said
            os.truncate(path, os.path.getsize(path) // 2)

    _disk_usage = shutil.disk_usage

    def disk_usage(path):
        usage = _disk_usage(path)
        return usage._replace(used=usage.total, free=0) if full_seen[0] >= full_from else usage

    def full_disk(write, is_write):
        def wrapped(path, *args, **kwargs):
            if is_write(args, kwargs):
                no_space(path)
            return write(path, *args, **kwargs)

        return wrapped

    def writes_mode(args, kwargs) -> bool:
        return any(c in (args[0] if args else kwargs.get("mode", "r")) for c in "wax+")

    builtins.open = io.open = full_disk(builtins.open, writes_mode)
    os.open = full_disk(os.open, lambda args, kwargs: bool(args[0] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
    _torch_save = torch.save
    torch.save = torch_save_full
    import torch.profiler  # noqa: E402

    _export = torch.profiler.profile.export_chrome_trace
    torch.profiler.profile.export_chrome_trace = export_full
    shutil.disk_usage = disk_usage

if nan_steps:
    _loss = CausalLMLoss.__call__

    def loss_with_nan(self, logits, labels):
        loss = _loss(self, logits, labels)
        return loss * float("nan") if CURRENT["step"] in nan_steps else loss

    CausalLMLoss.__call__ = loss_with_nan

import train  # noqa: E402  (strips the launcher's --local_rank argument)
import training.loop  # noqa: E402  (the loop calls train_step by this module's name)

_train_step = training.loop.train_step


def train_step(resolved, engine, data, loss_fn):
    CURRENT["step"] = engine.global_steps + 1  # restored by load_checkpoint when resuming
    if hang and hang == (CURRENT["step"], RANK):
        print(f"FAULT rank {RANK} hangs at step {CURRENT['step']} at time {time.time()}", flush=True)
        while True:
            time.sleep(3600)
    return _train_step(resolved, engine, data, loss_fn)


training.loop.train_step = train_step
train.main()
