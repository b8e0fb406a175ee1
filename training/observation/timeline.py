"""Reading back the traces ``profile_steps`` writes (training/observation/profiling.py): one training step's pipeline
instructions per rank, as boxes on a common time axis, and each rank's bubble (scripts/plot_timeline.py draws
them). Plain JSON, no torch: the script runs anywhere the trace files are copied to.

A trace is torch.profiler's Chrome trace (``output_dir/profile/rank<R>.pt.trace.json``). What is read from it:
the ranges ``train step N`` (one per profiled step) and the ranges named by a pipeline instruction
(``ForwardPass mb=3``, ``BackwardPass mb=2 phase=1``: :func:`range_name`), events of category ``user_annotation``
(host time). On a GPU, where host ranges only time the kernel launches, also the kernels: each is matched to its
launch (the runtime call of the same correlation id), which places it in a host range; an instruction's box then
spans the kernels launched in it, and each step's kernel time is summed by kind (:class:`KernelTime`).
"""

from __future__ import annotations

import bisect
import json
import operator
import os
import re
from dataclasses import dataclass, field

PROFILE_DIR = "profile"  # under output_dir
TRACE_NAME = "rank{}.pt.trace.json"  # torch-tb-profiler's worker.pt.trace.json: TensorBoard's profile plugin reads it
TRACE_PATTERN = re.compile(r"^rank(\d+)\.pt\.trace\.json$")
STEP_RANGE = "train step {}"
STEP_PATTERN = re.compile(r"^train step (\d+)$")

# Each pipeline instruction the engines run (DeepSpeed 0.19.8's PipelineEngine and DualPipeVEngine, our
# WeightPass), by the kind the timeline colours it; a test checks every instruction of the engines is here.
INSTRUCTION_KINDS = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "WeightPass": "weight",
    "SendActivation": "send/recv",
    "RecvActivation": "send/recv",
    "SendGrad": "send/recv",
    "RecvGrad": "send/recv",
    "CommitP2P": "send/recv",  # DualPipeV's queued sends and receives run (and are waited for) here
    "OptimizerStep": "optimizer",
    "LoadMicroBatch": "other",
    "ReduceGrads": "other",  # the data-parallel all-reduce
    "ReduceTiedGrads": "other",
}
KINDS = ("forward", "backward", "weight", "send/recv", "optimizer", "other")
# The bubble: time in the step a rank spends waiting for a peer, which with blocking point-to-point
# communication (gloo; DeepSpeed's 1F1B sends and receives block) is the time inside send/recv, plus the time
# between instructions (the loss broadcast at the step's end, the engine's own bookkeeping).
WAITING_KINDS = ("send/recv",)


# A GPU kernel's kind, by its name (the first pattern that matches; none: "elementwise/reduction"): where a GPU
# step's time goes. cuBLAS's Hopper kernels are named nvjet_* or sm90_xmma_*, flash attention's *flash*/*fmha*,
# a Triton kernel (torch.compile's triton_*, Liger's _*_kernel) by its bare function name.
KERNEL_KINDS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("Triton (compiled, Liger)", re.compile(r"^[A-Za-z_]\w*$")),
)
OTHER_KERNELS = "elementwise/reduction"
COPIES = "memory copies"
KERNEL_CATEGORIES = {"kernel": None, "gpu_memcpy": COPIES, "gpu_memset": COPIES}
API_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the host's CUDA calls: launches, synchronisations


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), OTHER_KERNELS)


