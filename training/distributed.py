"""Start-up steps that must succeed on every rank or fail on every rank.

If one rank fails (a missing layer file, bad data) while the others go on into the next collective,
the job hangs until the collective times out. ``on_all_ranks`` gathers every rank's outcome so all
ranks raise the same error together, naming the ranks that failed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class StartupError(RuntimeError):
    """A start-up step failed on at least one rank; the message names each failing rank."""


def on_all_ranks(step: str, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on every rank; return every rank's result (index = global rank) or raise on all."""
    try:
        outcome = (fn(), None)
    except Exception as e:  # any failure must reach the other ranks, not leave them waiting
        known = type(e).__module__.split(".")[0] in ("models", "data", "training")
        outcome = (None, f"{e}" if known else traceback.format_exc().rstrip())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    errors = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if errors:
        first = errors[0][1]
        ranks = ", ".join(str(r) for r, e in errors if e == first)
        others = [f"rank {r}: {e}" for r, e in errors if e != first]
        raise StartupError("\n".join([f"{step} failed on rank(s) {ranks}: {first}", *others]))
    return [result for result, _ in gathered]
