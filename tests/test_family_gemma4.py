"""Gemma 4's text model (gemma4_text) through the stages computes what ``Gemma4ForCausalLM`` computes, in one process:
logits, loss and every gradient within 1e-5 (fp32) with per-layer inputs and layers reusing earlier layers' keys and
values, tied and untied, keys as values on full layers, whole and cut in two pieces at every spec, the per-layer
inputs and shared keys/values crossing the cut with their gradients; dropping either at the cut breaks that
tolerance; packed documents equal each document alone; conversion both ways is bit-identical and loads as
``Gemma4ForCausalLM``; what the stages cannot run is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM, Gemma4RMSNorm

from models.attention import DOCUMENT_ATTENTION
from models.config_rules import model_config_problems
from models.families import config_from_dict
from models.family_gemma4 import training_problems
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.llama_pipe import build_sequential, init_weights_
from models.loss import causal_lm_loss
from models.specs import spec_layout
from models.tiny import tiny_config
from tests.support.models import make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import TOL, assert_matches_hf, assert_packed_equals_alone, copy_hf_weights, parity_batch
from training.configuration.schema import TrainConfig
from training.configuration.validate import gemma4_settings

CUT = 3  # specs 0-2 (embedding, the storing layers 0 and 1) on the first piece, the reusing layers 2 and 3 after


def gemma(**overrides):
    """Layers 0, 2 sliding (window 8), 1, 3 full (heads of 32); 2 and 3 reuse 0's and 1's keys and values; per-layer
    inputs of 8."""
    return tiny_config("gemma4_text", **{"vocab_size": 300, "intermediate_size": 96, **overrides})


def reference(config) -> Gemma4ForCausalLM:
    """A random ``Gemma4ForCausalLM`` with random norm weights and layer scalars (Hugging Face's init sets 1). Gemma 4
    scales no scores (its q/k norms do), so the q norms are drawn small: scores of tens would make the per-document
    kernel's fp32 rounding (not a difference of the computation) reach 1e-5 in the logits."""
    hf = Gemma4ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, Gemma4RMSNorm) and m.with_scale:
                m.weight.normal_(1.0, 0.5)
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.mul_(0.3)
            layer.layer_scalar.uniform_(0.5, 1.5)
    return hf


# full layers whose keys serve as values, with KV heads of their own (attention_k_eq_v); reusing layers' MLP doubled
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1, use_double_wide_mlp=True)


@pytest.mark.parametrize(
    "overrides, attention",
    [
        (dict(tie_word_embeddings=True), DOCUMENT_ATTENTION),
        (dict(tie_word_embeddings=False, **K_EQ_V), DOCUMENT_ATTENTION),
        (dict(tie_word_embeddings=True), "sdpa"),
    ],
    ids=["tied", "untied_k_eq_v_double_wide_mlp", "tied_dense_mask"],
)
def test_stages_match_gemma4_for_causal_lm(overrides, attention):
    """Packed rows among the batch's; ``sdpa``: attention=dense_mask, the masks of transformers' mask functions."""
    torch.manual_seed(0)
    config = gemma(**overrides)
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    batch = parity_batch(config.vocab_size, packed=True)
    hf = reference(config)
    assert (hf.model.layers[1].self_attn.v_proj is None) == config.attention_k_eq_v
    worst = assert_matches_hf(config, *batch, attention=attention, hf=hf)
    print(f"gemma4_text {overrides} {attention}: max |stages - Gemma4ForCausalLM| {worst:.1e}")


def sent(outputs: tuple, drop: str | None = None) -> tuple:
    """What the next stage receives after the storing layers: each float tensor a new leaf (DeepSpeed's receive
    buffer); ``drop``: the per-layer inputs or shared keys/values zeroed, or the keys/values' gradient not sent back."""
    received = [t.detach().requires_grad_() if t.is_floating_point() else t for t in outputs]
    if drop == "per_layer_inputs":
        received[2] = torch.zeros_like(received[2]).requires_grad_()
    if drop == "kv_values":
        received[3:] = [torch.zeros_like(t).requires_grad_() for t in received[3:]]
    if drop == "kv_gradient":
        received[3:] = [t.detach() for t in received[3:]]
    return tuple(received)


