"""Loss, eval loss and learning rate of a run, from its metrics.jsonl, to a PNG.

    python scripts/plot_metrics.py OUTPUT_DIR [--out OUTPUT_DIR/metrics.png]
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # no display: draw to a file
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a train.py output_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: <run_dir>/metrics.png)")
    args = p.parse_args()

    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        raise SystemExit(f"{args.run_dir}/metrics.jsonl has no training steps")

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
    fig.savefig(out, dpi=100)
    print(f"[plot] wrote {out} ({len(train)} steps, {len(evals)} evals)")


if __name__ == "__main__":
    main()
