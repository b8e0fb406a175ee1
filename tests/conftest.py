"""Shared fixtures: tiny random Llamas on disk, a token file, and a DeepSpeed launcher for CPU ranks."""

from __future__ import annotations

import gc
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

# The cyclic garbage collector at Python's thresholds (700, 10, 10) walked this process's whole heap (torch,
# transformers, DeepSpeed, peft: millions of objects) 17 times in the fast tier, 0.2-0.5 s each: 4-5 s of it.
# Collected less often, it takes 1.5 s. This process only: the ranks and scripts the tests start are interpreters of
# their own (training/launch.py's fork server too), at the defaults.
gc.set_threshold(50_000, 20, 100)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from models.hf_io import hf_to_stages  # noqa: E402
from models.tiny import save_random_model, tiny_config, train_tokenizer, write_random_tokens  # noqa: E402,F401
from tests import parity  # noqa: E402
from tests.parity import parity_args  # noqa: E402,F401 (tests import it from here)
from training.launch import Launcher, RankJob, deepspeed_command, remove_shm_leftovers  # noqa: E402
from training.ports import free_port  # noqa: E402,F401 (tests import it from here)

# Multi-rank CPU runs: one thread per rank (2 threads x 4 ranks on 2 cores ran 15-20x slower).
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCH_TIMEOUT_S = 600  # a hung collective fails the test instead of the whole CI run
FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others may finish before they are ended
# ... and how long a rank that ignores that SIGTERM lives on (DeepSpeed's launcher: 30 s; ranks here exit in under
# 1 s of it unless stuck, as the hung rank of tests/test_reliability.py is).
KILL_AFTER_S = 5.0
LAUNCHER = Launcher()  # one fork server for the session, started by the first launch


