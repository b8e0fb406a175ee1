"""Qwen3.5, dense and MoE (Gated DeltaNet linear-attention layers beside gated full attention), through the same stages
computes what ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` compute, in one process.

Logits, loss and every gradient in fp32 within 1e-5, the MoE router loss among them; packed rows equal to their
documents run apart (logits and gradients), the convolution and recurrent state restarting at each document, where
Hugging Face's own model (its torch path ignores document boundaries) misses by far more; conversion both ways
bit-identical; the from-scratch initialisation; the conf/model entries' counts, the published ones; DualPipeV's
deferred weight gradients on its layers; what training refuses for the family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.families import family_of, load_config
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.llama_pipe import ATTENTION_IMPLEMENTATIONS, build_sequential, init_weights_, model_parameters
from models.loss import IGNORE_INDEX
from models.tiny import tiny_config
from parallel.axis import ModelFacts, RuleSettings
from parallel.layout import Layout
from tests.support.models import make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_moe import chained_loss
from tests.test_stage_parity import (
    TOL,
    assert_layer_grads_equal,
    assert_matches_hf,
    copy_hf_weights,
    parity_batch,
    run_chain,
)

DENSE, MOE = "qwen3_5_text", "qwen3_5_moe_text"
CASES = {  # tiny_config: layers 0-2 linear attention, layer 3 full attention
    "dense": (DENSE, {}),
    "dense_tied": (DENSE, dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "moe": (MOE, {}),
}
DOCUMENTS = (70, 9, 30)  # a document longer than the delta rule's 64-token chunk, and two after it


def case_config(name: str, **extra):
    model_type, overrides = CASES[name]
    return tiny_config(model_type, vocab_size=300, intermediate_size=96, **{**overrides, **extra})


def hf_and_stages(config):
    torch.manual_seed(0)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    return hf, funcs


@pytest.mark.parametrize("attention", ["documents", "dense_mask"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_stages_match_hf(name, attention):
    torch.manual_seed(0)
    config = case_config(name)
    worst = assert_matches_hf(
        config,
        *parity_batch(config.vocab_size, packed=False),
        attention=ATTENTION_IMPLEMENTATIONS[attention],
        learns=("linear_attn.A_log", "conv1d", "experts"),
    )
    print(f"{name} {attention}: max |stages - {family_of(config).causal_lm.__name__}| {worst:.1e}")


def test_moe_router_loss_matches_hf():
    """CE + coef x the load-balancing loss over every routed layer, and every gradient, as
    ``Qwen3_5MoeForCausalLM(output_router_logits=True)`` computes them."""
    config = case_config("moe", output_router_logits=True, router_aux_loss_coef=0.5)
    hf, funcs = hf_and_stages(config)
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    loss, router = chained_loss(funcs, config, input_ids, position_ids, labels)
    assert abs(router.loss_sum - ref.aux_loss.item()) < TOL and abs(loss.item() - ref.loss.item()) < TOL
    ref.loss.backward()
    loss.backward()
    assert_layer_grads_equal(funcs, hf)


def packed_and_apart(funcs, docs):
    """Logits [S,V] of one packed row of ``docs``, of each document alone (concatenated), and the row's positions."""
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = run_chain(funcs, torch.cat(docs)[None], position_ids)[0]  # [S,V]
    apart = torch.cat([run_chain(funcs, d[None], torch.arange(len(d))[None])[0] for d in docs])
    return packed, apart, position_ids


