"""Mixture-of-Experts families in one process: the routed layers, the stages against ``<Family>ForCausalLM`` with
the router loss (loss and every gradient), and the conversion between per-expert files and fused layer files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from models.families import family_of, load_config, moe_spec
from models.files.hf_convert import ConversionError, hf_to_stages, stages_to_hf
from models.files.pipeline_dir import load_layer_file, read_tag
from models.llama_pipe import build_sequential, layer_file_name
from models.loss import CausalLMLoss
from models.router_loss import RouterLoss
from models.tiny import tiny_config
from tests.support.models import make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import TOL, assert_layer_grads_equal, copy_hf_weights, parity_batch, run_chain

# name: (model_type, config overrides): Qwen3-MoE with a dense first layer (mlp_only_layers), and every other layer
# routed from there (decoder_sparse_step 1); Mixtral, every layer routed. The router loss on, a large coefficient
# (so a wrong router loss shows in the loss).
MOE_CASES = {
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.5)),
    "mixtral": ("mixtral", dict(output_router_logits=True, router_aux_loss_coef=0.5)),
}


def moe_config(name: str, **extra):
    model_type, overrides = MOE_CASES[name]
    return tiny_config(model_type, vocab_size=300, **{**overrides, **extra})


@pytest.mark.parametrize("decoder_sparse_step,mlp_only", [(1, [0]), (2, []), (1, [1, 3])])
def test_routed_layers_are_those_hugging_face_builds(decoder_sparse_step, mlp_only):
    config = tiny_config("qwen3_moe", decoder_sparse_step=decoder_sparse_step, mlp_only_layers=mlp_only)
    with torch.device("meta"):
        hf = family_of(config).causal_lm(config)
    routed = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert moe_spec(config).moe_layers == routed and 0 < len(routed) < 4


def chained_loss(funcs, config, input_ids, position_ids, labels):
    """The stages chained in one process, the loss as the pipeline's last stage computes it (the final norm handing
    the routing statistics to the router loss)."""
    moe = moe_spec(config)
    loss_fn = CausalLMLoss()
    loss_fn.router = RouterLoss(moe.num_experts, moe.top_k, moe.router_aux_loss_coef)
    funcs[-2].router_sink = loss_fn.router.receive  # the norm spec
    return loss_fn(run_chain(funcs, input_ids, position_ids), labels), loss_fn.router


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_moe_stages_with_the_router_loss_match_hf(name):
    """CE + coef x load-balancing loss over every MoE layer of the model, and every gradient (routers included),
    as ``<Family>ForCausalLM(output_router_logits=True)`` computes them for a batch of three rows."""
    torch.manual_seed(0)
    config = moe_config(name)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    loss, router = chained_loss(funcs, config, input_ids, position_ids, labels)
    assert ref.aux_loss is not None and abs(router.loss_sum - ref.aux_loss.item()) < TOL
    assert abs(loss.item() - ref.loss.item()) < TOL
    # the router loss is a visible part of the loss: without it the difference is far beyond TOL
    assert abs((loss - config.router_aux_loss_coef * ref.aux_loss).item() - ref.loss.item()) > 100 * TOL
    ref.loss.backward()
    loss.backward()
    routers = sum(key == "mlp.gate.weight" for key, _ in assert_layer_grads_equal(funcs, hf))
    assert routers == len(moe_spec(config).moe_layers)
    tokens = router.take_metrics()[2]
    assert tokens.sum().item() == input_ids.numel() * config.num_experts_per_tok * routers


def test_without_the_router_loss_the_loss_is_cross_entropy_alone():
    torch.manual_seed(0)
    config = moe_config("qwen3_moe", output_router_logits=False)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    x = run_chain(funcs[:2], input_ids, position_ids)
    assert len(x) == 2  # no routing statistics travel
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    loss = CausalLMLoss()(run_chain(funcs, input_ids, position_ids), labels)
    assert ref.aux_loss is None and abs(loss.item() - ref.loss.item()) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MOE_CASES))
@pytest.mark.slow  # beyond stage parity: conversion, sizes (the full suite; llama's in test_convert)
def test_moe_round_trip_is_bit_identical_and_layer_files_hold_fused_experts(tmp_path, tokenizer_dir, name, dtype):
    model_type, overrides = MOE_CASES[name]
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, model_type=model_type, **overrides)
    on_disk = hf_tensors(src)
    assert any(".experts.3." in k for k in on_disk) and not any("gate_up_proj" in k for k in on_disk)
    hf_to_stages(src, str(tmp_path / "ckpt"))
    config = load_config(src)
    layer = moe_spec(config).moe_layers[0]
    state = load_layer_file(
        os.path.join(tmp_path, "ckpt", read_tag(str(tmp_path / "ckpt")), layer_file_name(1 + layer))
    )
    e, h = config.num_experts if model_type == "qwen3_moe" else config.num_local_experts, config.hidden_size
    assert state["mlp.experts.gate_up_proj"].shape[0] == e and state["mlp.experts.down_proj"].shape[1] == h
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(on_disk, hf_tensors(str(tmp_path / "back")))
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (1, 24))
    assert torch.equal(original(ids).logits, exported(ids).logits)


def test_experts_stored_fused_on_disk_are_refused_naming_the_layout(tmp_path, tokenizer_dir):
    """A checkpoint whose experts are not one tensor per expert (here: fused, as transformers holds them in memory)
    is refused with the layout the converter reads, not converted into something else."""
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", model_type="qwen3_moe")
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    model = AutoModelForCausalLM.from_pretrained(src)
    fused = {k: v for k, v in model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in fused.items()}, path, metadata={"format": "pt"})
    assert set(fused) != set(tensors)
    with pytest.raises(ConversionError, match="one tensor per expert") as e:
        hf_to_stages(src, str(tmp_path / "ckpt"))
    assert "missing tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'" in str(e.value)


def test_quantized_moe_checkpoints_are_refused(tmp_path, tokenizer_dir):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", model_type="mixtral")
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8"}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ConversionError, match="quantized checkpoint"):
        hf_to_stages(src, str(tmp_path / "ckpt"))
