"""How long a training step of DeepSpeed's pipeline schedules takes, and what each rank holds, from the
instruction streams DeepSpeed itself generates (``TrainSchedule`` for 1F1B, ``DualPipeVSchedule`` for
DualPipeV; ``.steps()`` per pipeline rank), replayed as an event simulation without any process group.

The model: a rank runs its instructions in order. ``ForwardPass`` / ``BackwardPass`` of a piece take the
given seconds; everything else (loads, sends, receives, reductions, the optimizer step) takes none. A receive
is matched, in order, with the sends of the same (sender, receiver, kind), kind being activations or
gradients of a phase. Sends never wait: the data leaves when the send is issued and arrives at once.
DeepSpeed's 1F1B sends are blocking and pair with the receive, and NCCL's batched ones may wait for the
peer too, so a real step can only be as long or longer; the schedules interleave their sends with the peer's
receives (1F1B's odd/even stages, DualPipeV's one commit per chunk), so the two seldom differ.

- 1F1B: a ``RecvActivation`` / ``RecvGrad`` waits for its send; a send happens when it is issued.
- DualPipeV: sends and receives only queue; ``CommitP2P`` launches the rank's queue as one batch, so its
  sends leave then, and it waits until each of its queued receives' sends has left.

A pipeline rank holds one piece of the model with 1F1B (piece = rank, ``stages`` pieces), two with
DualPipeV: piece ``rank`` (phase 0) and piece ``2 x stages - 1 - rank`` (phase 1), of ``2 x stages``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallel.layout import PIPELINE_SCHEDULES, Layout


def instructions(schedule: str, stages: int, micro_batches: int, rank: int, zero_bubble: bool = False) -> list:
    """DeepSpeed's instructions for pipeline rank ``rank`` in one training step, in order; with ``zero_bubble``,
    DualPipeV's weight gradients split off as train.py runs it (parallel/dualpipev.py)."""
    # Imported here: DeepSpeed brings torch, which the planner's formulas do not need.
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule, TrainSchedule

    from parallel.dualpipev import ZeroBubbleDualPipeVSchedule

    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} unknown: choose one of {list(PIPELINE_SCHEDULES)}")
    dualpipev = ZeroBubbleDualPipeVSchedule if zero_bubble else DualPipeVSchedule
    generator = dualpipev if schedule == "dualpipev" else TrainSchedule
    steps = generator(micro_batches=micro_batches, stages=stages, stage_id=rank).steps()
    return [cmd for step in steps for cmd in step]


