"""One log line per step from one rank, and ``metrics.jsonl`` beside the checkpoints."""

from __future__ import annotations

import json
import os
import time

from models.checkpoint import peak_rss_mb


class StepLogger:
    """Prints ``step | loss | lr | grad norm | tokens/s | s/step | ETA | peak memory`` and appends JSON.

    Only the rank created with ``active=True`` (global rank 0) writes anything.
    """

    def __init__(self, output_dir: str, max_steps: int, tokens_per_step: int, active: bool):
        self.active = active
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.start = self.last = time.time()
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "w") if active else None

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None) -> None:
        now = time.time()
        step_s, self.last = now - self.last, now
        if not self.active:
            return
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens_per_step,
            "step_s": round(step_s, 4),
            "tokens_per_s": round(self.tokens_per_step / step_s, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        eta = (now - self.start) / step * (self.max_steps - step)
        gn = "n/a" if grad_norm is None else f"{grad_norm:.3f}"
        print(
            f"step {step}/{self.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {gn} | "
            f"{record['tokens_per_s']:.0f} tokens/s | {step_s:.2f} s/step | ETA {eta:.0f} s | "
            f"peak RSS {record['peak_rss_mb']:.0f} MiB",
            flush=True,
        )

    def close(self) -> None:
        if self.file:
            self.file.close()
