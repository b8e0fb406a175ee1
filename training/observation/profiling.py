"""``profile_steps=[first,last]``: torch.profiler traces of those training steps, one Chrome trace per rank in
``output_dir/profile/rank<R>.pt.trace.json`` (Perfetto and TensorBoard open them; scripts/plot_timeline.py
draws a step, training/observation/timeline.py reads them).

While the profiler runs, every pipeline instruction the engine executes is a named range
(``ForwardPass mb=3``, ``SendGrad mb=1``, ``WeightPass mb=0 phase=1``, ``OptimizerStep``: timeline.range_name),
inside a range named by the schedule (``TrainSchedule``, ``ZeroBubbleDualPipeVSchedule``) inside one named
``train step N``. The ranges come from wrapping the engines' instruction maps (parallel/dualpipev.py's
``wrap_instructions``, which benchmarks/bench_train.py's ``--profile`` times through too) and
``PipelineEngine._exec_schedule``, only between the profiler's start and stop: no cost in any other step.
"""

from __future__ import annotations

import functools
import os
from collections import Counter, deque
from collections.abc import Callable
from contextlib import contextmanager

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.profiler import ProfilerActivity, profile, record_function

from parallel.dualpipev import LlamaDualPipeVEngine, wrap_instructions
from training.observation.logs import log0, native_lines_dropped
from training.observation.timeline import PROFILE_DIR, STEP_RANGE, TRACE_NAME, range_name
from training.resilience.all_ranks import WriteFailed, disk_full_cause, writing


def profile_problems(steps: list[int]) -> list[str]:
    """What is wrong with the form of ``profile_steps``, each with the fix (against the run's steps:
    training/configuration/step_range.py)."""
    if not steps:
        return []
    if len(steps) != 2:
        return [
            f"profile_steps {list(steps)} must be two steps [first, last], e.g. profile_steps=[2,3] ([] = no profile)"
        ]
    first, last = steps
    problems = []
    if first < 1:
        problems.append(f"profile_steps {list(steps)} starts at step {first}: steps count from 1, set first >= 1")
    if first > last:
        problems.append(f"profile_steps {list(steps)} descends: set [first, last] with first <= last")
    return problems


def engine_instructions() -> dict:
    """Every instruction function of the engines train.py may run (PipelineEngine, DualPipeVEngine and our
    LlamaDualPipeVEngine, each with its own map), to the name of its instruction class."""
    return {
        fn: instruction.__name__
        for cls in LlamaDualPipeVEngine.__mro__
        for instruction, fn in vars(cls).get("_INSTRUCTION_MAP", {}).items()
    }


class InstructionNames:
    """Names the range of each instruction as it runs. A schedule runs each kind of instruction (per DualPipeV
    phase) in micro-batch order, so the count of earlier ones of its kind in this schedule is its micro-batch
    (the buffer ids are slots, reused); a ``WeightPass`` computes the oldest deferred backward pass's weights."""

    def __init__(self):
        self.counts, self.deferred = Counter(), deque()

    def reset(self) -> None:
        self.counts.clear()
        self.deferred.clear()

    def __call__(self, instruction: str, kwargs: dict) -> str:
        phase = kwargs.get("phase")
        if "buffer_id" in kwargs:
            micro_batch = self.counts[instruction, phase]
            self.counts[instruction, phase] += 1
            deferred = bool(kwargs.get("defer_weights"))
            if deferred:
                self.deferred.append((micro_batch, phase))
            return range_name(instruction, micro_batch, phase, deferred)
        if instruction == "WeightPass" and self.deferred:
            return range_name(instruction, *self.deferred.popleft())
        return instruction


def instrument() -> Callable[[], None]:
    """Make every pipeline instruction (and each schedule) a profiler range; returns the function that undoes it."""
    names, functions = InstructionNames(), engine_instructions()

    def ranged(fn):
        instruction = functions[fn]

        @functools.wraps(fn)
        def run(self, *args, **kwargs):  # the engines call self._exec_instr(**cmd.kwargs)
            with record_function(names(instruction, kwargs)):
                return fn(self, *args, **kwargs)

        run.profiler_range = True
        return run

    every = {fn.__name__ for fn in functions}
    wrap_instructions(every, ranged)
    schedule = PipelineEngine._exec_schedule

    def ranged_schedule(self, pipe_schedule):
        names.reset()
        with record_function(type(pipe_schedule).__name__):
            return schedule(self, pipe_schedule)

    PipelineEngine._exec_schedule = ranged_schedule

    def undo() -> None:
        PipelineEngine._exec_schedule = schedule
        wrap_instructions(every, lambda fn: fn.__wrapped__ if getattr(fn, "profiler_range", False) else fn)

    return undo


class StepProfiler:
    """The profiler of training steps ``first..last`` (training/loop.py wraps each step in :meth:`step`)."""

    def __init__(self, steps: list[int], output_dir: str, rank: int):
        self.first, self.last = steps if steps else (0, -1)
        self.path = os.path.join(output_dir, PROFILE_DIR, TRACE_NAME.format(rank))
        # a window behind a resumed run's start: training/configuration/step_range.py says so
        self.profiler, self.undo = None, None

    @contextmanager
    def step(self, step: int):
        """Run training step ``step``: under the profiler from ``first`` (or the first step of a resumed run)
        to ``last``, whose end writes the trace."""
        if not self.first <= step <= self.last:
            yield
            return
        if self.profiler is None:
            self.start()
        with record_function(STEP_RANGE.format(step)):
            yield
        if step == self.last:
            self.close()

    def start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.undo = instrument()
        self.profiler = profile(activities=activities)
        with native_lines_dropped():  # the profiler's start line, on every rank (training/observation/logs.py)
            self.profiler.start()

    def close(self) -> None:
        """Stop and write the trace (also a run that ends or fails before ``last``: the steps it profiled)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        with native_lines_dropped():
            profiler.stop()
        self.undo()
        with writing(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            profiler.export_chrome_trace(self.path)
            check_trace_written(self.path)
        log0(
            f"profile of steps {self.first}..{self.last} written per rank to {os.path.dirname(self.path)} "
            f"({TRACE_NAME.format('<R>')}: open in https://ui.perfetto.dev or TensorBoard); "
            f"scripts/plot_timeline.py {os.path.dirname(os.path.dirname(self.path))} draws a step"
        )


def check_trace_written(path: str) -> None:
    """The profiler's native export says nothing when its write fails (a full disk leaves an empty or cut trace):
    a trace that does not end as its JSON does (``}``) raises :class:`WriteFailed`, the cause the disk's if full."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 64))
        whole = f.read().rstrip().endswith(b"}")
    if not whole:
        cause = disk_full_cause(path) or "the profiler wrote an incomplete trace and said nothing (check the disk)"
        raise WriteFailed(path, f"{cause}; {size} bytes written")
