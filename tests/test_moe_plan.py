"""Mixture-of-Experts counting and planning: the published architectures' parameters (total and active) against
Hugging Face's and the model cards', experts per rank with expert parallelism, and the fit search over it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import yaml

from models.families import FAMILIES, config_from_dict, family_of
from models.llama_pipe import flops_per_token, model_parameters, spec_parameter_counts, spec_weights
from models.moe_counts import active_parameters, moe_shape, parameter_split, spec_expert_parameters
from parallel.layout import Layout
from parallel.memory_plan import (
    Shape,
    estimate,
    expert_all_to_all_bytes,
    expert_all_to_all_step_bytes,
    expert_buffer_bytes,
    expert_layout_problems,
    fitting,
    layer_activation_bytes,
    layouts_for,
    shape_of,
)
from parallel.partition import splitter
from tests.conftest import REPO, load_entry_point

# conf/model entry: (published total, published active parameters), from the model cards.
PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9),  # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B activated
    "qwen3-235b-a22b": (235e9, 22e9),  # Qwen/Qwen3-235B-A22B: 235B total, 22B activated
    "mixtral-8x7b": (46.7e9, 12.9e9),  # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active
    "llama4-scout-17b-16e": (109e9, 17e9),  # meta-llama/Llama-4-Scout-17B-16E: 109B total, 17B active
}
# Llama 4 Scout's published 109 B counts its vision encoder and projector too; the text model is 107.77 B.
TOTAL_TOLERANCE = {"llama4-scout-17b-16e": 0.015}


def architecture(name: str) -> dict:
    with open(os.path.join(REPO, "conf", "model", f"{name}.yaml")) as f:
        entry = yaml.safe_load(f)
    assert entry["name"] == name
    return entry["architecture"]


def family_known(name: str):
    model_type = architecture(name)["model_type"]
    return pytest.mark.skipif(
        model_type not in FAMILIES,
        reason=f"model_type {model_type} is not in models.families.FAMILIES yet (the Llama 4 family comes later)",
    )


@pytest.mark.parametrize("name", [pytest.param(n, marks=family_known(n)) for n in sorted(PUBLISHED)])
def test_published_moe_architectures_count_as_hugging_face_and_the_model_cards(name):
    """Our count through the stage specs equals <Family>ForCausalLM's on the meta device, within 1% of the
    published total; the active parameters (the rest + top_k / E of the routed experts) within 2% of the card's."""
    config = config_from_dict(architecture(name))
    total, active = PUBLISHED[name]
    ours = model_parameters(config)
    with torch.device("meta"):
        assert family_of(config).causal_lm(config).num_parameters() == ours
    assert ours == pytest.approx(total, rel=TOTAL_TOLERANCE.get(name, 0.01))
    assert active_parameters(config) == pytest.approx(active, rel=0.02)
    routed, rest = parameter_split(config)
    assert routed + rest == ours and routed > rest  # experts hold most of a MoE model


def test_experts_are_the_fused_expert_tensors_not_the_router():
    """Mixtral's routed experts: 32 layers x gate_up [8, 2 x 14336, 4096] + down [8, 4096, 14336]; the router
    [8, 4096] and everything else is the rest."""
    config = config_from_dict(architecture("mixtral-8x7b"))
    per_layer = 8 * 3 * 14336 * 4096
    experts = spec_expert_parameters(config)
    assert experts[0] == experts[-1] == experts[-2] == 0 and set(experts[1:33]) == {per_layer}
    assert parameter_split(config)[0] == 32 * per_layer
    shape = moe_shape(config)
    assert (shape.num_experts, shape.top_k, shape.moe_layers, shape.expert_width) == (8, 2, 32, 14336)
    assert shape.largest_expert_tensor == 8 * 2 * 14336 * 4096
    assert moe_shape(config_from_dict(architecture_of_dense())) is None


def architecture_of_dense() -> dict:
    with open(os.path.join(REPO, "conf", "model", "qwen3-8b.yaml")) as f:
        return yaml.safe_load(f)["architecture"]


