"""deepspeed train.py trains Mistral, Qwen2 and Qwen3 exactly as Hugging Face would: pipe 2 x data 2 on
4 CPU ranks, five fp32 steps, against a single-process ``<Family>ForCausalLM`` + torch AdamW loop
(Trainer's token-normalised loss, ``num_items_in_batch``) over the same global batches.

Each family runs packed SFT data (several documents per row, per-document attention, prompt tokens
masked), and each run adds features on top, so that every feature meets every family across this file
and tests/test_train_parity.py (Llama):

- mistral: a sliding window of 8 tokens, shorter than most documents; activation checkpointing; ZeRO-1;
           ``partition_method=memory`` (the split the planner predicts for this layout).
- qwen2:   tied embeddings (q/k/v biases); sliding window on layers 2-3 (``max_window_layers``);
           ``partition_method=parameters``; ZeRO-1.
- qwen3:   q/k norms; ZeRO-0; ``partition_method=uniform``; a crash after the step-3 checkpoint
           resumed to step 5 (steps 4 and 5 compared with the reference too); DeepSpeed's
           data-parallel engine (num_stages=1, ZeRO-2, dp 2).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from models.families import load_config
from models.files.hf_convert import hf_to_stages
from models.tiny import write_uneven_sft
from tests.support.models import make_hf_dir
from tests.support.parity import (
    MICRO,
    SFT_OPTIM,
    STEPS,
    cached_rows,
    global_batches,
    max_rel_weight_diff,
    parity_args,
    rel,
    sft_reference_run,
    trained_weights,
)
from tests.support.ranks import train_run
from tests.support.runs import read_metrics

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

REL_TOL = 1e-6  # fp32, as tests/test_sft_parity.py
SEQ, GAS, DP = 128, 2, 2  # packed rows of 128 tokens; global batch = micro 2 x grad_acc 2 x dp 2
WINDOW = 8
FAMILY_RUNS = {
    # name: (model_type, config overrides, train.py overrides)
    "mistral": (
        "mistral",
        dict(sliding_window=WINDOW),
        dict(activation_checkpoint_interval=1, ds_config="zero1", partition_method="memory"),
    ),
    "qwen2": (
        "qwen2",
        dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        dict(partition_method="parameters", ds_config="zero1"),
    ),
    "qwen3": ("qwen3", {}, dict(partition_method="uniform", ds_config="zero0", save_steps=3)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("families")
    data = str(root / "train.jsonl")
    write_uneven_sft(data, 200, seed=0)
    out = {"root": root}

    def launch(name: str, ranks: int, ckpt: str, **overrides) -> None:
        args = parity_args(ckpt, data, str(root / name), SEQ, MICRO, STEPS, SFT_OPTIM, **overrides)
        train_run(root, name, ranks, args + ["data.format=sft", "data.packing=true"])

    for name, (model_type, config_overrides, train_overrides) in FAMILY_RUNS.items():
        hf_dir = make_hf_dir(root, tokenizer_dir, f"{name}-hf", model_type=model_type, **config_overrides)
        hf_to_stages(hf_dir, str(root / f"{name}-ckpt"))
        launch(name, 4, str(root / f"{name}-ckpt"), num_stages=2, gradient_accumulation_steps=GAS, **train_overrides)
        out[name] = hf_dir
    # Qwen3, resumed: the step-3 checkpoint as a crash right after saving it would leave the run.
    shutil.copytree(root / "qwen3", root / "qwen3_resumed")
    shutil.rmtree(root / "qwen3_resumed" / f"global_step{STEPS}")
    (root / "qwen3_resumed" / "latest").write_text("global_step3")
    launch(
        "qwen3_resumed",
        4,
        str(root / "qwen3-ckpt"),
        num_stages=2,
        gradient_accumulation_steps=GAS,
        **FAMILY_RUNS["qwen3"][2],
    )
    # Qwen3 on DeepSpeed's data-parallel engine: dp 2 x grad_acc 2, the same global batches.
    launch("qwen3_zero2", 2, str(root / "qwen3-ckpt"), num_stages=1, gradient_accumulation_steps=GAS, ds="zero2")

    steps, *_ = global_batches(cached_rows(str(root / "cache"), data), dp=DP, gas=GAS, steps=STEPS)
    out["steps"] = steps
    for name in FAMILY_RUNS:
        out[f"{name}_ref"] = sft_reference_run(out[name], steps, "tokens")
    return out


def test_packed_rows_hold_several_documents_longer_than_the_window(runs):
    """The data exercises what the families differ in: rows with documents restarting mid-row, and
    documents longer than the window."""
    positions = torch.cat([position_ids for (_, position_ids), _ in runs["steps"][0]])  # [rows of step 1, S]
    restarts = (positions[:, 1:] == 0).sum().item()
    assert restarts >= len(positions) // 2 and positions.max().item() >= 2 * WINDOW, positions


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "qwen3_zero2"])
def test_family_training_equals_its_hugging_face_loop(runs, name):
    family = name.split("_")[0]
    losses, model = runs[f"{family}_ref"]
    assert type(model).__name__ == {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family] + "ForCausalLM"
    metrics = read_metrics(str(runs["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    config = load_config(runs[family])
    weight_diff = max_rel_weight_diff(trained_weights(str(runs["root"] / name), config), model)
    print(
        f"{name}: vs {type(model).__name__} loop: loss {loss_diff:.2e} relative, weights {weight_diff:.2e} relative L2"
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    assert losses[-1] < losses[0] - 0.05  # the run learns: the comparison is not over a frozen model


def test_resumed_run_continues_the_reference_exactly(runs):
    log = (runs["root"] / "qwen3_resumed.log").read_text()
    assert f"steps 4..{STEPS} (resumed from global_step3)" in log
    full, resumed = read_metrics(str(runs["root"] / "qwen3")), read_metrics(str(runs["root"] / "qwen3_resumed"))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full]  # bit-identical, steps 4-5 included
    losses, model = runs["qwen3_ref"]
    assert max(rel(m["loss"], r) for m, r in zip(resumed, losses)) < REL_TOL
    config = load_config(runs["qwen3"])
    assert max_rel_weight_diff(trained_weights(str(runs["root"] / "qwen3_resumed"), config), model) < REL_TOL


def test_each_run_used_the_layout_it_asked_for(runs):
    """The families, partition methods, recomputation and engines above really were used (a setting
    silently ignored would make the parity above prove less than it says)."""
    from parallel.layout import Layout
    from parallel.partition import stage_boundaries
    from training.configuration.schema import TrainConfig

    for name, (model_type, _, overrides) in FAMILY_RUNS.items():
        log = (runs["root"] / f"{name}.log").read_text()
        method = overrides.get("partition_method", "compute")
        assert f"(model_type {model_type}), 4 decoder layers | partition_method={method}" in log
        layout = Layout(2, DP, 1, micro_batch=MICRO, seq_len=SEQ, grad_accum=GAS, checkpointing=True, dtype="fp32")
        layout = dataclasses.replace(layout, loss_chunk=TrainConfig.loss_chunk_tokens)  # what train.py planned
        parts = stage_boundaries(load_config(runs[name]), 2, method, layout)
        for rank in range(4):
            stage = rank // 2  # pipe x data: ranks 0-1 hold stage 0
            assert f"rank {rank}: stage {stage} specs {parts[stage]}..{parts[stage + 1] - 1} " in log, (name, parts)
    assert "activation checkpointing every 1 decoder layer(s)" in (runs["root"] / "mistral.log").read_text()
    assert "engine: DeepSpeedEngine, ZeRO stage 2" in (runs["root"] / "qwen3_zero2.log").read_text()