def gradients(funcs, loss) -> list[torch.Tensor]:
    params = [p for f in funcs if isinstance(f, torch.nn.Module) for p in f.parameters()]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_packed_rows_equal_the_documents_apart(name):
    """A packed row of three documents (one past the 64-token chunk) gives each document's logits and gradients as
    it alone; Hugging Face's model, whose convolution and state run on across the boundaries, agrees on the first
    document and misses the others by far more than the tolerance (so a state carried across would be caught)."""
    config = case_config(name)
    hf, funcs = hf_and_stages(config)
    docs = [torch.randint(3, config.vocab_size, (n,)) for n in DOCUMENTS]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs])
    packed, apart, position_ids = packed_and_apart(funcs, docs)
    torch.testing.assert_close(packed, apart, rtol=0, atol=TOL)
    losses = (torch.nn.functional.cross_entropy(x, labels, ignore_index=IGNORE_INDEX) for x in (packed, apart))
    for g_packed, g_apart in zip(*(gradients(funcs, loss) for loss in losses)):
        if g_packed is not None or g_apart is not None:
            torch.testing.assert_close(g_packed, g_apart, rtol=0, atol=TOL)
    with torch.no_grad():
        carried = hf(input_ids=torch.cat(docs)[None], position_ids=position_ids, use_cache=False).logits[0]
    first = DOCUMENTS[0]
    torch.testing.assert_close(carried[:first], apart[:first].detach(), rtol=0, atol=TOL)
    missed = (carried[first:] - apart[first:].detach()).abs().max().item()
    assert missed > 1000 * TOL, missed
    within = (packed - apart).abs().max().item()
    print(f"{name}: packed vs apart {within:.1e}; Hugging Face's state carried across misses by {missed:.1e}")


@pytest.mark.parametrize("name, dtype", [("dense", torch.float32), ("moe", torch.bfloat16)])
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_the_same_class(tmp_path, tokenizer_dir, name, dtype):
    model_type, overrides = CASES[name]
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, model_type=model_type, **overrides)
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(hf_tensors(src), hf_tensors(str(tmp_path / "back")))
    assert load_config(str(tmp_path / "back")).to_dict() == load_config(src).to_dict()
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is family_of(original.config).causal_lm
    ids = torch.randint(0, original.config.vocab_size, (1, 24))
    assert torch.equal(original(ids).logits, exported(ids).logits)


def test_from_scratch_init_follows_hf():
    """Norms of 1 + weight at 0, the gated output norm at 1, dt_bias 1, A_log in log [0.01, 16], the convolution
    ~ N(0, initializer_range), seeded per spec."""
    config = tiny_config(DENSE, hidden_size=128, linear_num_value_heads=8)
    layer, again = (build_sequential(config)[1] for _ in range(2))
    init_weights_(layer, config, seed=5)
    init_weights_(again, config, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), again.state_dict().values()))
    attn = layer.linear_attn
    assert torch.equal(layer.input_layernorm.weight, torch.zeros(128)) and torch.equal(attn.norm.weight, torch.ones(16))
    assert torch.equal(attn.dt_bias, torch.ones(8))
    assert attn.A_log.min() >= torch.tensor(0.01).log() and attn.A_log.max() <= torch.tensor(16.0).log()
    assert attn.conv1d.weight.std().item() == pytest.approx(config.initializer_range, rel=0.15)