def test_compute_weights_count_the_active_experts_and_dense_models_are_unchanged():
    """partition_method=compute weighs a MoE layer by its active work (top_k / E of its experts); the FLOPs per
    token are 6 x the active parameters less the input embedding. A dense model: its parameter counts."""
    config = config_from_dict(architecture("qwen3-30b-a3b"))
    counts, experts = spec_parameter_counts(config), spec_expert_parameters(config)
    compute = spec_weights(config, "compute")
    assert compute[1:] == [c - e + e * 8 // 128 for c, e in zip(counts[1:], experts[1:])]
    assert sum(compute) == active_parameters(config) - counts[0]
    assert flops_per_token(config, 2048)[0] == 6.0 * (active_parameters(config) - counts[0])
    assert spec_weights(config, "parameters") == counts
    dense = config_from_dict(architecture_of_dense())
    assert spec_weights(dense, "compute") == [0, *spec_parameter_counts(dense)[1:]]
    assert active_parameters(dense) == model_parameters(dense)


def mixtral() -> tuple[object, Shape]:
    config = config_from_dict(architecture("mixtral-8x7b"))
    return config, shape_of(config)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_parallelism_divides_the_experts_states_and_not_the_rest(zero):
    """Per rank with ep 1/2/4 (pipe 1 x data 8): the rest's weights, gradients and optimizer states as a dense
    model's; the experts' weights / ep, their ZeRO-sharded states over data / ep ranks (bf16, K=12)."""
    _, shape = mixtral()
    psi, experts, dp = 46.7e9, shape.moe.expert_params, 8
    rest = psi - experts
    for ep in (1, 2, 4):
        e = estimate([psi], Layout(dp=dp, zero=zero, ep=ep), shape, [32])
        nd, end = dp, dp / ep  # ZeRO's degree: the rest's, the experts'
        shard = {0: (1, 1, nd, 1, 1, end), 1: (1, 1, nd, 1, 1, end), 2: (1, nd, nd, 1, end, end)}
        shard[3] = (nd, nd, nd, end, end, end)
        w, g, o, ew, eg, eo = shard[zero]
        grad_bytes = 4 if zero == 0 else 2  # bf16 at ZeRO-0: DeepSpeed's BF16_Optimizer keeps an accumulation buffer
        assert e.params == pytest.approx(2 * rest / w + 2 * experts / ep / ew, rel=1e-12)
        assert e.grads == pytest.approx(grad_bytes * rest / g + grad_bytes * experts / ep / eg, rel=1e-12)
        assert e.optimizer == pytest.approx(12 * rest / o + 12 * experts / ep / eo, rel=1e-12)
        assert e.experts == pytest.approx(experts / ep)
    weights = [estimate([psi], Layout(dp=dp, zero=1, ep=ep), shape, [32]).params for ep in (1, 2, 4)]
    assert weights[0] - weights[1] == pytest.approx(2 * experts / 2) and weights[1] - weights[2] == pytest.approx(
        2 * experts / 4
    )


def test_a_dense_models_estimate_is_unchanged_by_the_expert_code():
    """No experts: ep 1 and the shape's moe None give the numbers of the formulas without them."""
    shape = Shape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256)
    e = estimate([8e9], Layout(dp=4, zero=1, grad_accum=8), shape, [32])
    assert e.params == 2 * 8e9 and e.grads == 2 * 8e9 and e.optimizer == 12 * 8e9 / 4 and e.experts == 0
    tokens = 2048
    assert layer_activation_bytes(shape, Layout()) == ((6 + 2 * 8 / 32) * 4096 + 4 * 14336) * tokens * 2


def test_routed_activations_and_the_all_to_all():
    """A MoE layer saves, per token, 2 top_k H + 4 top_k I + 2 E elements in place of the dense 4 F; with ep > 1
    one layer's all-to-all buffers (send + receive, dispatch + combine: 4 x tokens x top_k x H) come on top, and
    each rank sends 2 x tokens x top_k x H x elem x (ep-1)/ep per MoE layer per micro-batch forward."""
    _, shape = mixtral()
    tokens, h, k = 4096, 4096, 2
    layout = Layout(seq_len=tokens, grad_accum=8)
    mlp = 2 * k * h + 4 * k * 14336 + 2 * 8
    assert layer_activation_bytes(shape, layout) == ((6 + 2 * 8 / 32) * h + mlp) * tokens * 2
    assert expert_buffer_bytes(shape, layout) == 0 == expert_all_to_all_bytes(shape, layout)
    ep4 = dataclasses.replace(layout, dp=4, ep=4)
    assert expert_buffer_bytes(shape, ep4) == 4 * tokens * k * h * 2
    assert expert_all_to_all_bytes(shape, ep4) == 2 * tokens * k * h * 2 * 3 / 4
    assert expert_all_to_all_step_bytes(shape, ep4, 16) == expert_all_to_all_bytes(shape, ep4) * 16 * 8 * 2
    ckpt = dataclasses.replace(ep4, checkpointing=True)
    assert expert_all_to_all_step_bytes(shape, ckpt, 16) == expert_all_to_all_bytes(shape, ep4) * 16 * 8 * 3
    acts = (
        estimate([46.7e9], ep4, shape, [32]).activations
        - estimate([46.7e9], dataclasses.replace(ep4, ep=1), shape, [32]).activations
    )
    assert acts == pytest.approx(expert_buffer_bytes(shape, ep4))


