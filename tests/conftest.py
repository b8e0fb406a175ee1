"""Shared fixtures: tiny random Llamas on disk, a token file, and a DeepSpeed launcher for CPU ranks."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from models.tiny import save_random_model, tiny_config, train_tokenizer, write_random_tokens  # noqa: E402,F401
from training.distributed import free_port  # noqa: E402,F401 (tests import it from here)

# Multi-rank CPU runs: one thread per rank (2 threads x 4 ranks on 2 cores ran 15-20x slower).
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of the whole CI run


def run_deepspeed(num_ranks: int, script: str, args: list[str], log_path: str) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N script args`` (N CPU ranks) from the repo root; output saved to ``log_path``."""
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = free_port()
    cmd = [launcher, "--num_gpus", str(num_ranks), "--master_port", str(port), script, *args]
    env = {**os.environ, **RANK_ENV}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    finally:
        # DeepSpeed's CPU shm collectives leave a 66 MB segment per rank in /dev/shm; train.py removes
        # its own, but scripts and killed ranks do not (see training/distributed.py).
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            os.remove(leftover)
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def load_entry_point(path: str):
    """An entry-point script (``convert2ckpt.py``, ``scripts/<name>.py``: a path from the repo root) as a module,
    to call its ``main(argv)`` or its own functions in-process. Entry points are scripts, not modules to import:
    nothing else in the repo imports them."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parity_args(ckpt: str, data: str, out, seq: int, micro: int, steps: int, optim: dict, **overrides) -> list[str]:
    """train.py overrides of an fp32 parity run: fixed data order, the tokenized cache beside ``out``."""
    args = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data.train_file": data,
        "data.max_seq_length": seq,
        "data.shuffle": "false",
        "data.cache_dir": os.path.join(os.path.dirname(out), "cache"),
        "micro_batch_size": micro,
        "max_steps": steps,
        "precision": "fp32",
        **{f"optim.{k}": v for k, v in optim.items()},
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]


def read_metrics(output_dir: str, kind: str = "train") -> list[dict]:
    """metrics.jsonl records of one kind (train: one per step, eval: one per evaluation)."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    train_tokenizer(path, vocab_size=512)
    return path


def make_hf_dir(root, tokenizer_dir: str, name: str, dtype=torch.float32, **overrides) -> str:
    """A Hugging Face model directory with a tiny random Llama and the shared tokenizer."""
    path = os.path.join(str(root), name)
    save_random_model(tiny_config(**overrides), path, seed=0, dtype=dtype)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer"):
            with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
                dst.write(src.read())
    return path


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, tokenizer_dir) -> str:
    """Untied 4-layer GQA model, fp32."""
    return make_hf_dir(tmp_path_factory.mktemp("hf"), tokenizer_dir, "tiny")


@pytest.fixture(scope="session")
def tiny_tied_hf(tmp_path_factory, tokenizer_dir) -> str:
    """Tied embeddings (Llama 3.2 style), 4 layers, fp32."""
    return make_hf_dir(tmp_path_factory.mktemp("hf"), tokenizer_dir, "tiny-tied", tie_word_embeddings=True)
