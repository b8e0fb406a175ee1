"""Progress lines from one rank, and ``metrics.jsonl`` (one record per step and per eval)."""

from __future__ import annotations

import json
import math
import os
import time

from models.checkpoint import peak_rss_mb


class StepLogger:
    """Prints ``step | loss | lr | grad norm | tokens/s | s/step | ETA | peak memory`` every
    ``log_steps`` steps and writes every step to ``metrics.jsonl`` (``kind``: train or eval).

    ``tokens`` and ``tokens/s`` count the real (non-padding) tokens of the global batch, and
    ``label_tokens`` the tokens the loss was taken over (its denominator with loss_normalization=tokens).

    Only the rank created with ``active=True`` (global rank 0) writes anything. When resuming from
    ``start_step``, records of later steps (written after that checkpoint) are dropped first.
    """

    def __init__(self, output_dir: str, max_steps: int, log_steps: int, active: bool, start_step: int = 0):
        self.active, self.max_steps, self.log_steps = active, max_steps, log_steps
        self.start_step = start_step
        self.start = self.last = time.time()
        self.file = None
        if active:
            path = os.path.join(output_dir, "metrics.jsonl")
            kept = []
            if start_step and os.path.isfile(path):
                with open(path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= start_step]
            self.file = open(path, "w")
            self.file.writelines(kept)

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int, label_tokens: int) -> None:
        now = time.time()
        step_s, self.last = now - self.last, now
        if not self.active:
            return
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "label_tokens": label_tokens,
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        self._write(record)
        if step % self.log_steps and step not in (self.start_step + 1, self.max_steps):
            return
        eta = (now - self.start) / (step - self.start_step) * (self.max_steps - step)
        gn = "n/a" if grad_norm is None else f"{grad_norm:.3f}"
        print(
            f"step {step}/{self.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {gn} | "
            f"{record['tokens_per_s']:.0f} tokens/s | {step_s:.2f} s/step | ETA {eta:.0f} s | "
            f"peak RSS {record['peak_rss_mb']:.0f} MiB",
            flush=True,
        )

    def log_eval(self, step: int, loss: float, seconds: float) -> None:
        self.last += seconds  # eval time is not the next step's time
        if not self.active:
            return
        ppl = math.exp(min(loss, 50.0))  # exp overflows past ~709; 50 is already meaningless as a perplexity
        self._write({"kind": "eval", "step": step, "eval_loss": loss, "eval_ppl": ppl, "eval_s": round(seconds, 3)})
        print(f"eval @ step {step} | eval loss {loss:.4f} | perplexity {ppl:.2f} | {seconds:.2f} s", flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
