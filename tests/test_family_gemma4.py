"""Gemma 4's text model (gemma4_text) through the stages computes what ``Gemma4ForCausalLM`` computes, in one process:
logits, loss and every gradient within 1e-5 (fp32) with per-layer inputs and layers reusing earlier layers' keys and
values, tied and untied, keys as values on full layers, whole and cut in two pieces at every spec, the per-layer
inputs and shared keys/values crossing the cut with their gradients; dropping either at the cut breaks that
tolerance; packed documents equal each document alone; with ``enable_moe_block`` (a routed expert block beside every
layer's MLP) likewise, without a router loss, as Hugging Face adds none; conversion both ways is bit-identical and
loads as ``Gemma4ForCausalLM``; what the stages cannot run is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM, Gemma4RMSNorm

from models.attention import DOCUMENT_ATTENTION
from models.config_rules import model_config_problems
from models.families import config_from_dict, moe_spec
from models.family_gemma4 import training_problems
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.llama_pipe import build_sequential, init_weights_, model_parameters
from models.loss import causal_lm_loss
from models.moe_counts import active_parameters, moe_shape, parameter_split
from models.specs import spec_layout
from models.tiny import tiny_config
from tests.support.models import assert_preflight_plans, make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import (
    TOL,
    assert_matches_hf,
    assert_packed_equals_alone,
    copy_hf_weights,
    parity_batch,
    run_chain,
)
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
            if config.enable_moe_block:  # the router's scales, 1 from Hugging Face's init
                layer.router.scale.normal_(1.0, 0.5)
                layer.router.per_expert_scale.uniform_(0.5, 1.5)
    return hf


# a routed block beside every layer's MLP: 4 experts of 24, 2 per token
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)


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


def test_stages_match_gemma4_with_the_moe_block():
    """Every layer's router and experts get their gradient (the router's through the top-k weights and its scales),
    within 1e-5 of ``Gemma4ForCausalLM``'s, whole and cut between the storing and the reusing layers."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True, **MOE)
    hf = reference(config)
    worst = assert_matches_hf(
        config, *parity_batch(config.vocab_size, packed=True), hf=hf, learns=("router.", "experts.")
    )
    worst = max(worst, assert_cut_matches(config, hf, CUT))
    print(f"gemma4_text MoE block: max |stages - Gemma4ForCausalLM| {worst:.1e}")


