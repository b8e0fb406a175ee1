"""deepspeed train.py trains Llama 4's text model exactly as Hugging Face would.

Pipe 2 x data 1 on 2 CPU ranks, five fp32 steps (two runs: the per-document attention with ZeRO-1; the dense mask with
ZeRO-0 and activation checkpointing), against a single-process ``Llama4ForCausalLM`` + torch AdamW loop over the same
global batches (packed SFT rows of 128 tokens, micro-batches of one row, the step's loss normalised as Trainer does:
``num_items_in_batch``).

The tiny config (models/tiny.py) puts each of Llama 4's differences on the run: chunks of 8 positions on layers 0-2,
layer 3 without RoPE with temperature tuning from position 7, routed layers 1 and 3 (one on each stage, top 1 of 4
experts and a shared expert). Llama4ForCausalLM adds no router loss, so the loss is the cross entropy alone. Two
reference loops that each get one difference wrong (no shared expert; full attention on the chunked layers) miss the
run by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.sampling import MicroBatchIterator
from models.families import load_config
from models.files.hf_convert import hf_to_stages
from models.loss import label_tokens
from models.tiny import write_uneven_sft
from tests.support.models import make_hf_dir
from tests.support.parity import SFT_OPTIM, STEPS, cached_rows, max_rel_weight_diff, parity_args, rel, trained_weights
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

REL_TOL = 1e-6
SEQ, MICRO, GAS, DP = 128, 1, 4, 1
# AdamW's eps 1e-6 instead of 1e-8: this model has weights whose gradient is ~1e-9 (a layer-0 v_proj entry: 3e-9 at
# step 1), where Adam's update g / (sqrt(v) + eps) turns fp32 reduction-order noise into whole steps. Measured on these
# batches, Hugging Face's own loop with sdpa against the same loop with eager attention: weights 1.1e-5 relative apart
# at eps 1e-8 (2.4e-6 at 1e-7), 2.8e-7 at 1e-6; so at 1e-8 no implementation could be held to REL_TOL on the weights.
OPTIM = dict(SFT_OPTIM, eps=1e-6)
RUNS = {  # name: train.py overrides
    "documents": dict(ds_config="zero1"),
    "dense_mask": dict(attention="dense_mask", ds_config="zero0", activation_checkpoint_interval=1),
}


def reference_run(hf_dir: str, steps: list[list], variant: str | None = None):
    """The single-process loop: per micro-batch Hugging Face's loss with ``num_items_in_batch`` (the step's label
    tokens); AdamW (eps 1e-6, OPTIM), no clipping. ``variant``: ``no_shared_expert`` (each MoE layer's shared expert
    outputs zeros) or ``full_attention`` (every layer attends to its whole document, no chunks)."""
    overrides = {"layer_types": ["full_attention"] * 4} if variant == "full_attention" else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa", **overrides)
    if variant == "no_shared_expert":
        for layer in model.model.layers:
            if layer.is_moe_layer:
                layer.feed_forward.shared_expert.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    cfg = TrainConfig(optim=OptimConfig(**OPTIM))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    losses = []
    for micro_batches in steps:
        n = torch.tensor(sum(label_tokens(labels) for _, labels in micro_batches))
        loss = 0.0
        for (input_ids, position_ids), labels in micro_batches:
            out = model(
                input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False, num_items_in_batch=n
            )
            loss = loss + out.loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def computed_batches(rows) -> list[list]:
    """Per step, the micro-batches as train.py computes on them: each cut to its longest row (a multiple of 8)."""
    iterators = [MicroBatchIterator(rows, MICRO, r, DP, False, 0, pad_multiple=8) for r in range(DP)]
    return [[next(it) for it in iterators for _ in range(GAS)] for _ in range(STEPS)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("llama4")
    data = str(root / "train.jsonl")
    write_uneven_sft(data, 200, seed=0)
    hf_dir = make_hf_dir(root, tokenizer_dir, "llama4-hf", model_type="llama4_text")
    hf_to_stages(hf_dir, str(root / "llama4-ckpt"))
    for name, overrides in RUNS.items():
        # fmt: skip
        args = parity_args(
            str(root / "llama4-ckpt"),
            data,
            str(root / name),
            SEQ,
            MICRO,
            STEPS,
            OPTIM,
            num_stages=2,
            gradient_accumulation_steps=GAS,
            partition_method="uniform",
            **overrides,
        )
        train_run(root, name, 2, args + ["data.format=sft", "data.packing=true"])
    steps = computed_batches(cached_rows(str(root / "cache"), data))
    return {"root": root, "hf": hf_dir, "steps": steps, "ref": reference_run(hf_dir, steps)}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_llama4_training_equals_its_hugging_face_loop(run, name):
    losses, model = run["ref"]
    assert type(model).__name__ == "Llama4ForCausalLM"
    metrics = read_metrics(str(run["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    weight_diff = max_rel_weight_diff(trained_weights(str(run["root"] / name), load_config(run["hf"])), model)
    print(f"llama4_text {name}: vs Llama4ForCausalLM loop: loss {loss_diff:.2e}, weights {weight_diff:.2e} relative")
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    assert losses[-1] < losses[0] - 0.05  # the run learns: the comparison is not over a frozen model
    log = (run["root"] / f"{name}.log").read_text()
    assert "(model_type llama4_text), 4 decoder layers | partition_method=uniform" in log
    # layers 0-2 | layer 3: a routed layer on each stage (1, 3), the layer without RoPE on the second
    assert "rank 0: stage 0 specs 0..3 " in log and "rank 1: stage 1 specs 4..6 " in log
    assert ("activation checkpointing every 1 decoder layer(s)" in log) == (name == "dense_mask")


def test_the_rows_exercise_chunks_and_temperature_tuning(run):
    """Documents restart mid-row and run past the chunk of 8 and past floor_scale 8 (temperature tuning)."""
    rows = [position_ids[0] for (_, position_ids), _ in run["steps"][0]]  # step 1's rows, [S] each
    assert sum((row[1:] == 0).sum().item() for row in rows) >= len(rows) // 2
    assert max(row.max().item() for row in rows) >= 4 * 8


@pytest.mark.parametrize("variant", ["no_shared_expert", "full_attention"])
def test_a_loop_that_gets_llama4_wrong_misses_by_far_more_than_the_tolerance(run, variant):
    wrong, _ = reference_run(run["hf"], run["steps"], variant)
    metrics = read_metrics(str(run["root"] / "documents"))
    miss = max(rel(m["loss"], r) for m, r in zip(metrics, wrong))
    print(f"{variant}: {miss:.2e} relative from the run")
    assert miss > 100 * REL_TOL
