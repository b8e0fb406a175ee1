"""What a shared cluster asks of the training loop: stop on a signal with a checkpoint, and save on the clock.

SLURM signals a job ahead of its time limit or a preemption (``--signal=USR1@300``; SIGTERM at the end).
Every rank catches SIGTERM and SIGUSR1; the signal may reach one rank or all. After each step the ranks
agree in one all-reduce (``StopAndSave.after_step``) whether any rank was signalled and whether the
``save_every_minutes`` clock (rank 0's) is due, so all ranks save, and stop, after the same step. A stopped
run's checkpoint is complete (``latest`` is written after every rank's files) and the process exits with
``PREEMPTED_EXIT_CODE``; ``resume=auto`` continues it exactly.

A second signal, or no agreement within ``preempt_grace_s`` of the first (a rank stuck in a collective, a
step longer than the grace), exits at once with ``UNSAVED_EXIT_CODE``: the last complete checkpoint is
untouched (a save in progress never moved ``latest``), and ``resume=auto`` continues from it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75  # BSD's EX_TEMPFAIL: saved, stopped, resume to continue (requeue)
UNSAVED_EXIT_CODE = 76  # stopped without saving this step: resume continues from the last complete checkpoint
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
_exiting: list[int] = []  # set when this rank is already on its way out (training/hang.py): signals end it quietly


def exit_quietly_on_signals(code: int) -> None:
    """From now on a stop signal ends this rank at once with ``code``, saying nothing (it is exiting anyway)."""
    _exiting.append(code)


def exit_if_exiting() -> None:
    """Called with an exception in hand: a rank already on its way out (its peers gone first) exits quietly."""
    if _exiting:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exiting[0])


class Preempted(Exception):
    """Raised on every rank alike once the checkpoint of the step is saved after a stop signal."""

    def __init__(self, message: str):
        super().__init__(message)


class StopAndSave:
    """The stop-signal handlers of this rank and the per-step agreement of all ranks (see the module)."""

    def __init__(self, save_every_minutes: float, grace_s: float, rank: int, device: str):
        self.save_every_s, self.grace_s, self.rank, self.device = save_every_minutes * 60, grace_s, rank, device
        self.received: str | None = None
        self.timer: threading.Timer | None = None
        self.last_save = time.monotonic()
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if _exiting:
            os._exit(_exiting[0])
        if self.received is not None and self.timer is None:  # the checkpoint after the first is complete
            os._exit(PREEMPTED_EXIT_CODE)
        if self.received is not None:
            self._exit_unsaved(f"a second {name} arrived before the checkpoint was complete")
        self.received = name
        self.timer = threading.Timer(
            self.grace_s, self._exit_unsaved, [f"no checkpoint within preempt_grace_s={self.grace_s:g} of {name}"]
        )
        self.timer.daemon = True
        self.timer.start()

    def _exit_unsaved(self, why: str) -> None:
        print(
            f"[train] rank {self.rank}: {why}: exiting now without a checkpoint of this step (exit code "
            f"{UNSAVED_EXIT_CODE}); resume=auto continues from the last complete checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(UNSAVED_EXIT_CODE)

    def saved(self) -> None:
        """A checkpoint was written: the clock starts again, and a stop signal's deadline is met."""
        self.last_save = time.monotonic()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def after_step(self, compute_s: float = 0.0) -> tuple[list[int], bool, list[float]]:
        """Collective, every rank after each step: (ranks that received a stop signal, whether rank 0's
        save_every_minutes clock is due, every rank's ``compute_s``: training/straggler.py), the same on
        every rank."""
        world = dist.get_world_size()
        values = torch.zeros(2 * world + 1, dtype=torch.float64, device=self.device)  # [2W+1]: each rank's slots
        values[self.rank] = float(self.received is not None)
        values[world + 1 + self.rank] = compute_s
        if self.rank == 0 and self.save_every_s > 0:
            values[world] = float(time.monotonic() - self.last_save >= self.save_every_s)
        dist.all_reduce(values)
        values = values.tolist()
        return [r for r in range(world) if values[r]], bool(values[world]), values[world + 1 :]
