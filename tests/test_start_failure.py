"""A start-up failure on some ranks stops every rank with one clear message (no hang)."""

from __future__ import annotations

import os

import pytest

from models.files.hf_convert import hf_to_stages
from models.llama_pipe import layer_file_name
from models.tiny import write_random_tokens
from tests.support.ranks import run_deepspeed

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks


def test_missing_layer_file_on_one_stage_stops_all_ranks(tmp_path, tiny_hf):
    ckpt, data = str(tmp_path / "ckpt"), str(tmp_path / "train.jsonl")
    hf_to_stages(tiny_hf, ckpt)
    write_random_tokens(data, 16, 16, vocab_size=512)
    os.remove(os.path.join(ckpt, "global_step0", layer_file_name(4)))  # owned by stage 1 (ranks 2, 3)
    proc = run_deepspeed(
        4,
        "train.py",
        [
            f"model_name_or_path={ckpt}",
            f"data.train_file={data}",
            "data.max_seq_length=16",
            "num_stages=2",
            "gradient_accumulation_steps=2",
            "precision=fp32",
            f"output_dir={tmp_path / 'out'}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        str(tmp_path / "log.txt"),
    )
    assert proc.returncode != 0
    assert "initialising stage weights failed on rank(s) 2, 3" in proc.stderr
    assert f"missing layer file {os.path.join(ckpt, 'global_step0', layer_file_name(4))}" in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "latest")  # nothing was trained or saved
