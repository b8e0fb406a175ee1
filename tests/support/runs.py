"""Run A's train.py arguments (tests/conftest.py's ``run_a``, resumed by several tests) and a run's metrics."""

from __future__ import annotations

import json
import os

LOOP_STEPS = 8


def read_metrics(output_dir: str, kind: str = "train") -> list[dict]:
    """metrics.jsonl records of one kind (train: one per step, eval: one per evaluation)."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def loop_args(root, out, **overrides) -> list[str]:
    """``run_args`` of a run in run A's directory ``root``: its model (``root/ckpt``), corpus and cache."""
    return run_args(root / "ckpt", root / "corpus.jsonl", out, root / "cache", **overrides)


def run_args(ckpt, corpus: str, out, cache, **overrides) -> list[str]:
    """train.py overrides of run A (pipe 2 x data 2, ZeRO-1, fp32, shuffled text, eval, monitors)."""
    args = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data": "text",
        "data.train_file": corpus,
        "data.max_seq_length": 64,
        "data.cache_dir": cache,
        "data.eval_fraction": 0.1,
        "data.shuffle": "true",
        "num_stages": 2,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": LOOP_STEPS,
        "precision": "fp32",
        "ds": "zero1",
        "optim.scheduler": "cosine",
        "optim.warmup_steps": 2,
        "optim.lr": 2e-3,
        "optim.min_lr": 2e-4,
        "eval_steps": 4,
        "save_steps": 2,
        "save_total_limit": 3,
        "monitor.csv": "true",
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]
