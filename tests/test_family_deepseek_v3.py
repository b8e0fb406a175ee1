"""DeepSeek-V3 (multi-head latent attention, dense first layers, grouped sigmoid routing with a router bias and a shared
expert) through the same stages computes what ``DeepseekV3ForCausalLM`` computes, in one process.

Logits, loss and every gradient in fp32 within 1e-5 (a packed row among them), packed documents equal to each
document alone, the router bias kept by the stages, the conversion and the export, never trained; the attention's
flash path with values of another head size; the conf/model entry's 671 B / 37 B from the config's arithmetic; the
bias update rule over several steps against the rule written out; what training refuses for the family."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.attention import attention_per_document, find_documents, varlen_documents
from models.families import family_of, moe_spec
from models.family_deepseek_v3 import ExpertLoads, sequence_balance_loss, update_bias_
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.files.pipeline_dir import load_layer_file
from models.llama_pipe import build_sequential, flops_per_token, init_weights_, layer_file_name, model_parameters
from models.loss import causal_lm_loss
from models.moe_counts import active_parameters
from models.tiny import tiny_config
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import (
    TOL,
    assert_matches_hf,
    assert_packed_equals_alone,
    copy_hf_weights,
    module_of,
    parity_batch,
    run_chain,
)

BIAS = "mlp.gate.e_score_correction_bias"


def deepseek(seed: int = 0):
    """The tiny config (3 layers, layer 0 dense, 8 experts in 4 groups) and a random model whose router biases are
    not 0 (as a trained checkpoint's: they change which experts are picked)."""
    torch.manual_seed(seed)
    config = tiny_config("deepseek_v3", vocab_size=300, intermediate_size=96)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for layer in moe_spec(config).moe_layers:
            hf.get_buffer(f"model.layers.{layer}.{BIAS}").normal_(0.0, 0.1)
    return config, hf


def test_stages_match_deepseek_v3_and_keep_the_router_bias():
    config, hf = deepseek()
    routed = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert moe_spec(config).moe_layers == routed == (1, 2)
    # a batch with a packed row; the gradient reaches the routers and the latent projections
    worst = assert_matches_hf(config, *parity_batch(config.vocab_size), hf=hf, learns=("gate.weight", "kv_b_proj"))
    print(f"deepseek_v3: max |stages - DeepseekV3ForCausalLM| {worst:.1e}")
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    layer = funcs[2]  # decoder layer 1, routed: the bias is state (layer files), not a parameter (the optimizer)
    assert BIAS in layer.state_dict() and BIAS not in dict(layer.named_parameters())
    assert torch.equal(layer.get_buffer(BIAS), hf.get_buffer(f"model.layers.1.{BIAS}"))
    input_ids, position_ids, _ = parity_batch(config.vocab_size)
    with torch.no_grad():
        logits = run_chain(funcs, input_ids, position_ids)
        layer.get_buffer(BIAS).zero_()  # the bias is no no-op: without it other experts are picked
        assert (run_chain(funcs, input_ids, position_ids) - logits).abs().max() > 1000 * TOL


def test_packed_documents_equal_each_document_alone():
    """Per-document attention, and attention=dense_mask (transformers' sdpa with per-document masks) against Hugging
    Face."""
    config, hf = deepseek()
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    assert_packed_equals_alone(funcs, config.vocab_size)
    assert_matches_hf(config, *parity_batch(config.vocab_size), attention="sdpa", hf=hf)


def test_from_scratch_initialisation_is_hugging_faces():
    """Routers and fused experts drawn from N(0, initializer_range), the latent norms 1, the router bias 0."""
    config = tiny_config("deepseek_v3")
    layer = build_sequential(config)[2]
    with torch.no_grad():
        for t in [*layer.parameters(), layer.get_buffer(BIAS)]:
            t.fill_(7.0)
    init_weights_(layer, config, seed=0)
    assert torch.equal(layer.get_buffer(BIAS), torch.zeros(8))
    assert layer.self_attn.kv_a_layernorm.weight.eq(1).all() and layer.self_attn.q_a_layernorm.weight.eq(1).all()
    for t in (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.self_attn.kv_b_proj.weight):
        assert abs(t.std().item() - config.initializer_range) < 0.003


def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch's varlen_attn on the CPU: causal per document, one head size for q, k and v as the flash kernel takes."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and window_size == (-1, 0)
    bounds = cu_q.tolist()
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=enable_gqa
            )[0].transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
    )