@dataclass
class KernelTime:
    """One rank's GPU work in one step (microseconds): the kernels its host ranges in the step launched."""

    span: float  # from the first kernel's start to the last one's end
    busy: float  # covered by at least one kernel (streams overlap)
    by_kind: dict[str, float]  # summed durations per kernel kind
    top: list[tuple[str, str, float, int]]  # the longest kernels by summed time: (name, kind, microseconds, launches)
    host: float  # the step's host range
    calls: list[tuple[str, float, int]]  # the CUDA API calls made in it: (name, µs, count)

    def report(self, rank: int, step: int) -> list[str]:
        total = sum(self.by_kind.values()) or 1.0
        kinds = ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1]))
        lines = [
            f"rank {rank} GPU, step {step}: {self.span / 1000:.1f} ms from its first kernel to its last, busy "
            f"{self.busy / self.span:.1%} (idle {1 - self.busy / self.span:.1%}: waiting for the host); "
            f"kernel time by kind: {kinds}"
        ]
        for name, kind, us, count in self.top:
            lines.append(f"  {us / 1000:8.1f} ms {us / total:6.1%} x{count:<5} {kind:<24} {name[:110]}")
        if self.calls:  # where the host blocks: a synchronisation leaves the GPU idle until the next launch
            calls = ", ".join(f"{name} {us / 1000:.1f} ms x{count}" for name, us, count in self.calls)
            host = f"  host: the step's range {self.host / 1000:.1f} ms; CUDA API time in it (all threads): "
            lines.append(host + calls)
        return lines


@dataclass
class Kernel:
    """One kernel (or copy) the device ran, with the host time of the runtime call that launched it."""

    name: str
    kind: str
    launched: float
    start: float
    end: float


def launched_kernels(events: list[dict], shift: float) -> list[Kernel]:
    """The trace's kernels and copies, each matched to its launch (the runtime call of the same ``correlation``),
    by launch time. The launch says which host range a kernel belongs to: the device runs behind the host, and
    autograd's backward launches from a thread of its own, outside the main thread's ranges."""
    launches = {}
    for e in events:
        if e.get("cat") in API_CATEGORIES and isinstance(e.get("args"), dict):
            launches[e["args"].get("correlation")] = float(e["ts"]) + shift
    kernels = []
    for e in events:
        cat = e.get("cat")
        if cat not in KERNEL_CATEGORIES or not isinstance(e.get("args"), dict):
            continue
        at = launches.get(e["args"].get("correlation"))
        if at is not None:
            start = float(e["ts"]) + shift
            kind = KERNEL_CATEGORIES[cat] or kernel_kind(e["name"])
            kernels.append(Kernel(e["name"], kind, at, start, start + float(e["dur"])))
    kernels.sort(key=lambda k: k.launched)
    return kernels


def api_calls(events: list[dict], shift: float) -> list[tuple[float, str, float]]:
    """The trace's CUDA runtime and driver calls, (host start, name, µs), by start."""
    calls = [
        (float(e["ts"]) + shift, e["name"], float(e["dur"]))
        for e in events
        if e.get("cat") in API_CATEGORIES and isinstance(e.get("name"), str)
    ]
    return sorted(calls)


def calls_in(calls: list[tuple[float, str, float]], start: float, end: float, top: int = 5) -> list:
    """The ``top`` API calls made in the host time ``start..end`` by summed time: (name, µs, count)."""
    summed: dict[str, tuple[float, int]] = {}
    at = operator.itemgetter(0)  # a call's host start
    first, last = bisect.bisect_left(calls, start, key=at), bisect.bisect_right(calls, end, key=at)
    for _, name, us in calls[first:last]:
        total, count = summed.get(name, (0.0, 0))
        summed[name] = (total + us, count + 1)
    return [(n, us, c) for n, (us, c) in sorted(summed.items(), key=lambda kv: -kv[1][0])[:top]]


def launched_in(kernels: list[Kernel], start: float, end: float) -> list[Kernel]:
    """The kernels (sorted by launch) launched in the host time ``start..end``."""
    launched = operator.attrgetter("launched")
    return kernels[bisect.bisect_left(kernels, start, key=launched) : bisect.bisect_right(kernels, end, key=launched)]


