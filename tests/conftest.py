"""Shared fixtures: tiny random Llamas on disk (Hugging Face directories and layer files), a text corpus, and the
training runs several tests read (``parity_pipe``, ``run_a``). The helpers the tests call are in tests/support/."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time

import pytest

# The cyclic garbage collector at Python's thresholds (700, 10, 10) walked this process's whole heap (torch,
# transformers, DeepSpeed, peft: millions of objects) 17 times in the fast tier, 0.2-0.5 s each: 4-5 s of it.
# Collected less often, it takes 1.5 s. This process only: the ranks and scripts the tests start are interpreters of
# their own (tools/launch.py's fork server too), at the defaults.
gc.set_threshold(50_000, 20, 100)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.register_assert_rewrite("tests.support")  # their asserts report as the tests' own do

from models.files.hf_convert import hf_to_stages  # noqa: E402
from models.tiny import train_tokenizer, write_random_tokens  # noqa: E402
from tests.support import parity  # noqa: E402
from tests.support.models import make_hf_dir  # noqa: E402
from tests.support.ranks import run_deepspeed, train_run  # noqa: E402
from tests.support.runs import loop_args  # noqa: E402


@pytest.fixture()
def dynamo_without_guard_timing(monkeypatch):
    """torch.compile's capture (dynamo) without the latency it measures of each graph's guards, for its metrics only:
    a CPU cache flush per graph, 30-80 ms here, a second or two of the tests that compile a layer with
    ``backend="eager"``. What dynamo captures, guards and recompiles is unchanged."""
    from torch._dynamo import guards

    monkeypatch.setattr(guards, "profile_guard_manager", lambda *args: 0.0)


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A process group of this process alone (gloo), as DeepSpeed's engine, its pipeline module and the collectives
    of a rank need."""
    import deepspeed
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    train_tokenizer(path, vocab_size=512)
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
    """The random-token parity run on pipe 2 x data 2 under ZeRO-1 (tests/support/parity.py's ``train_args``, global
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
