"""The order guard: in real 4-rank runs (pipe 2 x data 2) of raw text with packing and shuffling, the first and last
stage load the same micro-batches; a run whose last stage reads another order is stopped by the guard."""

from __future__ import annotations

import json
import re

import pytest

from models.tiny import corpus_documents
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_ckpt):
    root = tmp_path_factory.mktemp("order")
    (root / "ckpt").symlink_to(tiny_ckpt)  # read only
    with open(root / "corpus.jsonl", "w") as f:
        for doc in corpus_documents()[:40]:
            f.write(json.dumps({"text": doc}) + "\n")
    return root


def args(root, out: str) -> list[str]:
    return [
        f"model_name_or_path={root / 'ckpt'}",
        f"output_dir={root / out}",
        f"data.train_file={root / 'corpus.jsonl'}",
        "data.format=text",
        "data.max_seq_length=64",
        "data.shuffle=true",
        f"data.cache_dir={root / 'cache'}",
        "num_stages=2",
        "micro_batch_size=2",
        "gradient_accumulation_steps=2",
        "max_steps=4",
        "precision=fp32",
    ]


def test_first_and_last_stage_agree_on_shuffled_packed_text(setup):
    proc = run_deepspeed(4, "train.py", args(setup, "ok"), str(setup / "ok.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # 4 steps x 2 pipelines x 2 micro-batches, compared fingerprint by fingerprint.
    assert (
        "data order check passed: first and last stage of every pipeline loaded the same 16 micro-batches in steps 1..4"
        in proc.stdout
    )
    assert re.search(r"rank 0: tokenized .*corpus.jsonl: 40 records -> 40 examples", proc.stdout)
    assert "rank 1: data reads" in proc.stdout and "rank 2: data reads" in proc.stdout
    assert len(read_metrics(str(setup / "ok"))) == 4


def test_a_mismatched_order_stops_training(setup):
    proc = run_deepspeed(4, "tests/ds_scripts/train_skewed_order.py", args(setup, "skewed"), str(setup / "skewed.log"))
    assert proc.returncode != 0
    message = re.search(
        r"step 1, micro-batch 0: first stage \(rank (\d)\) loaded ([0-9a-f]{16}), "
        r"last stage \(rank (\d)\) loaded ([0-9a-f]{16})",
        proc.stderr,
    )
    assert message, proc.stderr[-3000:]
    assert message.group(1) in "01" and message.group(3) in "23" and message.group(2) != message.group(4)
    assert "rank 0: reusing tokenized cache" in proc.stdout  # the second run reused the first run's cache