def kernel_time(kernels: list[Kernel], host: float, calls: list, top: int = 8) -> KernelTime:
    """Where the time of ``kernels`` (one step's, its host range ``host`` µs long, ``calls`` its API calls) went."""
    by_kind, by_name = {}, {}
    for k in kernels:
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.end - k.start
        us, count = by_name.get((k.name, k.kind), (0.0, 0))
        by_name[k.name, k.kind] = (us + k.end - k.start, count + 1)
    span = max(k.end for k in kernels) - min(k.start for k in kernels)
    busy = _covered([Box("kernel", k.start, k.end) for k in kernels])
    longest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return KernelTime(span, busy, by_kind, [(n, kind, us, c) for (n, kind), (us, c) in longest], host, calls)


class TraceError(ValueError):
    """A trace (or a run's profile directory) that cannot give a timeline; the message says why and what to do."""


def range_name(instruction: str, micro_batch: int | None = None, phase: int | None = None, deferred=False) -> str:
    """The profiler range of one executed instruction: ``ForwardPass mb=3``, ``BackwardPass mb=2 phase=1
    inputs-only`` (DualPipeV's deferred weight gradients), ``WeightPass mb=0 phase=1``, ``OptimizerStep``."""
    name = instruction
    if micro_batch is not None:
        name += f" mb={micro_batch}"
    if phase is not None:
        name += f" phase={phase}"
    return name + (" inputs-only" if deferred else "")


def instruction_of(name: str) -> str | None:
    """The instruction a range name is of (its first word), or None for any other range."""
    head = name.split(" ", 1)[0]
    return head if head in INSTRUCTION_KINDS else None


@dataclass
class Box:
    """One executed instruction (times in microseconds on the run's common clock)."""

    name: str
    start: float
    end: float
    at: float | None = None  # where it belongs among the steps: the start of the host range that ran it

    @property
    def kind(self) -> str:
        return INSTRUCTION_KINDS[instruction_of(self.name)]

    @property
    def micro_batch(self) -> int | None:
        return self._field("mb")

    @property
    def phase(self) -> int | None:
        """DualPipeV's phase: 0 on the way out, 1 on the way back (None under 1F1B)."""
        return self._field("phase")

    def _field(self, key: str) -> int | None:
        values = [word.split("=", 1)[1] for word in self.name.split() if word.startswith(f"{key}=")]
        return int(values[0]) if values else None


@dataclass
class RankTrace:
    """What one rank's trace holds: its training steps' ranges and its instruction ranges, on one clock."""

    rank: int
    path: str
    steps: dict[int, tuple[float, float]]
    boxes: list[Box]
    clock: str  # "host" or "device"
    schedules: list[str] = field(default_factory=list)  # the schedule ranges' names, as the engine ran them
    kernels: dict[int, KernelTime] = field(default_factory=dict)  # per step, on a GPU: where its time went