def run_cut(funcs, input_ids, position_ids, labels, cut: int = CUT, drop: str | None = None):
    """Specs [:cut] and [cut:] run as two stages: the first's outputs cross as new leaves, the loss's backward
    reaches them, their gradients go back into the first piece (DeepSpeed's send and receive of activations and
    gradients). Returns the logits, the loss and what crossed."""
    x = (input_ids, position_ids)
    for f in funcs[:cut]:
        x = f(x)
    assert all(t.is_contiguous() for t in x)  # what a stage sends (torch.distributed.send asks it)
    boundary, received = x, sent(x, drop)
    x = received
    for f in funcs[cut:]:
        x = f(x)
    loss = causal_lm_loss(x, labels)
    loss.backward()
    floats = [(o, r) for o, r in zip(boundary, received) if r.is_floating_point() and r.requires_grad]
    assert all(r.grad is not None for _, r in floats)  # DeepSpeed asserts each float received gets its gradient
    torch.autograd.backward([o for o, _ in floats], [r.grad for _, r in floats])
    return x, loss, boundary


def assert_cut_matches(config, hf, cut: int) -> float:
    """The two pieces' logits, loss and every gradient against ``hf``'s; the largest difference."""
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    logits, loss, _ = run_cut(funcs, input_ids, position_ids, labels, cut)
    hf.zero_grad()
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    ref.loss.backward()
    worst = max((logits - ref.logits).abs().max().item(), abs(loss.item() - ref.loss.item()))
    checked = 0
    for info in spec_layout(config):
        if info.owns_file:
            for key, p in funcs[info.index].named_parameters():
                diff = (p.grad - hf.get_parameter(info.hf_prefix + key).grad).abs().max().item()
                worst, checked = max(worst, diff), checked + 1
    assert checked == len(list(hf.parameters()))
    assert worst < TOL, (cut, worst)
    return worst


def test_a_cut_carries_the_per_layer_inputs_and_shared_keys_values():
    """Cut between the storing layers and the reusing ones: the wire holds the hidden states, positions, per-layer
    inputs [B,S,4,8] and two (keys, values) pairs (sliding [B,2,S,16], full [B,2,S,32]); after the reading layers, only
    what a later layer reads. At every cut, logits, loss and every gradient equal ``Gemma4ForCausalLM``'s."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True)
    hf = reference(config)
    funcs = build_sequential(config)
    shapes = []
    x = parity_batch(config.vocab_size)[:2]
    for f in funcs[:-2]:
        x = f(x)
        shapes.append([tuple(t.shape) for t in x])
    hidden, per_layer, sliding, full = (
        [(3, 40, 64), (3, 40)],
        [(3, 40, 4, 8)],
        [(3, 2, 40, 16)] * 2,
        [(3, 2, 40, 32)] * 2,
    )
    assert shapes == [
        hidden + per_layer,  # the embedding's
        hidden + per_layer + sliding,  # layer 0 stores the sliding pair, read by layer 2
        hidden + per_layer + sliding + full,  # layer 1 stores the full pair, read by layer 3
        hidden + per_layer + full,  # layer 2, the sliding pair's last reader
        hidden,  # layer 3, the last: the final norm takes the hidden states and positions alone
    ]
    worst = {cut: assert_cut_matches(config, hf, cut) for cut in range(1, len(funcs) - 1)}
    print(f"gemma4_text cut before spec 1-5: max |stages - Gemma4ForCausalLM| {max(worst.values()):.1e} ({worst})")


@pytest.mark.parametrize("drop", ["per_layer_inputs", "kv_values", "kv_gradient"])
def test_dropping_a_carried_value_at_the_cut_breaks_the_tolerance(drop):
    """Zeroed per-layer inputs or keys/values change the logits, and keys/values sent without their gradient leave the
    storing layers' k/v projections without what the reusing layers give them: each by orders of magnitude."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True)
    state = reference(config).state_dict()
    right, broken = build_sequential(config), build_sequential(config)
    copy_hf_weights(right, config, state)
    copy_hf_weights(broken, config, state)
    batch = parity_batch(config.vocab_size)
    good, _, boundary = run_cut(right, *batch)
    assert len(boundary) == 7  # hidden, positions, per-layer inputs, the sliding and the full pair
    bad, _, _ = run_cut(broken, *batch, drop=drop)
    if drop == "kv_gradient":
        k_proj = [f.self_attn.k_proj.weight.grad for f in (right[1], broken[1])]
        diff = (k_proj[0] - k_proj[1]).abs().max()
    else:
        diff = (good - bad).abs().max()
    assert diff > 1000 * TOL, diff.item()


