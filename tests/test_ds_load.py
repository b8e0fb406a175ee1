"""A converted directory loads through DeepSpeed's own load_checkpoint and through the per-stage
loader, for 1, 2 and 4 stages, with every weight equal to the Hugging Face original (4 CPU ranks):
Llama untied and tied, and each other family (models/families.py)."""

from __future__ import annotations

import json

import pytest

from models.families import load_config
from models.files.hf_convert import hf_to_stages
from parallel.partition import stage_boundaries
from tests.support.models import make_hf_dir
from tests.support.ranks import run_deepspeed

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

# Each family's difference in the converted files: sliding window (no tensors of its own), q/k/v biases
# with a tied embedding, per-head q/k norms.
FAMILY_MODELS = {
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", {}),
}


def test_converted_checkpoint_loads_for_1_2_4_stages(tmp_path, tokenizer_dir, tiny_hf, tiny_tied_hf):
    models = {"untied": tiny_hf, "tied": tiny_tied_hf}
    for name, (model_type, overrides) in FAMILY_MODELS.items():
        models[name] = make_hf_dir(tmp_path, tokenizer_dir, f"{name}-hf", model_type=model_type, **overrides)
    args = [str(tmp_path / "result.json")]
    for name, hf_dir in models.items():
        hf_to_stages(hf_dir, str(tmp_path / name))
        args += [str(tmp_path / name), hf_dir]
    proc = run_deepspeed(4, "tests/ds_scripts/check_load.py", args, str(tmp_path / "log.txt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    ranks = [json.loads((tmp_path / f"result.json.{r}").read_text()) for r in range(4)]
    for name, hf_dir in models.items():
        ckpt = str(tmp_path / name)
        for num_stages in ("1", "2", "4"):
            covered = set()
            # The planner's split (computed without a process group) is the one the ranks made.
            planned = stage_boundaries(load_config(hf_dir), int(num_stages))
            for rank in ranks:
                r = rank[ckpt][num_stages]
                assert r["parts"] == planned, (ckpt, num_stages, r["parts"], planned)
                assert r["deepspeed"] and r["ours"], r
                assert all(r["deepspeed"].values()), (ckpt, num_stages, r)
                assert all(r["ours"].values()), (ckpt, num_stages, r)
                covered |= set(r["specs"])
            assert covered == set(range(4 + 3)), (ckpt, num_stages)  # embed + 4 layers + norm + head
