"""One profiled training step as a picture: a row per rank, each pipeline instruction a box of its measured
duration, coloured by kind, the idle time (the bubble) hatched, and the bubble's share printed per rank and
overall.

    python scripts/plot_timeline.py OUTPUT_DIR [--step N] [--out OUTPUT_DIR/profile/timeline_stepN.png]

OUTPUT_DIR is a train.py run trained with ``profile_steps=[first,last]`` (its traces in OUTPUT_DIR/profile).
The bubble of a rank is the share of the step (from the first instruction any rank starts to the last any rank
ends) it spent not computing: waiting in a send/recv (DualPipeV's commit) or between instructions
(training/observation/timeline.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display: draw to a file
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.observation.timeline import (  # noqa: E402
    KINDS,
    PROFILE_DIR,
    Timeline,
    TraceError,
    kernel_report,
    read_run,
    step_timeline,
)

COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "weight": "tab:green",
    "send/recv": "tab:gray",
    "optimizer": "tab:red",
    "other": "tab:purple",
}
LABEL_MIN_SHARE = 0.025  # a box narrower than this share of the window gets no micro-batch label


def pale(colour: str) -> tuple:
    """``colour`` halfway to white (DualPipeV's phase-1 boxes)."""
    return tuple(0.5 + 0.5 * c for c in to_rgb(colour))


def draw(timeline: Timeline, title: str, out: str) -> None:
    """The timeline's picture, to ``out`` (PNG)."""
    rows = len(timeline.ranks)
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.55 * rows))
    t0, window = timeline.start, timeline.window
    phases = False
    for y, share in enumerate(timeline.ranks):
        # the idle background: whatever no computing box covers stays hatched
        ax.broken_barh([(0, window / 1000)], (y - 0.4, 0.8), facecolor="white", edgecolor="0.6", hatch="///", lw=0.5)
        for box in share.boxes:
            waiting = box.kind == "send/recv"
            phases |= box.phase == 1
            ax.broken_barh(
                [((box.start - t0) / 1000, (box.end - box.start) / 1000)],
                (y - 0.4, 0.3 if waiting else 0.8),  # a wait is a thin strip: the idle hatch shows beside it
                facecolor=pale(COLOURS[box.kind]) if box.phase == 1 else COLOURS[box.kind],
                edgecolor="none" if waiting else "black",
                lw=0.3,
            )
            if box.micro_batch is not None and not waiting and (box.end - box.start) / window >= LABEL_MIN_SHARE:
                x = ((box.start + box.end) / 2 - t0) / 1000
                ax.text(x, y, str(box.micro_batch), ha="center", va="center", fontsize=7)
        ax.text(window / 1000 * 1.005, y, f"{share.bubble(window):.0%}", va="center", fontsize=9)
    ax.set_yticks(range(rows), [f"rank {s.rank}" for s in timeline.ranks])
    ax.set_ylim(rows - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, window / 1000 * 1.06)
    ax.set_xlabel(
        f"ms since the step's first instruction ({timeline.clock} clock); numbers: micro-batch; right: bubble"
        + ("; pale: phase 1 (DualPipeV's way back)" if phases else "")
    )
    handles = [Patch(facecolor=COLOURS[k], label=k) for k in KINDS]
    handles.append(Patch(facecolor="white", edgecolor="0.6", hatch="///", label="idle (bubble)"))
    fig.legend(handles=handles, ncol=len(handles), loc="lower center", fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def error(message: str) -> int:
    print(f"plot_timeline.py: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a train.py output_dir profiled with profile_steps=[first,last]")
    p.add_argument("--step", type=int, default=None, help="the step to draw (default: the last profiled)")
    p.add_argument("--out", default=None, help="PNG path (default: <run_dir>/profile/timeline_step<N>.png)")
    p.add_argument(
        "--align",
        choices=("clock", "step"),
        default="clock",
        help="clock: the ranks' own clocks (one machine's, or synchronised hosts'); step: every rank's step "
        "starts at the same time (hosts whose clocks disagree)",
    )
    args = p.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        return error(f"{args.run_dir} is not a directory: pass a train.py output_dir")
    try:
        traces = read_run(args.run_dir)
    except TraceError as e:
        return error(str(e))
    try:
        timeline = step_timeline(traces, args.step, args.align)
    except TraceError as e:
        lines = kernel_report(traces, args.step)  # a plain loop's GPU trace: its kernels, nothing to draw
        if not lines:
            return error(str(e))
        print(f"no picture ({e}); the GPU's side of the step:")
        print("\n".join(lines))
        return 0
    out = args.out or os.path.join(args.run_dir, PROFILE_DIR, f"timeline_step{timeline.step}.png")
    name = os.path.basename(os.path.abspath(args.run_dir))
    title = (
        f"{name}: step {timeline.step}, {timeline.schedule}, {timeline.window / 1000:.1f} ms, "
        f"bubble {timeline.bubble:.1%} overall"
    )
    try:
        draw(timeline, title, out)
    except OSError as e:
        return error(f"cannot write {out}: {e.strerror or e}")
    for line in timeline.report():
        print(line)
    print(f"[plot] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