def test_expert_parallelism_must_divide_the_data_axis_and_the_experts():
    _, shape = mixtral()
    assert not expert_layout_problems(Layout(dp=8, ep=8), shape)
    assert not expert_layout_problems(Layout(dp=2, sp=2, ep=4), shape)  # DeepSpeed's data axis: sp x dp
    assert "does not divide the data-parallel degree 4" in expert_layout_problems(Layout(dp=4, ep=8), shape)[0]
    assert "does not divide the 8 experts" in expert_layout_problems(Layout(dp=6, ep=3), shape)[0]
    assert "dense model" in expert_layout_problems(Layout(dp=4, ep=2), None)[0]
    assert "tensor_parallel 2" in expert_layout_problems(Layout(dp=4, tp=2), shape)[0]


def test_the_fit_search_tries_expert_parallelism_and_only_where_it_divides():
    """Mixtral on 8 x 80 GB: layouts with ep > 1 are proposed, each ep dividing the data axis and the 8 experts;
    the same search without expert parallelism (ep_values (1,)) finds only those of them with ep 1."""
    config, shape = mixtral()
    split = splitter(config, None)
    found = fitting(split, shape, 8, 80, 32, 1, 2048, 8, "bf16", 1024)
    eps = {layout.ep for layout, _ in found}
    assert eps - {1}, eps
    for layout, _ in found:
        assert layout.data_axis % layout.ep == 0 and 8 % layout.ep == 0 and layout.tp == 1
    without = fitting(split, shape, 8, 80, 32, 1, 2048, 8, "bf16", 1024, ep_values=(1,))
    assert {layout for layout, _ in without} < {layout for layout, _ in found}  # those with ep 1, and more
    tried = layouts_for(12, 32, 1, 2048, 8, "bf16", 1024, shape=shape, ep_values=(1, 2, 3, 4, 6, 8))
    assert {(l.data_axis, l.ep) for l in tried if l.ep > 1} <= {  # noqa: E741
        (a, e) for a in range(1, 13) for e in (2, 4, 8) if a % e == 0
    }
    assert any(l.ep == 4 for l in tried) and not any(l.ep in (3, 6) for l in tried)  # noqa: E741
    dense = shape_of(config_from_dict(architecture_of_dense()))
    assert {l.ep for l in layouts_for(8, 36, 1, 2048, 8, "bf16", shape=dense, ep_values=(1, 2, 4))} == {1}  # noqa: E741


def test_estimate_memory_reports_experts_and_their_all_to_all(capsys):
    script = load_entry_point("scripts/estimate_memory.py")
    script.main(["--model", "mixtral-8x7b", "--stages", "2", "--dp", "4", "--ep", "4", "--zero", "1"])
    out = capsys.readouterr().out
    assert "layout: pipe 2 x data 4 (experts 4), ZeRO-1" in out
    assert "2 experts per layer on each rank (expert parallelism 4" in out
    per_layer = 2 * 2048 * 2 * 4096 * 2 * 3 / 4
    assert f"each rank sends {per_layer / 1e6:.1f} MB per MoE layer per micro-batch forward" in out
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model", "mixtral-8x7b", "--stages", "2", "--dp", "4", "--ep", "8", "--zero", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "--ep 8 does not divide the data-parallel degree 4" in err


def test_estimate_memory_lists_expert_parallel_layouts_that_fit(capsys):
    script = load_entry_point("scripts/estimate_memory.py")
    script.main(["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--top", "40"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "ZeRO-" in line]
    assert any("(experts" in r for r in rows) and all(
        float(r[0]) <= 80 and r[3] != "0.0" for r in rows if "(experts" in r
    )
    script.main(["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--ep", "1", "--top", "40"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "ZeRO-" in line]
    assert rows and not any("(experts" in r for r in rows) and {r[3] for r in rows} == {"0.0"}  # no all-to-all