def test_the_flash_path_takes_values_of_another_head_size():
    """Multi-head latent attention's values (12 dims) beside queries and keys of 24: the variable-length path pads the
    values for the kernel and cuts its output back, equal to the per-document SDPA."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 30, 24), torch.randn(2, 4, 30, 24)
    v = torch.randn(2, 4, 30, 12)
    positions = torch.cat([torch.arange(12), torch.arange(18)]).repeat(2, 1)
    positions[1] = torch.arange(30)
    module = torch.nn.Module().eval()
    want, _ = attention_per_document(module, q, k, v, 0.0, 0.3, 0, positions)
    got = varlen_documents(fake_flash, q, k, v, find_documents(positions), 0.3, 0)
    assert got.shape == want.shape == (2, 30, 4, 12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def save_model(hf, path: str, dtype: torch.dtype) -> str:
    hf.to(dtype).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_deepseek_v3(tmp_path, dtype):
    """Experts one tensor each on disk, fused in the layer files; the router bias kept, bit for bit."""
    config, hf = deepseek()
    src = save_model(hf, str(tmp_path / "src"), dtype)
    on_disk = hf_tensors(src)
    assert ".experts.7.up_proj.weight" in " ".join(on_disk) and f"model.layers.2.{BIAS}" in on_disk
    hf_to_stages(src, str(tmp_path / "ckpt"))
    state = load_layer_file(os.path.join(tmp_path, "ckpt", "global_step0", layer_file_name(2)))
    assert state["mlp.experts.gate_up_proj"].shape == (8, 48, 64) and torch.equal(
        state[BIAS], on_disk[f"model.layers.1.{BIAS}"]
    )
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(on_disk, hf_tensors(str(tmp_path / "back")))
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is family_of(config).causal_lm
    ids = torch.randint(0, config.vocab_size, (1, 24))
    assert torch.equal(original(ids).logits, exported(ids).logits)


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_a_conversion_to_bf16_keeps_the_router_bias_in_fp32(tmp_path):
    """As ``from_pretrained`` keeps it (``_keep_in_fp32_modules_strict``): bf16 would round the differences between
    the experts' biases that pick them."""
    _, hf = deepseek()
    src = save_model(hf, str(tmp_path / "src"), torch.float32)
    hf_to_stages(src, str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    state = load_layer_file(os.path.join(tmp_path, "ckpt", "global_step0", layer_file_name(2)))
    assert state[BIAS].dtype == torch.float32 and state["mlp.gate.weight"].dtype == torch.bfloat16
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), dtype=torch.bfloat16)
    back = hf_tensors(str(tmp_path / "back"))
    assert back[f"model.layers.1.{BIAS}"].dtype == torch.float32
    assert torch.equal(back[f"model.layers.1.{BIAS}"], hf.get_buffer(f"model.layers.1.{BIAS}"))


