"""Hangs are named, not waited out: a step that runs past its bound dumps every rank's Python stacks.

A watchdog thread on each rank times the step in flight (no collective: the ranks may be stuck in one). Past
``hang_timeout_s`` (0: ``HANG_MULTIPLE`` x the median step so far, at least ``HANG_FLOOR_S``) it writes all of
its threads' stacks (faulthandler) to ``output_dir/hang/rank<R>.txt``; rank 0 then reads every rank's file
(the output_dir is shared) and prints, once, where each rank is: the pipeline instruction and the
collective of its main thread's stack (also written to ``output_dir/hang/report.txt``). With
``hang_action=exit`` every rank then exits with ``HANG_EXIT_CODE``, quietly (a peer that left first makes
the others' collectives fail: that is no news); with ``wait`` they keep waiting (dist_timeout_s applies).
Checkpoint saves and evaluations are not timed, and the exit waits for a save in progress (``saving``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import statistics
import sys
import threading
import time

from training.resilience.all_ranks import WriteFailed, writing
from training.resilience.preemption import exit_now, exit_quietly_on_signals

HANG_EXIT_CODE = 78
HANG_MULTIPLE, HANG_FLOOR_S = 20, 600.0
WATCH_EVERY_S = 0.5  # how often the watchdog looks at the step in flight
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "all_to_all", "send", "recv")
FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where(dump: str) -> str:
    """The main thread's place in a faulthandler dump: its pipeline instruction (DeepSpeed's ``_exec_*``), its
    collective, and its innermost frame."""
    threads = dump.split("\n\n")
    main = next((t for t in threads if "<module>" in t), threads[-1])
    frames = [m.groupdict() for m in FRAME.finditer(main)]  # innermost first
    if not frames:
        return "no stack"
    parts = []
    instruction = next((f["func"] for f in frames if f["func"].startswith("_exec_")), None)
    if instruction:
        parts.append(f"pipeline instruction {instruction}")
    collective = next((f["func"] for f in frames if "distributed" in f["path"] and f["func"] in COLLECTIVES), None)
    if collective:
        parts.append(f"in {collective}")
    top = frames[0]
    parts.append(f"at {os.path.basename(top['path'])}:{top['line']} {top['func']}")
    return ", ".join(parts)


class HangWatch:
    """This rank's watchdog: ``step_started``/``step_ended`` around each step (see the module)."""

    def __init__(self, output_dir: str, rank: int, world: int, timeout_s: float, action: str):
        self.dir, self.rank, self.world, self.fixed, self.action = (
            os.path.join(output_dir, "hang"),
            rank,
            world,
            timeout_s,
            action,
        )
        self.steps: list[float] = []
        self.started: float | None = None
        self.step = 0
        self.fired = False
        self.dump_error: str | None = None  # this rank's stacks could not be written (a full disk)
        self.no_exit = threading.Lock()  # held around checkpoint saves: an exit waits for the save in progress
        threading.Thread(target=self._watch, daemon=True, name="hang-watch").start()

    def timeout_s(self) -> float:
        if self.fixed > 0:
            return self.fixed
        return max(HANG_FLOOR_S, HANG_MULTIPLE * statistics.median(self.steps)) if self.steps else HANG_FLOOR_S

    def step_started(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()

    def step_ended(self) -> None:
        if self.started is not None:
            self.steps.append(time.monotonic() - self.started)
        self.started = None

    @contextlib.contextmanager
    def saving(self):
        """Around a checkpoint save (not timed: a save may outlast any step): a hang exit from a step that ran
        past its bound but then finished waits for the save, never leaving it half written."""
        with self.no_exit:
            yield

    def _watch(self) -> None:
        while not self.fired:
            time.sleep(WATCH_EVERY_S)
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout_s():
                self.fired = True
                self._dump(time.monotonic() - started)

    def _dump(self, waited: float) -> None:
        path = os.path.join(self.dir, f"rank{self.rank}.txt")
        self.dump_error = None
        try:
            with writing(path):
                os.makedirs(self.dir, exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    f.write(f"rank {self.rank}, step {self.step}, {waited:.0f} s into it\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
                os.replace(path + ".tmp", path)
        except WriteFailed as e:  # rank 0's report names it (its own), or this rank says it in one line
            self.dump_error = e.what
            if self.rank != 0:
                print(f"[train] rank {self.rank}: {e.what}: its stacks are not in the hang report", file=sys.stderr)
        if self.action == "exit":
            exit_quietly_on_signals(HANG_EXIT_CODE)  # the launcher ending the other ranks is no preemption
        if self.rank == 0:
            self._report(waited)
        elif self.action == "exit":  # rank 0 reads this rank's file before the job ends
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and not os.path.exists(os.path.join(self.dir, "report.txt")):
                time.sleep(0.2)
        if self.action == "exit":
            self.no_exit.acquire()  # never released: no save starts after this one, none is cut short
            exit_now(HANG_EXIT_CODE)

    def _report(self, waited: float) -> None:
        deadline = time.monotonic() + 10.0  # the other ranks' watchdogs fire within a second or two
        files = {r: os.path.join(self.dir, f"rank{r}.txt") for r in range(self.world)}
        while time.monotonic() < deadline and not all(os.path.exists(p) for p in files.values()):
            time.sleep(0.2)
        lines = []
        for r, p in files.items():
            if r == self.rank and self.dump_error:
                lines.append(f"  rank {r}: {self.dump_error}")
                continue
            lines.append(f"  rank {r}: {where(open(p).read()) if os.path.exists(p) else 'wrote no stack (gone?)'}")
        then = f"exiting with code {HANG_EXIT_CODE}" if self.action == "exit" else "waiting on (hang_action=wait)"
        report = (
            f"train.py: error: step {self.step} has run {waited:.0f} s, past hang_timeout_s "
            f"({self.timeout_s():.0f} s): every rank's Python stacks are in {self.dir}/; where each rank is:\n"
            + "\n".join(lines)
            + f"\n{then}"
        )
        print(report, file=sys.stderr, flush=True)
        path = os.path.join(self.dir, "report.txt")
        try:
            with writing(path), open(path, "w") as f:
                f.write(report + "\n")
        except WriteFailed as e:  # printed all the same; the other ranks wait for the file 15 s, then exit
            print(f"[train] rank {self.rank}: {e.what}: the report above is its only copy", file=sys.stderr, flush=True)