def load_trace(path: str) -> dict:
    """A trace file as JSON, or :class:`TraceError` saying why it is not one."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TraceError(f"{path} is not readable JSON ({e}): not a trace profile_steps wrote, or a cut one") from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path} has no traceEvents list: not a Chrome trace (torch.profiler's export)")
    return trace


def read_trace(trace: dict, path: str, rank: int, origin_ns: int | None = None) -> RankTrace:
    """A loaded trace's steps and instruction ranges, in microseconds since ``origin_ns`` (wall-clock nanoseconds;
    by default the trace's own base time)."""
    # Kineto writes each event's ts as microseconds since the trace's baseTimeNanoseconds, both from the host's
    # wall clock: the ranks' traces share one time axis as far as their hosts' clocks agree (on one machine,
    # exactly). Offsetting by the difference of whole base times keeps the microseconds' fractions in a double.
    base = int(trace.get("baseTimeNanoseconds", 0))
    shift = (base - (base if origin_ns is None else origin_ns)) / 1000
    ranges = {"host": [], "device": []}
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X" or not isinstance(e.get("name"), str):
            continue
        clock = {"user_annotation": "host", "gpu_user_annotation": "device"}.get(e.get("cat"))
        if clock is None:
            continue
        try:
            start, end = float(e["ts"]) + shift, float(e["ts"]) + float(e["dur"]) + shift
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: event {e.get('name')!r} has no numeric ts/dur ({err})") from err
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        ranges[clock].append((e["name"], start, end, args.get("External id")))
    steps, boxes, schedules, launched = {}, [], set(), {}
    for name, start, end, ext in ranges["host"]:
        match = STEP_PATTERN.match(name)
        if match:
            steps[int(match.group(1))] = (start, end)
        elif instruction_of(name):
            boxes.append(Box(name, start, end, start))
            if ext is not None:
                launched[ext] = start
        elif name.endswith("Schedule"):
            schedules.add(name)
    # On a GPU the host ranges time only the kernel launches: an instruction's device box runs from the first to the
    # last kernel launched inside its host range, from any thread (autograd's backward launches from a thread of
    # its own, which Kineto's gpu_user_annotation ranges miss: they stand in only where no kernel is in the trace).
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    kernels = launched_kernels(events, shift)
    device = []
    for box in boxes:
        run = launched_in(kernels, box.start, box.end)
        if run:
            device.append(Box(box.name, min(k.start for k in run), max(k.end for k in run), box.start))
    if not kernels:  # Only the host has the step ranges: a device range's step is that of its External id's range
        device = [Box(n, s, e, launched[x]) for n, s, e, x in ranges["device"] if instruction_of(n) and x in launched]
    clock = "device" if device else "host"
    boxes = device or boxes
    if not steps:
        raise TraceError(
            f"{path} has no '{STEP_RANGE.format('N')}' range: not a trace train.py's profile_steps wrote "
            f"(or one cut before its first step ended)"
        )
    boxes.sort(key=lambda b: b.start)
    calls, per_step = api_calls(events, shift), {}
    for n, (s0, s1) in steps.items():
        if run := launched_in(kernels, s0, s1):
            per_step[n] = kernel_time(run, s1 - s0, calls_in(calls, s0, s1))
    return RankTrace(rank, path, steps, boxes, clock, sorted(schedules), per_step)


def read_run(run_dir: str) -> list[RankTrace]:
    """Every rank's trace in ``run_dir/profile``, by rank, on the clock of the earliest trace."""
    where = os.path.join(run_dir, PROFILE_DIR)
    if not os.path.isdir(where):
        raise TraceError(
            f"{where} does not exist: profile a run with profile_steps=[first,last] (e.g. profile_steps=[2,3]), "
            f"then pass its output_dir"
        )
    found = {int(m.group(1)): os.path.join(where, f) for f in os.listdir(where) if (m := TRACE_PATTERN.match(f))}
    if not found:
        raise TraceError(f"{where} holds no {TRACE_NAME.format('<R>')}: the profiled steps never ended")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise TraceError(f"{where} lacks the traces of rank(s) {missing} (it has ranks {sorted(found)})")
    traces = {r: load_trace(found[r]) for r in sorted(found)}
    origin = min(int(t.get("baseTimeNanoseconds", 0)) for t in traces.values())
    return [read_trace(t, found[r], r, origin) for r, t in traces.items()]


@dataclass
class RankShare:
    """One rank's share of a step: its instructions in the step, the time busy and waiting within the window."""

    rank: int
    boxes: list[Box]
    busy: float  # microseconds inside an instruction that is not a wait
    waiting: float  # microseconds inside send/recv (and not inside a busy one)

    def idle(self, window: float) -> float:
        return window - self.busy

    def bubble(self, window: float) -> float:
        return self.idle(window) / window