def test_packed_documents_equal_each_document_alone():
    """Documents of 13, 20 and 7 tokens, two longer than the window; the reusing layers attend per document too."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, reference(config).state_dict())
    assert_packed_equals_alone(funcs, config.vocab_size)


def test_from_scratch_values_are_hugging_faces():
    """Norms 1 (Gemma 4's scale by weight, not 1 + weight), the v norm without a weight, layer scalars 1."""
    config = gemma(tie_word_embeddings=True)
    funcs = build_sequential(config)
    for f in funcs[1:-2]:
        f.layer_scalar.fill_(5.0)  # what a meta-built layer's buffer may hold
    for i, f in enumerate(funcs[:-1]):
        init_weights_(f, config, seed=i)
    norms = [m for f in funcs[:-1] for m in f.modules() if isinstance(m, Gemma4RMSNorm) and m.with_scale]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert all(f.layer_scalar.item() == 1.0 for f in funcs[1:-2])
    assert not hasattr(funcs[1].self_attn.v_norm, "weight") and not hasattr(funcs[3].self_attn, "k_proj")


def test_what_the_stages_cannot_run_is_refused_by_name():
    config = config_from_dict(
        {
            "model_type": "gemma4_text",
            "final_logit_softcapping": 30.0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 8,
        }
    )
    problems = model_config_problems(config, "model.architecture", override=True)
    assert len(problems) == 2, problems
    assert "final_logit_softcapping 30.0 is not supported" in problems[0]
    assert "enable_moe_block true" in problems[1]
    assert model_config_problems(gemma(), "model.architecture", override=True) == []
    unshared = gemma(layer_types=["sliding_attention"] * 3 + ["full_attention"])  # the full type only among the last
    (line,) = model_config_problems(unshared, "model.architecture", override=True)
    assert "num_kv_shared_layers 2 with layer_types" in line and "num_kv_shared_layers at most 0 (or" in line
    refused = {
        "tensor_parallel": 2,
        "sequence_parallel": 2,
        "pipeline_schedule": "dualpipev",
        "peft.method": "lora",
        "compile": True,
        "train_objective": "grpo",
        "activation_checkpoint_interval": 1,
    }
    lines = training_problems("gemma4_text", refused)
    assert [line.split("=")[0] for line in lines] == list(refused)
    assert training_problems("gemma3_text", refused) == []
    cfg = TrainConfig()  # the defaults: each of these settings off
    assert training_problems("gemma4_text", gemma4_settings(cfg)) == []
    # the parallel axes' settings are asked by their plans (parallel/), the others by validate
    axes = {"tensor_parallel", "sequence_parallel", "pipeline_schedule"}
    assert set(gemma4_settings(cfg)) | axes == set(refused)
    from models.family_gemma4 import axis_problems

    assert all(axis_problems("gemma4_text", key, refused[key]) for key in axes)


@pytest.mark.slow  # beyond stage parity: conversion (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_gemma4(tmp_path, tokenizer_dir):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=torch.bfloat16, model_type="gemma4_text")
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    before, after = hf_tensors(src), hf_tensors(str(tmp_path / "back"))
    assert "model.embed_tokens_per_layer.weight" in after and "model.layers.0.layer_scalar" in after
    assert_bit_identical(before, after)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is Gemma4ForCausalLM
    assert exported.config.kv_sharing_modes == original.config.kv_sharing_modes
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > the window
    assert torch.equal(original(ids).logits, exported(ids).logits)