def run_deepspeed(
    num_ranks: int, script: str, args: list[str], log_path: str, launcher: bool = False, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N script args`` (N CPU ranks) from the repo root, ``env`` added to the
    environment; output saved to ``log_path``. By default the ranks are started as DeepSpeed's launcher
    (``deepspeed/launcher/launch.py``) starts them, the same environment and command line, but without it,
    and forked from a process that has imported what they import (training/launch.py): a launch takes 3 s
    here instead of 15. As the launcher does, a rank that fails ends the others and its exit status is the
    job's. ``launcher=True`` runs the real ``deepspeed`` command (tests of what the launcher itself prints or
    does; the demo, the multi-node and the killed-rank tests run it too).
    """
    if not launcher:
        return finish_deepspeed(start_deepspeed(num_ranks, script, args, env), log_path)
    port = free_port()
    try:
        cmd = deepspeed_command(num_ranks, script, args, port)
        proc = subprocess.run(
            cmd, cwd=REPO, env={**child_env(), **(env or {})}, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
        )
    finally:
        remove_shm_leftovers(port)
    return _logged(proc, log_path)


def start_deepspeed(
    num_ranks: int, script: str, args: list[str], env: dict | None = None, port: int | None = None
) -> RankJob:
    """``run_deepspeed``'s ranks (forked), started and not waited for: a test signals a rank (``job.ranks``)
    or reads the output (``job.output()``) while they run, then calls ``finish_deepspeed``."""
    return RankJob(LAUNCHER, num_ranks, script, args, {**child_env(), **(env or {})}, port or free_port())


def finish_deepspeed(job: RankJob, log_path: str) -> subprocess.CompletedProcess:
    """Wait for the ranks of ``start_deepspeed`` as ``run_deepspeed`` does; their output saved to ``log_path``."""
    try:
        proc = job.wait(LAUNCH_TIMEOUT_S, FAILURE_GRACE_S, KILL_AFTER_S)
    finally:
        remove_shm_leftovers(job.port)
    return _logged(proc, log_path)


def _logged(proc: subprocess.CompletedProcess, log_path: str) -> subprocess.CompletedProcess:
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def wait_for_first_step(output_dir) -> None:
    """Wait (up to 300 s) until a running job has logged its first step to ``output_dir/metrics.jsonl``."""
    metrics = os.path.join(str(output_dir), "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(metrics) and _lines(metrics) >= 1):
        time.sleep(0.05)


def _lines(path: str) -> int:
    with open(path) as f:
        return f.read().count("\n")


def train_run(root, name: str, ranks: int, args: list[str], ok: bool = True, launcher: bool = False):
    """``train.py args`` on ``ranks`` CPU ranks (``run_deepspeed``), its output saved to ``root/name.log``;
    with ``ok`` the run must succeed (the log's tail is the failure message). Returns the process."""
    proc = run_deepspeed(ranks, "train.py", list(args), os.path.join(str(root), f"{name}.log"), launcher=launcher)
    if ok:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def child_env() -> dict:
    """This process's environment, one thread per process, the repo on the module path: what launches get."""
    return {**os.environ, **RANK_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def run_script(argv: list[str], env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S):
    """``python argv`` (a script from the repo root, and its arguments) as ``subprocess.run`` would run it with
    ``cwd=REPO, capture_output=True, text=True``: forked from the session's fork server when ``env`` (by
    default this process's, one thread, the repo on the module path) allows it (training/launch.py)."""
    env = child_env() if env is None else env
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        proc = LAUNCHER.start(argv[0], list(argv[1:]), env, out, err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, *argv], code, out.read(), err.read())


def load_entry_point(path: str):
    """An entry-point script (``convert2ckpt.py``, ``scripts/<name>.py``: a path from the repo root) as a module,
    to call its ``main(argv)`` or its own functions in-process. Entry points are scripts, not modules to import:
    nothing else in the repo imports them."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_metrics(output_dir: str, kind: str = "train") -> list[dict]:
    """metrics.jsonl records of one kind (train: one per step, eval: one per evaluation)."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture()
def dynamo_without_guard_timing(monkeypatch):
    """torch.compile's capture (dynamo) without the latency it measures of each graph's guards, for its metrics only:
    a CPU cache flush per graph, 30-80 ms here, a second or two of the tests that compile a layer with
    ``backend="eager"``. What dynamo captures, guards and recompiles is unchanged."""
    from torch._dynamo import guards

    monkeypatch.setattr(guards, "profile_guard_manager", lambda *args: 0.0)


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
def tiny_ckpt(tmp_path_factory, tiny_hf) -> str:
    """``tiny_hf`` converted to layer files, once. Read only: a test that changes a checkpoint converts its own."""
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    hf_to_stages(tiny_hf, path)
    return path


@pytest.fixture(scope="session")
def tiny_tied_ckpt(tmp_path_factory, tiny_tied_hf) -> str:
    """``tiny_tied_hf`` converted to layer files, once. Read only, as ``tiny_ckpt``."""
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny-tied")
    hf_to_stages(tiny_tied_hf, path)
    return path


@pytest.fixture(scope="session")
def parity_pipe(tmp_path_factory, tiny_ckpt) -> dict:
    """The random-token parity run on pipe 2 x data 2 under ZeRO-1 (tests/parity.py's ``train_args``, global
    batch 8 = micro 2 x grad_acc 2 x dp 2), launched once: ``root`` (its data ``root/train.jsonl``, the
    run ``root/pipe``, its log ``root/pipe.log``), ``data``, ``samples``, ``args``, ``proc`` and ``seconds``.
    tests/test_train_parity.py checks it against the reference loop (and trains its other layouts beside it
    in ``root``); tests/test_multinode.py trains the same on two simulated nodes. Neither changes it."""
    root = tmp_path_factory.mktemp("train")
    data = str(root / "train.jsonl")
    samples = write_random_tokens(data, parity.NUM_SAMPLES, parity.SEQ, vocab_size=512)
    args = parity.train_args(tiny_ckpt, data, str(root / "pipe"), **parity.PIPE)
    start = time.time()
    proc = train_run(root, "pipe", 4, args)
    return dict(root=root, data=data, samples=samples, args=args, proc=proc, seconds=time.time() - start)


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
    root = tmp_path_factory.mktemp("loop")
    hf_to_stages(tiny_hf, str(root / "ckpt"))
    shutil.copy(corpus, root / "corpus.jsonl")
    proc = run_deepspeed(4, "train.py", loop_args(root, root / "A"), str(root / "A.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root, proc
