"""Shared fixtures: tiny random Llamas on disk, a token file, and a DeepSpeed launcher for CPU ranks."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from models.tiny import save_random_model, tiny_config, train_tokenizer, write_random_tokens  # noqa: E402,F401
from training.distributed import free_port  # noqa: E402,F401 (tests import it from here)

# Multi-rank CPU runs: one thread per rank (2 threads x 4 ranks on 2 cores ran 15-20x slower).
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of the whole CI run
FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others may finish before they are ended


def run_deepspeed(
    num_ranks: int, script: str, args: list[str], log_path: str, launcher: bool = False
) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N script args`` (N CPU ranks) from the repo root; output saved to ``log_path``.

    By default the ranks are started as DeepSpeed's launcher (``deepspeed/launcher/launch.py``) starts
    them, the same environment and command line, but without it: the launcher and its runner each import
    DeepSpeed before any rank starts, 6-8 s per launch on this machine, and the suite launches about 70
    times. As the launcher does, a rank that fails ends the others and its exit status is the job's.
    ``launcher=True`` runs the real ``deepspeed`` command (tests of what the launcher itself prints or
    does; the demo, the multi-node and the killed-rank tests run it too).
    """
    port = free_port()
    env = {**os.environ, **RANK_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    try:
        if launcher:
            cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(num_ranks)]
            cmd += ["--master_port", str(port), script, *args]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        else:
            proc = _run_ranks(num_ranks, script, args, env, port)
    finally:
        # DeepSpeed's CPU shm collectives leave a 66 MB segment per rank in /dev/shm; train.py removes
        # its own, but scripts and killed ranks do not (see training/distributed.py).
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            os.remove(leftover)
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def _run_ranks(num_ranks: int, script: str, args: list[str], env: dict, port: int) -> subprocess.CompletedProcess:
    """The ranks of one node, each ``python -u script --local_rank=R args`` with the launcher's variables,
    their output interleaved into one stdout and one stderr as the launcher's children share its own."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(num_ranks)}
    world.update(CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(num_ranks))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-u", script, f"--local_rank={r}", *args],
                cwd=REPO,
                env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=out,
                stderr=err,
            )
            for r in range(num_ranks)
        ]
        deadline, status, failed_at = time.time() + LAUNCH_TIMEOUT_S, 0, None
        while any(p.poll() is None for p in ranks):
            failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
            if failed and failed_at is None:
                status, failed_at = failed[0], time.time()
            # The launcher ends the others (SIGTERM) once it sees a rank fail; it looks once a second, so
            # ranks failing together still print their own error first.
            if failed_at is not None and time.time() > failed_at + FAILURE_GRACE_S:
                for p in ranks:
                    if p.poll() is None:
                        p.terminate()
            if time.time() > deadline:
                for p in ranks:
                    p.kill()
                    p.wait()
                raise subprocess.TimeoutExpired([script, *args], LAUNCH_TIMEOUT_S)
            time.sleep(0.05)
        status = status or next((p.returncode for p in ranks if p.returncode), 0)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([script, *args], status, out.read(), err.read())


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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """30 text documents: shuffled, packed training data for the multi-rank training-loop runs."""
    from models.tiny import corpus_documents

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for doc in corpus_documents()[:30]:
            f.write(json.dumps({"text": doc}) + "\n")
    return str(path)


LOOP_STEPS = 8


def loop_args(root, out, **overrides) -> list[str]:
    """``run_args`` of a run in run A's directory ``root``: its model (``root/ckpt``), corpus and cache."""
    return run_args(root / "ckpt", root / "corpus.jsonl", out, root / "cache", **overrides)


def run_args(ckpt, corpus: str, out, cache, **overrides) -> list[str]:
    """train.py overrides of run A below (pipe 2 x data 2, ZeRO-1, fp32, shuffled text, eval, monitors)."""
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


@pytest.fixture(scope="session")
def run_a(tmp_path_factory, tiny_hf, corpus):
    """(root, process) of run A: 8 steps on 4 ranks with ``loop_args``, checkpoints 4, 6 and 8 kept in
    ``root/A``. Read only: tests copy it (tests/test_training_loop.py resumes it, tests/test_reshard.py on
    other layouts)."""
    from models.hf_io import hf_to_stages

    root = tmp_path_factory.mktemp("loop")
    hf_to_stages(tiny_hf, str(root / "ckpt"))
    shutil.copy(corpus, root / "corpus.jsonl")
    proc = run_deepspeed(4, "train.py", loop_args(root, root / "A"), str(root / "A.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root, proc