@dataclass(frozen=True)
class ScheduleSim:
    """One training step of a schedule (seconds as given). Per rank: ``busy`` seconds computing;
    ``in_flight``: the most micro-batches whose activations a held piece keeps at once (forward done,
    backward not yet), per piece in ``Layout.rank_pieces`` order; ``held``: every combination of those counts
    the rank passes through after a forward, one tuple per combination (what a joint memory peak needs)."""

    schedule: str
    stages: int
    micro_batches: int
    makespan: float
    busy: tuple[float, ...]
    in_flight: tuple[tuple[int, ...], ...]
    held: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """The share of the step each rank waits."""
        return tuple(1 - b / self.makespan for b in self.busy)

    @property
    def idle_share(self) -> float:
        """The pipeline bubble: 1 - total busy / (ranks x makespan)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)


def _channel(schedule: str, cmd, rank: int) -> tuple[int, int, str]:
    """(sender, receiver, kind) of a send or receive instruction of ``rank``."""
    name, phase = type(cmd).__name__, getattr(cmd, "phase", 0)
    activation = name in ("SendActivation", "RecvActivation")
    # Activations flow to higher ranks in phase 0 (and all of 1F1B), to lower ones in phase 1; gradients back.
    downstream = rank + 1 if phase == 0 else rank - 1
    upstream = rank - 1 if phase == 0 else rank + 1
    if name.startswith("Send"):
        peer = downstream if activation else upstream
        return rank, peer, f"{'act' if activation else 'grad'}{phase}"
    peer = upstream if activation else downstream
    return peer, rank, f"{'act' if activation else 'grad'}{phase}"


def simulate(
    schedule: str,
    stages: int,
    micro_batches: int,
    forward_s: list[float],
    backward_s: list[float],
    weight_s: list[float] | None = None,
) -> ScheduleSim:
    """Replay one training step of ``schedule`` on ``stages`` pipeline ranks with ``micro_batches``
    micro-batches; ``forward_s[i]`` / ``backward_s[i]``: seconds of a forward / backward pass of piece i
    (``Layout.pieces`` of them). ``weight_s[i]``: the share of piece i's backward that computes
    weight gradients: given, DualPipeV runs with them split off (a deferred backward takes backward - weight,
    its ``WeightPass`` later takes weight). Raises RuntimeError where no rank can go on (a deadlock)."""
    layout = Layout(stages=stages, schedule=schedule)
    pieces = layout.pieces
    if len(forward_s) != pieces or len(backward_s) != pieces or (weight_s is not None and len(weight_s) != pieces):
        raise ValueError(f"{schedule} on {stages} ranks runs {pieces} pieces: give {pieces} forward and backward times")
    zero_bubble = weight_s is not None and schedule == "dualpipev"
    programs = [instructions(schedule, stages, micro_batches, r, zero_bubble) for r in range(stages)]
    deferred: list[list[int]] = [[] for _ in range(stages)]  # per rank, the pieces of deferred weight gradients
    batched = schedule == "dualpipev"
    sent: dict[tuple[int, int, str], list[float]] = {}  # channel -> arrival time of each send, in order
    taken: dict[tuple[int, int, str], int] = {}  # channel -> receives matched so far
    pc, clock, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    queued_sends: list[list] = [[] for _ in range(stages)]
    queued_recvs: list[list] = [[] for _ in range(stages)]
    held = [[0] * len(layout.rank_pieces(r)) for r in range(stages)]
    peaks = [list(h) for h in held]
    states: list[set[tuple[int, ...]]] = [set() for _ in range(stages)]

    def arrival(channel) -> float | None:
        """When the next receive on ``channel`` can complete; None while its send has not happened."""
        times, n = sent.get(channel, []), taken.get(channel, 0)
        return times[n] if n < len(times) else None

    def step(r: int) -> bool:
        """Run rank r's next instruction if it can; False where it must wait for a send."""
        cmd = programs[r][pc[r]]
        name = type(cmd).__name__
        if name == "WeightPass":
            seconds = weight_s[deferred[r].pop(0)]  # the oldest deferred backward's weights
            clock[r] += seconds
            busy[r] += seconds
        elif name in ("ForwardPass", "BackwardPass"):
            phase = getattr(cmd, "phase", 0)
            piece = layout.rank_pieces(r)[phase]
            seconds = (forward_s if name == "ForwardPass" else backward_s)[piece]
            if cmd.kwargs.get("defer_weights"):
                seconds -= weight_s[piece]
                deferred[r].append(piece)
            clock[r] += seconds
            busy[r] += seconds
            held[r][phase] += 1 if name == "ForwardPass" else -1
            if name == "ForwardPass":
                peaks[r][phase] = max(peaks[r][phase], held[r][phase])
                states[r].add(tuple(held[r]))
        elif name.startswith("Send"):
            channel = _channel(schedule, cmd, r)
            if batched:
                queued_sends[r].append(channel)
            else:
                sent.setdefault(channel, []).append(clock[r])
        elif name.startswith("Recv"):
            channel = _channel(schedule, cmd, r)
            if batched:
                queued_recvs[r].append(channel)
            else:
                at = arrival(channel)
                if at is None:
                    return False
                clock[r] = max(clock[r], at)
                taken[channel] = taken.get(channel, 0) + 1
        elif name == "CommitP2P":
            for channel in queued_sends[r]:  # launched now, whether or not the receives can complete yet
                sent.setdefault(channel, []).append(clock[r])
            queued_sends[r] = []
            waits = {}
            for channel in queued_recvs[r]:
                n = taken.get(channel, 0) + waits.get(channel, 0)
                times = sent.get(channel, [])
                if n >= len(times):
                    return False  # the sends are out; the rank comes back to wait for its receives
                waits[channel] = waits.get(channel, 0) + 1
                clock[r] = max(clock[r], times[n])
            for channel, n in waits.items():
                taken[channel] = taken.get(channel, 0) + n
            queued_recvs[r] = []
        pc[r] += 1
        return True

    while True:
        progressed = False
        for r in range(stages):
            while pc[r] < len(programs[r]) and step(r):
                progressed = True
        if all(pc[r] == len(programs[r]) for r in range(stages)):
            break
        if not progressed:
            stuck = {r: programs[r][pc[r]] for r in range(stages) if pc[r] < len(programs[r])}
            raise RuntimeError(
                f"{schedule} schedule deadlocked ({stages} ranks, {micro_batches} micro-batches): {stuck}"
            )
    leftover = [r for r in range(stages) if queued_recvs[r] or queued_sends[r]]
    unmatched = {c: len(t) - taken.get(c, 0) for c, t in sent.items() if len(t) != taken.get(c, 0)}
    if leftover or unmatched or any(any(h) for h in held) or any(deferred):
        raise RuntimeError(f"{schedule} step left work behind: queues {leftover}, sends {unmatched}, held {held}")
    return ScheduleSim(
        schedule,
        stages,
        micro_batches,
        max(clock),
        tuple(busy),
        tuple(tuple(p) for p in peaks),
        tuple(tuple(sorted(s)) for s in states),
    )


