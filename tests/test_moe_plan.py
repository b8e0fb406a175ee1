"""Mixture-of-Experts counting and planning: the published architectures' parameters (total and active) against
Hugging Face's and the model cards', experts per rank with expert parallelism, and the fit search over it."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex

import pytest
import torch
import yaml

from models.families import FAMILIES, config_from_dict, family_of
from models.llama_pipe import (
    flops_per_token,
    model_parameters,
    spec_parameter_counts,
    spec_routed_expert_counts,
    spec_weights,
)
from models.moe_counts import active_parameters, experts_per_token, moe_shape, parameter_split
from parallel.axis import ModelFacts
from parallel.engines import PipelineEngine
from parallel.expert_parallel import ExpertParallelPlan
from parallel.layout import Layout
from parallel.memory_plan import (
    Shape,
    estimate,
    expert_all_to_all_bytes,
    expert_all_to_all_step_bytes,
    expert_buffer_bytes,
    expert_report,
    fitting,
    layer_activation_bytes,
    layouts_for,
    shape_of,
)
from parallel.partition import splitter
from tests.support import REPO
from tests.support.scripts import load_entry_point
from training.configuration.schema import TrainConfig

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
    experts = spec_routed_expert_counts(config)
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
    counts, experts = spec_parameter_counts(config), spec_routed_expert_counts(config)
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
    fp32 = Layout(dtype="fp32")
    moe = ModelFacts(model_type="mixtral", num_experts=8)
    assert not ExpertParallelPlan.layout_problems(dataclasses.replace(fp32, dp=8, ep=8), moe)
    assert (
        "must divide the data-parallel degree 4"
        in ExpertParallelPlan.layout_problems(dataclasses.replace(fp32, dp=4, ep=8), moe)[0]
    )
    assert (
        "must divide the 8 experts of each MoE layer: use one of [1, 2, 4, 8]"
        in ExpertParallelPlan.layout_problems(dataclasses.replace(fp32, dp=6, ep=3), moe)[0]
    )
    dense, llama = ModelFacts(num_experts=0), ModelFacts(model_type="llama", num_experts=0)
    assert "dense model" in ExpertParallelPlan.layout_problems(Layout(dp=4, ep=2), dense)[0]
    assert "model_type llama, which has no experts" in ExpertParallelPlan.layout_problems(Layout(dp=4, ep=2), llama)[0]
    assert not ExpertParallelPlan.layout_problems(Layout(dp=4, ep=2))  # no model known: nothing to check but ep >= 1
    assert ExpertParallelPlan.layout_problems(Layout(ep=0)) == [
        "expert_parallel 0 must be >= 1 (1: every rank holds every expert)"
    ]
    assert not ExpertParallelPlan.layout_problems(Layout(dp=4, ep=2, zero=1), moe)  # bf16 at ZeRO-1: DeepSpeed's groups
    offloaded = Layout(dp=4, ep=2, zero=1, offload_optimizer=True)
    assert "with the optimizer offloaded (ds=zero1)" in ExpertParallelPlan.layout_problems(offloaded, moe)[0]


# train.py's MoE rules, each a layout the planner must not propose: (Layout changes, a word of the line).
REFUSED_WITH_EXPERTS = [
    (dict(tp=2, dp=4), "tensor_parallel with a Mixture-of-Experts model (mixtral) is not supported yet"),
    (dict(sp=2, dp=4), "sequence_parallel with a Mixture-of-Experts model (mixtral) is not supported yet"),
    (dict(stages=2, dp=4, schedule="dualpipev", grad_accum=8), "pipeline_schedule=dualpipev with"),
    (dict(dp=8, zero=2), "runs on the pipeline engine; num_stages=1 with ds=zero2"),
    (dict(dp=8, zero=3), "runs on the pipeline engine; num_stages=1 with ds=zero3"),
    (dict(stages=2, dp=4, ep=2, zero=1, offload_optimizer=True), "expert_parallel 2 with the optimizer offloaded"),
    (dict(dp=8, lora_rank=8, lora_targets=("q_proj",)), "peft.method=lora with a Mixture-of-Experts model"),
]


@pytest.mark.parametrize("changes, line", REFUSED_WITH_EXPERTS, ids=[c[1][:40] for c in REFUSED_WITH_EXPERTS])
def test_train_py_and_the_planner_refuse_a_moe_layout_with_one_rule(changes, line):
    """parallel.expert_parallel.ExpertParallelPlan.problems (train.py's validation) says the lines of its
    layout_problems with the config's settings, and the fit search proposes none of these."""
    config, shape = mixtral()
    layout = dataclasses.replace(Layout(dtype="fp32"), **changes)
    ours = ExpertParallelPlan.layout_problems(layout, ModelFacts(model_type="mixtral", num_experts=8))
    assert any(line in p for p in ours), ours
    cfg = TrainConfig(
        num_stages=layout.stages,
        tensor_parallel=layout.tp,
        sequence_parallel=layout.sp,
        expert_parallel=layout.ep,
        ds_config=f"zero{layout.zero}",
        pipeline_schedule=layout.schedule,
    )
    cfg.peft.method = "lora" if layout.lora_rank else "none"
    assert ExpertParallelPlan.problems(cfg, config, layout) == ours
    assert layout not in set(
        layouts_for(
            8,
            32,
            1,
            2048,
            8,
            layout.dtype,
            1024,
            (0, (), False),
            (1, 2),
            (1, 2),
            shape,
            ("1f1b", "dualpipev"),
            (1, 2, 4, 8),
        )
    )


def test_the_fit_search_proposes_only_layouts_train_py_runs_for_a_moe_model():
    """Mixtral on 16 x 80 GB, bf16 and fp32: the pipeline engine, no tensor or sequence parallelism, no DualPipeV;
    expert parallelism in both, never with the optimizer offloaded."""
    config, shape = mixtral()
    split = splitter(config, None)
    for dtype in ("bf16", "fp32"):
        found = fitting(split, shape, 16, 80, 32, 1, 2048, 16, dtype, 1024, schedules=("1f1b", "dualpipev"))
        assert found
        for layout, _ in found:
            assert layout.tp == layout.sp == 1 and layout.schedule == "1f1b", layout
            assert isinstance(layout.engine, PipelineEngine), layout
            assert layout.ep == 1 or not layout.offload_optimizer, layout
        assert {layout.ep for layout, _ in found} == {1, 2, 4, 8}, dtype


def test_the_fit_search_tries_expert_parallelism_and_only_where_it_divides():
    """Mixtral on 16 x 80 GB in fp32: layouts with ep > 1 are proposed, each ep dividing the data axis and the 8
    experts; the same search without expert parallelism (ep_values (1,)) finds only those of them with ep 1."""
    config, shape = mixtral()
    split = splitter(config, None)
    found = fitting(split, shape, 16, 80, 32, 1, 2048, 8, "fp32", 1024)
    eps = {layout.ep for layout, _ in found}
    assert eps - {1}, eps
    for layout, _ in found:
        assert layout.data_axis % layout.ep == 0 and 8 % layout.ep == 0 and layout.tp == 1
    without = fitting(split, shape, 16, 80, 32, 1, 2048, 8, "fp32", 1024, ep_values=(1,))
    assert {layout for layout, _ in without} < {layout for layout, _ in found}  # those with ep 1, and more
    tried = layouts_for(12, 32, 1, 2048, 8, "fp32", 1024, shape=shape, ep_values=(1, 2, 3, 4, 6, 8))
    assert {(l.data_axis, l.ep) for l in tried if l.ep > 1} <= {  # noqa: E741
        (a, e) for a in range(1, 13) for e in (2, 4, 8) if a % e == 0
    }
    assert any(l.ep == 4 for l in tried) and not any(l.ep in (3, 6) for l in tried)  # noqa: E741
    dense = shape_of(config_from_dict(architecture_of_dense()))
    assert {l.ep for l in layouts_for(8, 36, 1, 2048, 8, "fp32", shape=dense, ep_values=(1, 2, 4))} == {1}  # noqa: E741


def test_estimate_memory_reports_experts_and_their_all_to_all(capsys):
    script = load_entry_point("scripts/estimate_memory.py")
    fp32 = ["--zero", "0", "--dtype", "fp32"]
    script.main(["--model", "mixtral-8x7b", "--stages", "2", "--dp", "4", "--ep", "4", *fp32])
    out = capsys.readouterr().out
    assert "layout: pipe 2 x data 4 (experts 4), ZeRO-0" in out
    assert "2 experts per layer on each rank (expert parallelism 4" in out
    per_layer = 2 * 2048 * 2 * 4096 * 4 * 3 / 4
    assert f"each rank sends {per_layer / 1e6:.1f} MB per MoE layer per micro-batch forward" in out
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model", "mixtral-8x7b", "--stages", "2", "--dp", "4", "--ep", "8", *fp32])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "--ep 8 must divide the data-parallel degree 4" in err
    with pytest.raises(SystemExit) as exit_:  # train.py's rule, in the script's flags
        script.main(
            [
                "--model",
                "mixtral-8x7b",
                "--stages",
                "2",
                "--dp",
                "4",
                "--ep",
                "4",
                "--zero",
                "1",
                "--offload",
                "optimizer",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and err == [
        "estimate_memory.py: error: --ep 4 with --offload optimizer: not supported yet (DeepSpeed's CPU Adam is not "
        "run with its MoE parameter groups here); keep the optimizer states on the GPU (--offload none; --zero 1 "
        "shards them over the data axis) or use --ep 1"
    ]
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model", "mixtral-8x7b", "--sp", "2", "--dp", "4"])
    err = capsys.readouterr().err
    assert "--sp with a Mixture-of-Experts model (mixtral) is not supported yet" in err


@pytest.mark.e2e  # three fit searches over every layout of 8 GPUs: seconds
def test_estimate_memory_lists_expert_parallel_layouts_that_fit(capsys):
    script = load_entry_point("scripts/estimate_memory.py")
    fit = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--top", "40"]
    for dtype in ("fp32", "bf16"):
        script.main([*fit, "--dtype", dtype])
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if "ZeRO-" in line]
        experts = [r for r in rows if "(experts" in r]
        assert experts and all(float(r[0]) <= 80 and r[3] != "0.0" and "+offload(opt)," not in r for r in experts)
        assert not any("sequence" in r or "tensor" in r for r in rows)
    script.main([*fit, "--dtype", "fp32", "--ep", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "ZeRO-" in line]
    assert rows and not any("(experts" in r for r in rows) and {r[3] for r in rows} == {"0.0"}  # no all-to-all


def llama4_scout():
    config = config_from_dict(architecture("llama4-scout-17b-16e"))
    return config, shape_of(config)


def test_llama4_computes_every_expert_for_every_token():
    """Hugging Face's Llama4TextExperts runs every token through all E = 16 experts (the input repeated E times,
    scaled by the router scores), not top_k = 1: the compute weights, the FLOPs and the planner's routed activations
    count all 16, plus the shared expert; the model card's active parameters stay top_k's. Other families: top_k."""
    config, shape = llama4_scout()
    counts = spec_parameter_counts(config)
    assert experts_per_token(config) == 16 and shape.moe.experts_per_token == 16 and shape.moe.top_k == 1
    assert spec_weights(config, "compute")[1:] == counts[1:]  # every expert of every layer counts
    assert flops_per_token(config, 2048)[0] == 6.0 * (model_parameters(config) - counts[0])
    assert active_parameters(config) < flops_per_token(config, 2048)[0] / 6 / 5  # 17 B against 107 B
    h, i, e = 5120, 8192, 16
    assert (shape.moe.expert_width, shape.moe.shared_width) == (i, i)
    assert shape.mlp_elements() == 2 * e * h + 4 * e * i + 2 * e + 4 * i  # all 48 layers are MoE layers
    assert experts_per_token(config_from_dict(architecture("qwen3-30b-a3b"))) == 8
    assert experts_per_token(config_from_dict(architecture_of_dense())) == 0
    line = expert_report(Layout(stages=4, dp=2), shape, [12] * 4)[0]
    assert "16 per MoE layer on 48 layers, top 1 (each token runs all 16)" in line
    assert (
        "expert_parallel 2 with llama4_text"
        in ExpertParallelPlan.layout_problems(
            Layout(dp=2, ep=2, dtype="fp32"), ModelFacts(model_type="llama4_text", num_experts=16)
        )[0]
    )


def test_preflight_prints_the_experts_of_a_moe_model(tmp_path, tokenizer_dir):
    """training/configuration/preflight.py: train.py's validation, the planner's table and its expert report."""
    from training.configuration.preflight import check

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    overrides = ["model=mixtral-8x7b", f"model.tokenizer={tokenizer_dir}", "data=text", f"data.train_file={data}"]
    overrides += ["model.architecture.vocab_size=512"]  # the test tokenizer's 512 tokens (data/cache.py)
    overrides += ["num_stages=2", "expert_parallel=4", "precision=fp32", "ds_config=zero0"]
    lines = check(8, [*overrides, f"output_dir={tmp_path / 'out'}", "min_free_disk_gb=0"])
    assert any(line.startswith("experts: 8 per MoE layer on 32 layers, top 2, width 14336") for line in lines), lines
    assert any(line.startswith("  expert all-to-all (dispatch + combine): each rank sends") for line in lines), lines


def test_the_fit_search_refuses_expert_parallelism_in_fp16_as_train_py_does():
    """train.py refuses expert_parallel > 1 in fp16 (ExpertParallelPlan.layout_problems, one rule for both): the
    search proposes none; with ep 2 only, it returns nothing and train.py's line, not a layout."""
    config, shape = mixtral()
    split = splitter(config, None)
    found = fitting(split, shape, 16, 80, 32, 1, 2048, 16, "fp16", 1024)
    assert found and {layout.ep for layout, _ in found} == {1}
    refusals = []
    assert fitting(split, shape, 8, 800, 32, 1, 2048, 8, "fp16", 1024, ep_values=(2,), refusals=refusals) == []
    assert refusals == [
        "expert_parallel 2 with precision=fp16: not supported yet (the experts' gradient reduction, their share of the "
        "gradient norm and their optimizer groups are built and tested in fp32 and bf16 only, not with fp16's loss "
        "scaling); set precision=bf16 (or fp32), or expert_parallel=1"
    ]
    cfg = TrainConfig(precision="fp16", expert_parallel=2)  # train.py's own check says the same line
    assert refusals[0] in ExpertParallelPlan.problems(cfg, config, Layout(stages=2, dp=4, ep=2, dtype="fp16"))


def test_estimate_memory_lists_no_layout_for_flags_train_py_refuses_and_says_its_rule(capsys):
    """--gpus with --offload optimizer and --ep 4: the rule that refuses every such layout, in the script's flags (as
    for one layout), not "add GPUs" nor a --zero 1 that leads into that rule; --zero 0 given: --offload none."""
    script = load_entry_point("scripts/estimate_memory.py")
    fit = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--offload", "optimizer", "--ep", "4"]
    offload = (
        "estimate_memory.py: error: --ep 4 with --offload optimizer: not supported yet (DeepSpeed's CPU Adam is not "
        "run with its MoE parameter groups here); keep the optimizer states on the GPU (--offload none; --zero 1 "
        "shards them over the data axis) or use --ep 1"
    )
    for zero in ([], ["--zero", "1"]):
        with pytest.raises(SystemExit) as exit_:
            script.main([*fit, *zero])
        assert exit_.value.code == 1
        assert capsys.readouterr().err.strip().splitlines() == [
            "estimate_memory.py: error: train.py runs no layout of 8 GPUs with these flags:",
            offload,
        ]
    with pytest.raises(SystemExit):
        script.main([*fit, "--zero", "0"])
    assert capsys.readouterr().err.strip() == (
        "estimate_memory.py: error: --offload optimizer with ZeRO stage 0, where DeepSpeed ignores it: use --offload "
        "none (--ep 4 does not run with the optimizer offloaded; --zero 1 shards the optimizer states over the data "
        "axis)"
    )
    with pytest.raises(SystemExit):
        script.main(["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem", "80", "--ep", "2", "--dtype", "fp16"])
    assert "--ep 2 with --dtype fp16: not supported yet" in capsys.readouterr().err


def test_gpt_oss_120b_fits_8_gpus_of_80_gb():
    """The fit search finds a layout train.py runs for gpt-oss-120b (sink attention, 128 experts a layer) on 8 x 80 GB
    at 4096 tokens a row."""
    config = config_from_dict(architecture("gpt-oss-120b"))
    split = splitter(config, None, "compute")
    found = fitting(split, shape_of(config), 8, 80, config.num_hidden_layers, 1, 4096, 8, "bf16", 1024)
    assert found and all(e.total <= 80e9 for _, e in found)


# docs/moe.md's planner outputs: a block headed by its command as a comment (not "$ ", which test_readme.py runs)
PLANNER_BLOCK = re.compile(r"```text\n# python (scripts/estimate_memory\.py [^\n]*)\n(.*?)```", re.S)


@pytest.mark.slow
def test_moe_docs_layout_tables_are_the_planners_output(capsys):
    """docs/moe.md's layout tables for gpt-oss-120b and DeepSeek-V3 (with and without LoRA) are what
    scripts/estimate_memory.py prints for their commands, its error lines included, run in this process."""
    script = load_entry_point("scripts/estimate_memory.py")
    with open(os.path.join(REPO, "docs", "moe.md")) as f:
        blocks = PLANNER_BLOCK.findall(f.read())
    assert len(blocks) == 6
    for command, expected in blocks:
        try:
            script.main(shlex.split(command)[1:])
        except SystemExit:
            pass
        out = capsys.readouterr()
        printed = [line for line in (out.out + out.err).splitlines() if line.strip() and not line.startswith("[20")]
        assert printed == [line for line in expected.splitlines() if line.strip()], command
