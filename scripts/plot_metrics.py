"""Loss, eval loss and learning rate of a run, from its metrics.jsonl, to a PNG.

    python scripts/plot_metrics.py OUTPUT_DIR [--out OUTPUT_DIR/metrics.png]

Lines of metrics.jsonl that are not whole records (the last line of a killed run, lines of two runs
written into one file) are skipped, counted and reported; the rest is plotted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display: draw to a file
import matplotlib.pyplot as plt  # noqa: E402

# The fields each kind of record needs to be plotted; records of other kinds are not plotted.
NEEDED = {"train": ("step", "loss", "lr"), "eval": ("step", "eval_loss")}
SHOWN_LINES = 5  # line numbers named in the skipped-lines warning


def is_record(record) -> bool:
    """Whether a parsed line is a record this script can use: a kind, and numbers where it needs them."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    return all(isinstance(record.get(key), (int, float)) for key in NEEDED.get(record["kind"], ()))


def read_records(path: str) -> tuple[list[dict], list[int]]:
    """(records, numbers of the damaged lines) of a metrics.jsonl; blank lines are neither."""
    records, damaged = [], []
    with open(path, errors="replace") as f:  # undecodable bytes make a line damaged, not the file unreadable
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if is_record(record):
                records.append(record)
            else:
                damaged.append(number)
    return records, damaged


def error(message: str) -> int:
    print(f"plot_metrics.py: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a train.py output_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: <run_dir>/metrics.png)")
    args = p.parse_args(argv)

    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isdir(args.run_dir):
        return error(
            f"{args.run_dir} {'is not a directory' if os.path.exists(args.run_dir) else 'does not exist'}: "
            f"pass a train.py output_dir"
        )
    if not os.path.isfile(path):
        return error(
            f"{path} not found: {args.run_dir} is not a train.py output_dir, or its run has not finished a step"
        )
    records, damaged = read_records(path)
    if damaged:
        shown = ", ".join(map(str, damaged[:SHOWN_LINES])) + (", ..." if len(damaged) > SHOWN_LINES else "")
        where = "line" if len(damaged) == 1 else "lines"
        print(
            f"plot_metrics.py: warning: skipped {len(damaged)} damaged line(s) of {path} ({where} {shown}): "
            f"not a complete metrics record",
            file=sys.stderr,
        )
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        return error(
            f"{path} has no training steps" + (f" ({len(damaged)} damaged line(s) skipped)" if damaged else "")
        )

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", linewidth=1)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(args.run_dir)))
    fig.tight_layout()
    out = args.out or os.path.join(args.run_dir, "metrics.png")
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        return error(f"cannot write {out}: {e.strerror or e}")
    skipped = f", {len(damaged)} damaged line(s) skipped" if damaged else ""
    print(f"[plot] wrote {out} ({len(train)} steps, {len(evals)} evals{skipped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
