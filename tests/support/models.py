"""Tiny Hugging Face model directories on disk (the session fixtures of tests/conftest.py are made with it)."""

from __future__ import annotations

import os

import torch

from models.tiny import save_random_model, tiny_config


def make_hf_dir(root, tokenizer_dir: str, name: str, dtype=torch.float32, **overrides) -> str:
    """A Hugging Face model directory with a tiny random Llama and the shared tokenizer."""
    path = os.path.join(str(root), name)
    save_random_model(tiny_config(**overrides), path, seed=0, dtype=dtype)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer"):
            with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
                dst.write(src.read())
    return path


def assert_preflight_plans(name: str, tokenizer_dir: str, tmp_path, *overrides: str) -> None:
    """``model=<name>`` (a conf/model entry) passes the preflight on 16 GPUs of 4 stages, the planner's line
    included, with the test tokenizer (its 512 tokens: the vocabulary resized, data/cache.py's vocab_problem)."""
    from training.configuration.preflight import check

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    args = [
        f"model={name}",
        f"model.tokenizer={tokenizer_dir}",
        "model.architecture.vocab_size=512",
        "data=text",
        f"data.train_file={data}",
        "num_stages=4",
        f"output_dir={tmp_path / 'out'}",
        "min_free_disk_gb=0",
        *overrides,
    ]
    lines = check(16, args)
    assert any(line.startswith("planner (scripts/estimate_memory.py), most loaded GPU") for line in lines), lines