@pytest.mark.slow  # beyond stage parity: the MoE block's loss and routing (the full suite)
def test_the_moe_block_has_no_router_loss_and_its_routing_shows():
    """``Gemma4ForCausalLM``'s loss with ``output_router_logits`` is its cross entropy alone (no router loss, so
    ``moe_spec`` says none and no routing statistics travel); one expert per token instead of two, or the router's
    ``per_expert_scale`` left at 1, moves the logits by orders of magnitude more than the tolerance."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True, **MOE)
    hf = reference(config)
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    out = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False, output_router_logits=True)
    assert len(out.router_logits) == config.num_hidden_layers
    assert out.loss.item() == causal_lm_loss(out.logits, labels).item()
    spec = moe_spec(config)
    assert (spec.router_loss, spec.moe_layers, spec.top_k, spec.num_experts) == (False, (0, 1, 2, 3), 2, 4)
    funcs = build_sequential(config)
    assert all(hasattr(f.get_submodule(spec.experts), "gate_up_proj") for f in funcs[1:-2])
    assert len(funcs[0]((input_ids, position_ids))) == 3  # hidden, positions, per-layer inputs: no statistics
    copy_hf_weights(funcs, config, hf.state_dict())
    right = run_chain(funcs, input_ids, position_ids)
    for wrong, change in (({"top_k_experts": 1}, None), ({}, "per_expert_scale")):
        other = gemma(tie_word_embeddings=True, **{**MOE, **wrong})
        funcs = build_sequential(other)
        copy_hf_weights(funcs, other, hf.state_dict())
        if change:
            for f in funcs[1:-2]:
                f.router.per_expert_scale.data.fill_(1.0)
        assert (run_chain(funcs, input_ids, position_ids) - right).abs().max() > 1000 * TOL, (wrong, change)


def test_moe_block_counts_its_experts():
    """Routed experts: 3 x E x I x H per layer (``gate_up_proj``, ``down_proj``); a token's active parameters count
    top_k / E of them; the router (proj, scale, per_expert_scale) and the MLP beside the experts are dense."""
    config = gemma(tie_word_embeddings=True, **MOE)
    routed, rest = parameter_split(config)
    assert routed == 4 * 3 * 4 * 24 * 64
    dense = parameter_split(gemma(tie_word_embeddings=True))[1]
    assert rest - dense == 4 * (4 * 64 + 64 + 4 + 3 * 64)  # router proj, scale, per_expert_scale; three norms
    assert active_parameters(config) == rest + routed // 2


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
    """Norms 1 (Gemma 4's scale by weight, not 1 + weight), the v norm without a weight, layer scalars 1; with the
    MoE block, the router's scale and per_expert_scale 1, its proj and the experts drawn from N(0, 0.02)."""
    config = gemma(tie_word_embeddings=True, **MOE)
    funcs = build_sequential(config)
    for f in funcs[1:-2]:
        f.layer_scalar.fill_(5.0)  # what a meta-built layer's buffers and parameters may hold
        f.router.per_expert_scale.data.fill_(5.0)
        f.experts.down_proj.data.fill_(5.0)
    for i, f in enumerate(funcs[:-1]):
        init_weights_(f, config, seed=i)
    norms = [m for f in funcs[:-1] for m in f.modules() if isinstance(m, Gemma4RMSNorm) and m.with_scale]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert all(f.layer_scalar.item() == 1.0 for f in funcs[1:-2])
    assert not hasattr(funcs[1].self_attn.v_norm, "weight") and not hasattr(funcs[3].self_attn, "k_proj")
    for f in funcs[1:-2]:
        assert torch.equal(f.router.scale, torch.ones(64)) and torch.equal(f.router.per_expert_scale, torch.ones(4))
        for w in (f.router.proj.weight, f.experts.gate_up_proj, f.experts.down_proj):
            assert w.std().item() == pytest.approx(config.initializer_range, rel=0.2)


def test_what_the_stages_cannot_run_is_refused_by_name():
    config = config_from_dict({"model_type": "gemma4_text", "final_logit_softcapping": 30.0, **MOE})
    assert model_config_problems(config, "model.architecture", override=True) == []  # the cap runs (test_logit_softcap)
    assert model_config_problems(gemma(), "model.architecture", override=True) == []
    assert model_config_problems(gemma(**MOE), "model.architecture", override=True) == []
    no_experts = config_from_dict({"model_type": "gemma4_text", "enable_moe_block": True})  # the widths unset
    assert [line.split(": ")[1].split(" with ")[0] for line in model_config_problems(no_experts, "m", True)] == [
        "num_experts None",
        "moe_intermediate_size None",
    ]
    (line,) = model_config_problems(gemma(**{**MOE, "top_k_experts": 5}), "m", override=True)
    assert "top_k_experts 5 with enable_moe_block true is not in [1, 4]" in line
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
    from parallel.axis import ModelFacts
    from parallel.expert_parallel import ExpertParallelPlan
    from parallel.layout import Layout

    facts = ModelFacts.of(gemma(**MOE))
    assert facts.num_experts == MOE["num_experts"]
    (line,) = ExpertParallelPlan.layout_problems(Layout(1, 2, 1, ep=2, dtype="fp32"), facts)
    assert line.startswith("expert_parallel 2 with gemma4_text's MoE block is not supported yet")


# conf/model/gemma-4-*.yaml: (text-model parameters, what the model card counts) through the stage specs. The card
# counts the 31B's and 26B-A4B's text model (30.7B; 25.2B, 3.8B active), E2B's without its per-layer embeddings
# ("2.3B effective"); the releases add vision (and E2B's audio) encoders.
PUBLISHED = {
    "gemma-4-31b": (30_697_345_280, 30.7e9),
    "gemma-4-26b-a4b": (25_233_141_760, 25.2e9),
    "gemma-4-e2b": (4_628_569_344, 2.3e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.slow  # beyond stage parity: conversion, sizes (the full suite)
def test_published_sizes(name, tmp_path, tokenizer_dir):
    """Exact counts through the stage specs and ``Gemma4ForCausalLM`` on the meta device, the card's within 1%
    (the 26B-A4B's 3.8B active too), and the planner and preflight on each entry."""
    from training.configuration.model_source import model_group_config

    config = model_group_config(name)
    total, card = PUBLISHED[name]
    assert model_parameters(config) == total
    with torch.device("meta"):
        assert Gemma4ForCausalLM(config).num_parameters() == total
    lookups = config.vocab_size_per_layer_input * config.num_hidden_layers * config.hidden_size_per_layer_input
    assert total - lookups == pytest.approx(card, rel=0.01)  # the card rounds to a tenth of a billion
    spec = moe_spec(config)
    if spec is not None:
        assert (spec.num_experts, spec.top_k) == (128, 8)
        assert active_parameters(config) == pytest.approx(3.8e9, rel=0.01)
        # the planner counts the dense MLP beside the experts as a shared expert's activations
        assert moe_shape(config).shared_width == config.intermediate_size
    assert_preflight_plans(
        name,
        tokenizer_dir,
        tmp_path,
        "model.architecture.vocab_size_per_layer_input=512",
        "activation_checkpoint_interval=0",  # refused for Gemma 4 (models/family_gemma4.py)
    )


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe_block"])
@pytest.mark.slow  # beyond stage parity: conversion (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_gemma4(tmp_path, tokenizer_dir, moe):
    overrides = MOE if moe else {}
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=torch.bfloat16, model_type="gemma4_text", **overrides)
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    before, after = hf_tensors(src), hf_tensors(str(tmp_path / "back"))
    assert "model.embed_tokens_per_layer.weight" in after and "model.layers.0.layer_scalar" in after
    if moe:
        assert {"model.layers.3.experts.gate_up_proj", "model.layers.3.router.per_expert_scale"} <= set(after)
    assert_bit_identical(before, after)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is Gemma4ForCausalLM
    assert exported.config.kv_sharing_modes == original.config.kv_sharing_modes
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > the window
    assert torch.equal(original(ids).logits, exported(ids).logits)