# conf/model/qwen3.5-*.yaml: (text-model parameters, active per token) through the stage specs, and the model cards'
# (total, activated) they round to; the releases add a vision encoder and a multi-token-prediction layer (the 27B's
# safetensors: 27.78 B), which the text model leaves out.
PUBLISHED = {
    "qwen3.5-27b": ((26_895_998_464, 26_895_998_464), (27e9, 27e9)),
    "qwen3.5-35b-a3b": ((34_660_610_688, 3_454_988_928), (35e9, 3e9)),
    "qwen3.5-122b-a10b": ((122_111_526_912, 9_771_288_576), (122e9, 10e9)),
    "qwen3.5-397b-a17b": ((396_346_350_336, 17_349_040_896), (397e9, 17e9)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_conf_model_entry_counts_its_parameters(name):
    """Each entry's text model, through the stage specs and Hugging Face's own model, within 1.5% of the model card's
    total (the 35B-A3B's 34.66 B: its card rounds up), its active count the card's in whole billions (3.45 B: A3B)."""
    from models.moe_counts import active_parameters
    from training.configuration.model_source import model_group_config

    config = model_group_config(name)
    (total, active), (card_total, card_active) = PUBLISHED[name]
    assert config.model_type == (MOE if "-a" in name else DENSE)
    assert model_parameters(config) == total and active_parameters(config) == active
    with torch.device("meta"):
        assert family_of(config).causal_lm(config).num_parameters() == total
    assert total == pytest.approx(card_total, rel=0.015) and round(active / 1e9) == card_active / 1e9


def test_deferred_weight_gradients_equal_autograds():
    """DualPipeV's zero bubble on Qwen3.5's layers (a packed row through a linear-attention and a full-attention
    layer): with every linear layer's weight gradient deferred and computed after, all gradients are autograd's."""
    from parallel.dualpipev import WeightGradStore, defer_linear_weights_

    config = case_config("dense")
    _, funcs = hf_and_stages(config)
    _, deferred = hf_and_stages(config)
    store = WeightGradStore()
    assert defer_linear_weights_(deferred[3:5], store) == 5 + 3 + 4 + 3  # DeltaNet, MLP, attention, MLP
    hidden = torch.randn(1, 40, config.hidden_size)
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]
    for layers, defer in ((funcs[3:5], False), (deferred[3:5], True)):
        x, store.deferring = (hidden, positions), defer
        for layer in layers:
            x = layer(x)
        x[0].sum().backward()
    store.deferring = False
    store.flush()
    store.pop()
    for ref, got in zip(funcs[3:5], deferred[3:5]):
        for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type", [DENSE, MOE])
def test_parallel_axes_refuse_the_family(model_type):
    """Tensor and sequence parallelism, each refused naming the family and the reason, as the planner and train.py
    ask the axes' rules; none of these lines for the family's predecessor, nor for expert parallelism (the MoE's
    routed experts split as Qwen3-MoE's: tests/test_family_2026_moe_training.py)."""
    from parallel.axes import AXES

    moe = model_type == MOE

    def lines(model: str, layout: Layout) -> list[str]:
        facts = ModelFacts(num_layers=4, heads=4, kv_heads=2, model_type=model, num_experts=4 if moe else 0)
        return [line for axis in AXES for line in axis.layout_problems(layout, facts, RuleSettings())]

    layouts = {
        "tensor_parallel 2": Layout(stages=2, tp=2, loss_chunk=1024),
        "sequence_parallel 2": Layout(stages=2, sp=2, seq_len=64),
    }
    if moe:
        assert not [line for line in lines(model_type, Layout(stages=2, dp=2, ep=2)) if "Gated DeltaNet" in line]
    for what, layout in layouts.items():
        ours = [line for line in lines(model_type, layout) if "Gated DeltaNet" in line]
        assert len(ours) == 1 and ours[0].startswith(f"{what} with model_type {model_type}"), lines(model_type, layout)
        assert not [line for line in lines("qwen3_moe" if moe else "qwen3", layout) if "Gated DeltaNet" in line]


def test_training_refuses_lora_compile_and_grpo_before_start(tmp_path):
    """train.py's config check reports LoRA, compile and GRPO with the family (and tensor parallelism), each with
    the reason, among its other problems."""
    from training.configuration.schema import ConfigError, TrainConfig
    from training.configuration.validate import resolve

    cfg = TrainConfig()
    arch = tiny_config(DENSE).to_diff_dict()
    cfg.model.architecture = {k: v for k, v in arch.items() if k not in ("transformers_version", "architectures")}
    cfg.model.tokenizer, cfg.output_dir = str(tmp_path), str(tmp_path / "out")
    cfg.train_objective, cfg.data.format, cfg.compile, cfg.peft.method = "grpo", "grpo", True, "lora"
    cfg.tensor_parallel = 2
    with pytest.raises(ConfigError) as refused:
        resolve(cfg, world_size=4)
    ours = [line.strip() for line in str(refused.value).splitlines() if f"model_type {DENSE} (Qwen3.5" in line]
    assert [line.split(" with ")[0] for line in ours] == [
        "tensor_parallel 2",
        "compile=true",
        "train_objective=grpo",
        "peft.method=lora",
    ], ours