@dataclass
class Timeline:
    """One step on every rank: the window from the first instruction any rank starts to the last any rank ends."""

    step: int
    start: float
    end: float
    ranks: list[RankShare]
    clock: str
    schedule: str
    kernels: dict[int, KernelTime] = field(default_factory=dict)  # by rank, on a GPU

    @property
    def window(self) -> float:
        return self.end - self.start

    @property
    def bubble(self) -> float:
        """Idle share of the whole step: all ranks' idle time over ranks x window."""
        return sum(r.idle(self.window) for r in self.ranks) / (len(self.ranks) * self.window)

    def report(self) -> list[str]:
        """The bubble per rank and overall, one line each."""
        w = self.window
        lines = [
            f"rank {r.rank}: bubble {r.bubble(w):.1%} of the step (waiting in send/recv {r.waiting / w:.1%}, "
            f"between instructions {(w - r.busy - r.waiting) / w:.1%}); {len(r.boxes)} instructions"
            for r in self.ranks
        ]
        ranks = f"{len(self.ranks)} rank" + "s" * (len(self.ranks) > 1)
        lines.append(
            f"step {self.step} ({self.schedule}, {ranks}, {self.clock} clock): {w / 1000:.1f} ms "
            f"from the first instruction to the last, bubble {self.bubble:.1%} overall"
        )
        return lines + [line for rank, k in sorted(self.kernels.items()) for line in k.report(rank, self.step)]


def step_timeline(traces: list[RankTrace], step: int | None = None, align: str = "clock") -> Timeline:
    """The timeline of ``step`` (default: the last step every rank profiled). ``align="step"`` starts every
    rank's step at the same time instead (ranks on hosts whose clocks disagree)."""
    common = sorted(set.intersection(*(set(t.steps) for t in traces)))
    if step is None:
        if not common:
            raise TraceError("the ranks' traces have no profiled step in common: " + _steps_of(traces))
        step = common[-1]
    elif step not in common:
        raise TraceError(f"step {step} is not profiled on every rank: " + _steps_of(traces))
    shares = []
    for t in traces:
        s0, s1 = t.steps[step]
        offset = -s0 if align == "step" else 0.0
        boxes = [Box(b.name, b.start + offset, b.end + offset) for b in t.boxes if s0 <= b.at <= s1]
        if not boxes:
            raise TraceError(
                f"{t.path}: step {step} has no pipeline instruction: the run did not use a pipeline engine "
                "(num_stages=1 with ZeRO 2/3 trains with DeepSpeed's data-parallel engine; a plain loop's trace, "
                "benchmarks/bench_train.py --plain-trace-step, has none either), or its trace predates them"
            )
        shares.append(RankShare(t.rank, boxes, 0.0, 0.0))
    start = min(s.boxes[0].start for s in shares)
    end = max(max(b.end for b in s.boxes) for s in shares)
    for s in shares:
        work = [b for b in s.boxes if b.kind not in WAITING_KINDS]
        s.busy = _covered(work)
        s.waiting = _covered(s.boxes) - s.busy
    schedules = sorted({name for t in traces for name in t.schedules if "Inference" not in name})
    kernels = {t.rank: t.kernels[step] for t in traces if step in t.kernels}
    return Timeline(step, start, end, shares, traces[0].clock, ", ".join(schedules) or "schedule unnamed", kernels)


def kernel_report(traces: list[RankTrace], step: int | None = None) -> list[str]:
    """Where each rank's GPU time went in ``step`` (default: the last step every rank has kernels of), for a trace
    with no pipeline instruction to draw (a plain training loop's); [] where the traces hold no kernels of it."""
    common = sorted(set.intersection(*(set(t.kernels) for t in traces)))
    step = (common[-1] if common else None) if step is None else step
    if step not in common:
        return []
    return [line for t in traces for line in t.kernels[step].report(t.rank, step)]


def _covered(boxes: list[Box]) -> float:
    """Microseconds covered by the union of ``boxes``."""
    total, reach = 0.0, float("-inf")
    for b in sorted(boxes, key=lambda b: b.start):
        if b.end > reach:
            total += b.end - max(b.start, reach)
            reach = b.end
    return total


def _steps_of(traces: list[RankTrace]) -> str:
    return "; ".join(f"rank {t.rank} has steps {sorted(t.steps)}" for t in traces)
