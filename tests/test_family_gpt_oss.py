"""gpt-oss through the stages in one process computes what ``GptOssForCausalLM`` computes (logits, loss with and
without the router loss, every gradient, fp32, 1e-5) on a sliding and a full layer, with its attention sinks carried
exactly (zeroed, the logits part ways); packed documents equal each document alone; conversion both ways is
bit-identical; the MXFP4 release is read dequantized as transformers dequantizes it; generation on the stages equals
``generate``; the published parameter counts; expert parallelism taken, the other axes refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssForCausalLM

from models.families import UnsupportedModelError, load_config, moe_spec
from models.files.hf_convert import ConversionError, hf_to_stages, stages_to_hf
from models.llama_pipe import build_sequential, init_weights_
from models.loss import CausalLMLoss
from models.router_loss import RouterLoss
from models.tiny import tiny_config
from tests.support.models import make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import (
    TOL,
    assert_packed_equals_alone,
    copy_hf_weights,
    module_of,
    parity_batch,
    run_chain,
)

# A sliding layer (0, window 8 < the 40-token rows) and a full one (1); the router loss with a large coefficient.
ROUTED = dict(num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.5)


def reference_and_stages(router_loss: bool, attention: str = "sdpa_documents"):
    torch.manual_seed(0)
    config = tiny_config("gpt_oss", vocab_size=300, **{**ROUTED, "output_router_logits": router_loss})
    hf = GptOssForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # the experts' biases start at 0 and the sinks near 0: values that count, as trained
        for name, p in hf.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0.0, 0.02)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    funcs = build_sequential(config, attention=attention)
    copy_hf_weights(funcs, config, hf.state_dict())
    return config, hf, funcs


def logits_and_loss(config, funcs, input_ids, position_ids, labels):
    """The chained stages' logits and loss, the router loss taking the final norm's routing statistics, as on the
    pipeline's last stage (tests/test_moe.py's chained_loss)."""
    loss_fn = CausalLMLoss()
    moe = moe_spec(config)
    if moe.router_loss:
        loss_fn.router = RouterLoss(moe.num_experts, moe.top_k, moe.router_aux_loss_coef)
        funcs[-2].router_sink = loss_fn.router.receive  # the norm spec
    logits = run_chain(funcs, input_ids, position_ids)
    return logits, loss_fn(logits, labels)


@pytest.mark.parametrize("router_loss", [True, False], ids=["router_loss", "no_router_loss"])
def test_gpt_oss_stages_match_hf(router_loss):
    """Unpacked rows: GptOssModel builds its masks without position_ids, so it attends across packed documents;
    the packed rows are checked against each document alone (test_packed_documents_equal_each_alone)."""
    config, hf, funcs = reference_and_stages(router_loss)
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    logits, loss = logits_and_loss(config, funcs, input_ids, position_ids, labels)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=TOL)
    assert abs(loss.item() - ref.loss.item()) < TOL
    assert (ref.aux_loss is not None) == router_loss
    if router_loss:  # a visible part of the loss: without it the difference is far beyond TOL
        assert abs((loss - config.router_aux_loss_coef * ref.aux_loss).item() - ref.loss.item()) > 100 * TOL
    ref.loss.backward()
    loss.backward()
    worst = max((logits - ref.logits).abs().max().item(), abs(loss.item() - ref.loss.item()))
    checked = 0
    for prefix, f in [("model.embed_tokens.", funcs[0]), ("model.norm.", funcs[-2]), ("lm_head.", funcs[-1])] + [
        (f"model.layers.{i}.", f) for i, f in enumerate(funcs[1:-2])
    ]:
        for key, p in module_of(f).named_parameters():
            ref_grad = hf.get_parameter(prefix + key).grad
            torch.testing.assert_close(p.grad, ref_grad, rtol=0, atol=TOL, msg=prefix + key)
            worst = max(worst, (p.grad - ref_grad).abs().max().item())
            checked += 1
    assert checked == len(list(hf.parameters()))
    sinks = [p.grad for n, p in hf.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == 2 and all(g.abs().max() > 0 for g in sinks)
    print(
        f"gpt_oss {'with' if router_loss else 'without'} the router loss: max |stages - GptOssForCausalLM| {worst:.1e}"
    )


@torch.no_grad()
def test_the_sinks_are_carried_exactly():
    """Zeroing the sinks of the stages alone puts their logits far outside the tolerance: they are not dropped."""
    config, hf, funcs = reference_and_stages(router_loss=False)
    input_ids, position_ids, _ = parity_batch(config.vocab_size, packed=False)
    ref = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(run_chain(funcs, input_ids, position_ids), ref, rtol=0, atol=TOL)
    for f in funcs[1:-2]:
        f.self_attn.sinks.zero_()
    apart = (run_chain(funcs, input_ids, position_ids) - ref).abs().max().item()
    print(f"gpt_oss logits with the stages' sinks zeroed: {apart:.1e} from GptOssForCausalLM's")
    assert apart > 1000 * TOL


@pytest.mark.parametrize("attention", ["sdpa_documents", "sdpa"], ids=["documents", "dense_mask"])
def test_packed_documents_equal_each_alone(attention):
    """Per-document attention with sinks (and attention=dense_mask, Hugging Face's eager attention with per-document
    masks): documents of 13, 20 and 7 tokens, two longer than the window, packed in one row."""
    config, _, funcs = reference_and_stages(router_loss=False, attention=attention)
    assert_packed_equals_alone(funcs, config.vocab_size, lengths=(13, 20, 7))


def test_from_scratch_initialisation_is_hugging_faces():
    """The experts' biases start at 0; their weights, the router's weight and bias and the sinks are drawn."""
    config = tiny_config("gpt_oss", num_hidden_layers=1)
    layer = build_sequential(config)[1]
    init_weights_(layer, config, seed=0)
    experts, router = layer.mlp.experts, layer.mlp.router
    assert not experts.gate_up_proj_bias.any() and not experts.down_proj_bias.any()
    for p in (experts.gate_up_proj, experts.down_proj, router.weight, router.bias, layer.self_attn.sinks):
        assert 0.005 < p.std().item() < 0.05  # N(0, 0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_gpt_oss(tmp_path, tokenizer_dir, dtype):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, model_type="gpt_oss", num_hidden_layers=2)
    on_disk = hf_tensors(src)
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in on_disk and "model.layers.1.self_attn.sinks" in on_disk
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(on_disk, hf_tensors(str(tmp_path / "back")))
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is GptOssForCausalLM
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > the window
    assert torch.equal(original(ids).logits, exported(ids).logits)


def mxfp4_release(tmp_path, tokenizer_dir, model_type: str = "gpt_oss") -> tuple[str, dict]:
    """A tiny model directory as gpt-oss is released: its experts as MXFP4 blocks and scales (random bytes), its
    config.json with quantization_config mxfp4. Returns it and {expert tensor: transformers' dequantization}."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = make_hf_dir(tmp_path, tokenizer_dir, "src", model_type=model_type, num_hidden_layers=2, intermediate_size=64)
    path = os.path.join(src, "model.safetensors")
    tensors, dequantized = load_file(path), {}
    g = torch.Generator().manual_seed(0)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(key).shape  # [E,in,out], stored [E,out,in/32,16] + [E,out,in/32]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 130, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=g)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(raw, f)
    return src, dequantized


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_the_mxfp4_release_is_read_dequantized_to_bf16(tmp_path, tokenizer_dir):
    """Conversion and the start from the directory read the experts as transformers dequantizes them (bit for bit);
    the export has no quantization_config and computes what transformers' dequantized model computes."""
    from transformers import Mxfp4Config

    from models.files.hf_stage import hf_start_problems
    from models.files.pipeline_dir import load_layer_file, read_tag

    src, dequantized = mxfp4_release(tmp_path, tokenizer_dir)
    assert getattr(load_config(src), "quantization_config", None) is None
    assert hf_start_problems(src, load_config(src)) == []
    hf_to_stages(src, str(tmp_path / "ckpt"))
    ckpt = str(tmp_path / "ckpt")
    for layer in range(2):
        state = load_layer_file(os.path.join(ckpt, read_tag(ckpt), f"layer_{1 + layer:02d}-model_states.pt"))
        for part in ("gate_up_proj", "down_proj"):
            want = dequantized[f"model.layers.{layer}.mlp.experts.{part}"]
            assert state[f"mlp.experts.{part}"].dtype == torch.bfloat16
            assert torch.equal(state[f"mlp.experts.{part}"], want)
    stages_to_hf(ckpt, str(tmp_path / "back"))
    with open(tmp_path / "back" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    theirs = GptOssForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    ids = torch.randint(0, ours.config.vocab_size, (1, 24))
    assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_mxfp4_weights_of_another_family_are_refused(tmp_path, tokenizer_dir):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", model_type="mixtral", num_hidden_layers=1)
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({**raw, "quantization_config": {"quant_method": "mxfp4"}}, f)
    with pytest.raises(UnsupportedModelError, match="MXFP4 weights .* are read for gpt_oss only, not mixtral"):
        load_config(src)
    with pytest.raises(ConversionError, match="for gpt_oss only"):
        hf_to_stages(src, str(tmp_path / "ckpt"))


def test_expert_parallelism_is_taken_and_the_other_axes_are_refused_for_gpt_oss():
    """Expert parallelism splits gpt-oss's experts (tests/test_family_2026_moe_training.py trains it); tensor and
    sequence parallelism and DualPipeV are refused as for every Mixture-of-Experts model."""
    from parallel.axis import ModelFacts
    from parallel.expert_parallel import ExpertParallelPlan
    from parallel.layout import Layout

    moe = ModelFacts(model_type="gpt_oss", num_experts=32)
    assert ExpertParallelPlan.layout_problems(Layout(dp=2, ep=2, dtype="bf16"), moe) == []
    problems = ExpertParallelPlan.layout_problems(Layout(dp=2, tp=2, sp=2, schedule="dualpipev"), moe)
    refused = {"tensor_parallel", "sequence_parallel", "pipeline_schedule=dualpipev"}
    assert {p.split(" with ")[0] for p in problems} >= refused, problems


# OpenAI's model card: (total, active per token) parameters; its active count leaves out the input embedding
# (201088 x 2880 = 579,133,440, a lookup), which active_parameters counts.
PUBLISHED = {"gpt-oss-20b": (20_914_757_184, 3_608_307_264), "gpt-oss-120b": (116_829_156_672, 5_132_849_472)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_reference_architectures_have_the_published_counts(name):
    """24 (36) layers of 32 (128) experts, each 3 x 2880 x 2880 weights + 2 x 2880 + 2880 biases, 4 a token."""
    from models.llama_pipe import model_parameters
    from models.moe_counts import active_parameters, moe_shape
    from training.configuration.model_source import model_group_config

    config = model_group_config(name)
    total, active = PUBLISHED[name]
    assert config.model_type == "gpt_oss" and config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert model_parameters(config) == total
    assert active_parameters(config) - config.vocab_size * config.hidden_size == active
    assert moe_shape(config).expert_width == 2880  # the experts' biases aside


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_generation_on_the_stages_equals_hf_generate(sampled):
    """GRPO's generation (models/generation.py) attends with the family's dense attention, eager with the sinks."""
    import tests.test_generation as gen

    config = tiny_config("gpt_oss", initializer_range=0.2)
    torch.manual_seed(0)
    hf = GptOssForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    for f in funcs:
        f.eval()
    gen.assert_equals_hf(hf, funcs, [gen.SPLITS["norm_with_head"]], 0 if sampled else None)