def uniform_times(
    piece_layers: list[int], forward_per_layer: float = 1.0, backward_per_layer: float = 2.0
) -> tuple[list[float], list[float]]:
    """(forward_s, backward_s) per piece when every layer costs the same: a piece's layers times the
    per-layer seconds (backward about twice forward: the gradients of the inputs and of the weights)."""
    return [n * forward_per_layer for n in piece_layers], [n * backward_per_layer for n in piece_layers]


# The share of a decoder layer's backward that computes weight gradients (its matmuls' weight side: about half)
WEIGHT_SHARE = 0.5


@functools.lru_cache(maxsize=None)
def _simulated(schedule: str, stages: int, micro_batches: int, forward: tuple, backward: tuple) -> ScheduleSim:
    weight = [b * WEIGHT_SHARE for b in backward] if schedule == "dualpipev" else None
    return simulate(schedule, stages, micro_batches, list(forward), list(backward), weight)


def simulated(schedule: str, stages: int, micro_batches: int, piece_layers: list[int] | None = None) -> ScheduleSim:
    """:func:`simulate` as train.py runs the schedule (DualPipeV with its weight gradients split off, half of
    each backward) with equal per-layer times (forward 1, backward 2), for pieces of ``piece_layers`` layers
    (None: equal pieces); remembered, as the planner asks for the same layouts often."""
    layers = piece_layers or [1] * Layout(stages=stages, schedule=schedule).pieces
    forward, backward = uniform_times(layers)
    return _simulated(schedule, stages, micro_batches, tuple(forward), tuple(backward))


def bubble_share(
    schedule: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0, weight: float = 1.0
) -> float:
    """The idle share of a step with equal pieces, each forward ``forward`` and backward ``backward`` seconds,
    ``weight`` of it DualPipeV's deferred weight gradients (0: DeepSpeed's DualPipeV, weights inside each
    backward); 1F1B's is (p - 1) / (m + p - 1) whatever they are."""
    pieces = Layout(stages=stages, schedule=schedule).pieces
    split = [weight] * pieces if weight and schedule == "dualpipev" else None
    return simulate(schedule, stages, micro_batches, [forward] * pieces, [backward] * pieces, split).idle_share
