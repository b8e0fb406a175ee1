"""ZeRO-3 (num_stages=1) builds the model partitioned and loads it without a full copy per rank.

One 2-rank launch of train.py (tests/ds_scripts/check_zero3_load.py, max_steps=0) on a 407 MiB fp32
model: every parameter is partitioned at build, the weights gathered back equal the layer files, the
rotary buffers are those of the unpartitioned model, from-scratch weights (bf16 and fp32, tied and
untied) equal the unpartitioned initialisation, and each rank's peak RSS at load grows by about its
half of the model plus one layer, less than one full copy (the previous path: every rank built and
loaded the whole model, 1.0 x the model's bytes and more). Resume, export and training numbers of the
same path: tests/test_training_loop.py and tests/test_train_parity.py. About 40 s.
"""

from __future__ import annotations

import json
import re

import pytest

from models.files.hf_convert import hf_to_stages
from models.llama_pipe import model_parameters, spec_parameter_counts
from models.tiny import save_random_model, tiny_config, write_random_tokens
from tests.support.ranks import run_deepspeed

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

RANKS = 2
MIB = 2**20
# A loose bound (issue 17: the tight figure is benchmarks/bench_zero3_load.py's): the target of
# 1.3 x (the rank's partition + the largest layer) plus 64 MiB of allocator and framework noise. Measured
# growth on this model: 276-351 MiB, against 392 MiB for this bound; a full copy per rank holds the whole
# 407 MiB model (the previous path grew 425 MiB).
TARGET_FACTOR, MARGIN_MIB = 1.3, 64
LOAD_LINE = re.compile(r"rank (\d+): stage .* peak RSS at load (\d+) MiB \(before building the stage (\d+) MiB")


def test_zero3_builds_partitioned_and_loads_the_layer_files(tmp_path, monkeypatch):
    # Seven 49 MiB decoder layers, a 32 MiB embedding and LM head: 407 MiB, the largest layer 49 MiB.
    config = tiny_config(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=7,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
    )
    model_mib = model_parameters(config) * 4 / MIB
    bound_mib = TARGET_FACTOR * (model_mib / RANKS + max(spec_parameter_counts(config)) * 4 / MIB) + MARGIN_MIB
    assert bound_mib < model_mib  # a full copy per rank would exceed it

    save_random_model(config, str(tmp_path / "hf"))
    hf_to_stages(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    write_random_tokens(str(tmp_path / "data.jsonl"), 16, 32, vocab_size=512)
    monkeypatch.setenv("ZERO3_CHECK_OUT", str(tmp_path / "check.json"))
    monkeypatch.delenv("BENCH_ZERO3_FULL_BUILD", raising=False)
    args = [
        f"model_name_or_path={tmp_path / 'ckpt'}",
        "num_stages=1",
        "ds=zero3",
        "precision=fp32",
        "max_steps=0",
        f"data.train_file={tmp_path / 'data.jsonl'}",
        "data.max_seq_length=32",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'out'}",
    ]
    proc = run_deepspeed(RANKS, "tests/ds_scripts/check_zero3_load.py", args, str(tmp_path / "log.txt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "engine: DeepSpeedEngine, ZeRO stage 3" in proc.stdout

    for rank in range(RANKS):
        check = json.loads((tmp_path / f"check.json.{rank}").read_text())
        assert check["partitioned"], check
        assert check["loaded"] and check["tensors"] == 2 + 9 * 7 + 1, check  # embed, 7 x 9 per layer, norm, head
        assert check["buffers"], check
        assert check["scratch"] == {"bf16": True, "bf16_tied": True, "fp32": True, "fp32_tied": True}, check

    loads = {int(r): (int(peak), int(before)) for r, peak, before in LOAD_LINE.findall(proc.stdout)}
    assert sorted(loads) == list(range(RANKS)), proc.stdout[-3000:]
    for rank, (peak, before) in loads.items():
        assert peak - before < bound_mib, (rank, peak, before, bound_mib, model_mib)
