"""The straggler view: how long each rank computed in a step, so the slowest one is named.

In a synchronous step every rank's wall time is the same (each waits for the slowest at the next send,
receive or all-reduce), so the wall clock cannot name a straggler. ``ComputeClock`` times the pipeline
engine's compute instructions only (load micro-batch, forward, backward, DualPipeV's deferred weight gradients,
optimizer step; not send, receive
or the gradient reduction): on a GPU with CUDA events (the kernels' own time, read once at the end of the
step), on CPU with the wall clock. The per-step agreement (training/resilience/preemption.py) gathers every rank's
seconds; metrics.jsonl and the progress line show the slowest rank and the median.
"""

from __future__ import annotations

import time

import torch

COMPUTE = (
    "_exec_load_micro_batch",
    "_exec_forward_pass",
    "_exec_backward_pass",
    "_exec_weight_pass",
    "_exec_optimizer_step",
)


class ComputeClock:
    """This rank's compute seconds in the current step (``take`` returns them and starts again)."""

    def __init__(self):
        from parallel.dualpipev import wrap_instructions

        self.cuda = torch.cuda.is_available()
        self.seconds, self.events = 0.0, []
        wrap_instructions(COMPUTE, lambda fn: self._timed(getattr(fn, "__wrapped_compute__", fn)))

    def _timed(self, fn):
        def timed(engine, *args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return fn(engine, *args, **kwargs)
                finally:
                    end.record()
                    self.events.append((start, end))
            began = time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        timed.__name__, timed.__wrapped_compute__ = fn.__name__, fn  # the engine names instructions by function
        return timed

    def take(self) -> float:
        if self.events:
            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1000
            self.events = []
        seconds, self.seconds = self.seconds, 0.0
        return seconds
