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