def test_the_releases_prediction_layer_is_left_out(tmp_path):
    """DeepSeek-V3's release holds a multi-token-prediction layer after the last (model.layers.61.*), which
    DeepseekV3ForCausalLM does not load: the conversion leaves it out rather than refusing the directory."""
    from safetensors.torch import save_file

    config, hf = deepseek()
    src = save_model(hf, str(tmp_path / "src"), torch.float32)
    model = hf_tensors(src)
    extra = {"model.layers.3.eh_proj.weight": torch.ones(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    save_file({**model, **extra}, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(model, hf_tensors(str(tmp_path / "back")))


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_reference_architecture_counts_671b_and_37b_active():
    """conf/model/deepseek-v3.yaml through the stage specs equals the arithmetic of DeepSeek-V3's config, written out:
    671.0 B parameters, 37.6 B active per token (the published 671 B and 37 B; no MTP layer)."""
    from training.configuration.model_source import model_group_config

    c = model_group_config("deepseek-v3")
    h, heads, qk = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    attention = (
        h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk  # q_a_proj, q_a_layernorm, q_b_proj
        + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj
        + heads * c.v_head_dim * h  # o_proj
    )  # fmt: skip
    expert = 3 * h * c.moe_intermediate_size
    dense_layer = attention + 2 * h + 3 * h * c.intermediate_size
    moe_layer = attention + 2 * h + c.n_routed_experts * h + (c.n_routed_experts + c.n_shared_experts) * expert
    dense, routed = c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace
    total = 2 * c.vocab_size * h + h + dense * dense_layer + routed * moe_layer
    active = total - routed * (c.n_routed_experts - c.num_experts_per_tok) * expert
    assert model_parameters(c) == total == 671_026_404_352
    assert active_parameters(c) == active and round(active / 1e9, 1) == 37.6
    # attention FLOPs per token (MFU): query/key heads of 192 dims, value heads of 128
    assert flops_per_token(c, seq=4096)[1] == 6 * heads * (qk + c.v_head_dim) * 4096 * c.num_hidden_layers


def step_loads(hf) -> dict[int, torch.Tensor]:
    """Hooks counting the experts each routed layer of ``hf`` picks (written out, beside models/family_deepseek_v3)."""
    loads = {}

    def hook(layer):
        def count(module, args, output):
            loads[layer] = loads.get(layer, 0) + F.one_hot(output[2].reshape(-1), module.num_experts).sum(0)

        return count

    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(hook(i))
    return loads


def test_bias_update_over_steps_equals_the_rule_written_out():
    """Four AdamW steps of the stages with ExpertLoads.update_biases_ (speed 0.01) against DeepseekV3ForCausalLM with
    ``bias += speed * sign(mean load - load)`` after each step: the same loads, biases and weights; speed 0 moves
    nothing."""
    speed = 0.01
    config, hf = deepseek()
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    stages = torch.nn.ModuleList(module_of(f) for f in funcs if isinstance(f, torch.nn.Module))
    counter, loads = ExpertLoads(stages), step_loads(hf)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (hf, stages))
    initial = {name: t.clone() for name, t in hf.named_buffers() if name.endswith(BIAS)}
    for step in range(4):
        input_ids, position_ids, labels = parity_batch(config.vocab_size)
        hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss.backward()
        causal_lm_loss(run_chain(funcs, input_ids, position_ids), labels).backward()
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        ours = counter.update_biases_(speed)
        with torch.no_grad():
            for layer, load in loads.items():
                load = load.float()
                hf.get_buffer(f"model.layers.{layer}.{BIAS}").add_(speed * torch.sign(load.mean() - load))
                assert torch.equal(ours[f"{layer + 1}.mlp.gate"], load.long()), (step, layer)
        loads.clear()
    reference = hf.state_dict()
    for i, f in enumerate(funcs[1:-2]):
        for key, t in module_of(f).state_dict().items():
            torch.testing.assert_close(t, reference[f"model.layers.{i}.{key}"], rtol=0, atol=TOL, msg=f"{i} {key}")
    moved = max((reference[name] - t).abs().max().item() for name, t in initial.items())
    assert moved >= 2 * speed  # the biases moved over the steps
    bias = torch.zeros(4)
    assert torch.equal(update_bias_(bias, torch.tensor([5, 1, 3, 3])), torch.zeros(4))  # speed 0: off
    update_bias_(bias, torch.tensor([5, 1, 3, 3]), 0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_sequence_balance_loss_is_the_reports_formula():
    """alpha * sum_e f_e P_e over one sequence: balanced choices of uniform scores give alpha, one expert for all
    tokens E * alpha * its normalised score."""
    scores = torch.full((4, 4), 0.5)
    assert sequence_balance_loss(scores, torch.tensor([[0], [1], [2], [3]]), 0.1).item() == pytest.approx(0.1)
    assert sequence_balance_loss(scores, torch.zeros(4, 1, dtype=torch.long), 0.1).item() == pytest.approx(0.4 * 0.25)


def test_training_refuses_the_axes_not_built_for_deepseek_v3():
    """Tensor and sequence parallelism, DualPipeV and LoRA as for every Mixture-of-Experts model, naming the family;
    expert parallelism taken (tests/test_family_2026_moe_training.py trains it)."""
    from parallel.axis import ModelFacts
    from parallel.expert_parallel import ExpertParallelPlan
    from parallel.layout import Layout

    facts = ModelFacts.of(tiny_config("deepseek_v3"))
    assert facts.num_experts == 8
    assert ExpertParallelPlan.layout_problems(Layout(dp=2, ep=2), facts) == []
    lines = ExpertParallelPlan.layout_problems(Layout(dp=2, tp=2, sp=2, schedule="dualpipev", lora_rank=8), facts)
    assert {line.split(" with ")[0] for line in lines} >= {
        "tensor_parallel",
        "sequence_parallel",
        "pipeline_schedule=dualpipev",
        "peft.method=lora",
    }
    assert all("(deepseek_v3)" in line for line in lines)


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_generation_on_two_stages_equals_hf_generate():
    """GRPO's generation: each stage's KV cache holds multi-head latent attention's latents; greedy tokens equal
    ``generate``'s."""
    from parallel.partition import stage_boundaries
    from tests.test_generation import assert_equals_hf, pair

    hf, funcs = pair("deepseek_v3")
    assert_equals_hf(hf, funcs, [stage_boundaries(hf.config, 2)], None)


def test_configs_the_router_cannot_route_are_refused_before_start():
    """Groups that do not divide the experts, more experts per token than the kept groups hold, fewer KV heads than
    heads: one line each, naming the key (train.py's model checks; DeepseekV3Config takes them all)."""
    from models.config_rules import model_config_problems

    def problems(**overrides) -> list[str]:
        return model_config_problems(tiny_config("deepseek_v3", **overrides), "model.architecture", override=True)

    assert problems() == []
    (line,) = problems(n_group=3)
    assert line == (
        "model.architecture: n_group 3 does not divide the experts: set model.architecture.n_group to a divisor of 8"
    )
    lines = problems(topk_group=1, num_experts_per_tok=3, num_key_value_heads=2)
    assert [line.split()[1] for line in lines] == ["num_experts_per_tok", "num_key_value_heads"]
