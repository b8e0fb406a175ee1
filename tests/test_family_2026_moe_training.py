"""deepspeed train.py trains gpt-oss, Qwen3.5-MoE and DeepSeek-V3 with expert parallelism exactly as Hugging Face
would: pipe 2 x data 2 on 4 CPU ranks, expert_parallel 2, five fp32 steps of packed SFT data, against a
single-process ``<Family>ForCausalLM`` + torch AdamW loop over the same global batches.

The reference runs each document of a packed row apart (gpt-oss's and Qwen3.5's Hugging Face models attend, and
carry the DeltaNet's state, across packed documents), its loss Hugging Face's ``loss_function`` over the step's label
tokens (``num_items_in_batch``) + router_aux_loss_coef x the family's ``load_balancing_loss_func`` over the
micro-batch's router logits (every document's, every layer's), averaged over the step's micro-batches, for the
families with a router loss. Each family's special layers sit on both stages:

- gpt_oss:          a sliding and a full layer on each stage (sinks and the experts' biases non-zero); ZeRO-1.
- qwen3_5_moe_text: a linear-attention (Gated DeltaNet) and a full layer on each stage; ZeRO-0.
- deepseek_v3:      a dense layer (first_k_dense_replace=1) and a routed one on stage 0, two routed on stage 1,
                    grouped routing (4 groups, the best 2 kept) with a non-zero router bias moved after each step
                    (moe.bias_update_speed, the rule written out in the reference, the loads of all four ranks);
                    ZeRO-0; resumed from step 3 on one stage of 2 ranks without expert parallelism; and in bf16 at
                    ZeRO-1 against the same fp32 loop within bf16's rounding, its router biases fp32.

AdamW at eps 1e-6 (OPTIM). Losses, router losses and weights within 1e-6 relative, but for Qwen3.5's DeltaNet decay
tensors (DECAY_TOL, the reason there). Each trained run exported to Hugging Face loads with ``from_pretrained``
and gives the reference model's loss.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM

from models.families import load_config, moe_spec
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.loss import IGNORE_INDEX, label_tokens
from models.tiny import write_uneven_sft
from tests.support.models import make_hf_dir
from tests.support.parity import SFT_OPTIM, STEPS, cached_rows, max_rel_weight_diff, parity_args, rel, trained_weights
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from tests.test_family_deepseek_v3 import BIAS, step_loads
from tests.test_moe_training import BF16_LOSS_REL, BF16_WEIGHT_REL, computed_batches
from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

REL_TOL = 1e-6
SEQ, MICRO, GAS = 128, 1, 2
COEF = 0.5  # large, so that a wrong router loss shows in the loss and the weights
SPEED = 0.01  # DeepSeek-V3's bias update: 10 x the report's, so that the biases move visibly in five steps
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=COEF)
LINEAR, FULL = "linear_attention", "full_attention"
RUNS = {
    # model_type: (config overrides, train.py overrides). gpt_oss first: its run prepares the shared data cache (a
    # Qwen3.5 directory's AutoTokenizer is Qwen3_5Tokenizer, 513 tokens with the tiny tokenizer's files: refused)
    "gpt_oss": (ROUTER_LOSS, {"ds_config": "zero1"}),
    "qwen3_5_moe_text": ({**ROUTER_LOSS, "layer_types": [LINEAR, FULL, LINEAR, FULL]}, {"ds_config": "zero0"}),
    "deepseek_v3": (
        dict(num_hidden_layers=4),  # layer 0 dense, 1-3 routed over 8 experts in 4 groups
        {"ds_config": "zero0", "save_steps": 3, "moe.bias_update_speed": SPEED},
    ),
}
# gpt-oss's sinks need Hugging Face's eager attention (its sdpa drops them)
ATTENTION = {"gpt_oss": "eager", "qwen3_5_moe_text": "sdpa", "deepseek_v3": "sdpa"}
# Qwen3.5's DeltaNet decay (g = -exp(A_log) softplus(in_proj_a x + dt_bias)) gets gradients of ~1e-6, which the
# router loss's share makes differ by ~3e-4 relative between the stages and Hugging Face in fp32 (they agree in fp64
# and without the router loss): Adam's normalised steps carry that into these tensors. At eps 1e-6 (OPTIM; 1e-8
# gives 6e-4) they measure ~1.4e-5, every other weight ~1e-7; the router loss left out misses by 2e-2
DECAY = ("linear_attn.in_proj_a.weight", "linear_attn.dt_bias", "linear_attn.A_log")
DECAY_TOL = 1e-4
OPTIM = dict(SFT_OPTIM, eps=1e-6)
BATCHED = {"qwen3_5_moe_text"}  # forward_apart: the documents as the rows of one batch
# What each stage holds: partition_method=type:DecoderLayerPipe splits the 4 layers 2 | 2 (specs 0-2: the embedding,
# layers 0-1; specs 3-6: layers 2-3, the norm, the head); uniform would split the 7 specs 4 | 3
PARTITION, STAGE_SPECS, STAGE_LAYERS = "type:DecoderLayerPipe", ("0..2", "3..6"), ([0, 1], [2, 3])


# Values a trained checkpoint has where Hugging Face's initialisation leaves zeros (or near): gpt-oss's experts' and
# router's biases and its sinks, DeepSeek-V3's router bias (it changes which experts are picked); name end: scale
PERTURBED = {
    "gpt_oss": {"_proj_bias": 0.1, "router.bias": 0.1, "sinks": 1.0},
    "deepseek_v3": {BIAS: 0.01},
}


@torch.no_grad()
def perturb_(hf_dir: str, model_type: str) -> None:
    """:data:`PERTURBED`'s tensors of the model in ``hf_dir`` drawn from N(0, scale), saved back."""
    if model_type not in PERTURBED:
        return
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        scale = next((s for end, s in PERTURBED[model_type].items() if name.endswith(end)), None)
        if scale is not None:
            t.copy_(torch.randn(t.shape, generator=g) * scale)
    model.save_pretrained(hf_dir)


def document_bounds(positions: torch.Tensor) -> list[tuple[int, int]]:
    """One row's documents: where its positions do not continue by +1 (transformers' rule for packed sequences);
    the row's padding, whose positions count on, belongs to its last document."""
    starts = [0] + [t for t in range(1, len(positions)) if positions[t] != positions[t - 1] + 1] + [len(positions)]
    return list(zip(starts[:-1], starts[1:]))


def forward_apart(model, batch, n: torch.Tensor):
    """One micro-batch, each document of each row through ``model`` apart: (its cross entropy over ``n`` label
    tokens, the family's load-balancing loss over every document's router logits of every layer, or None). Qwen3.5's
    documents run as the rows of one batch, right-padded (masked), as its stages' DeltaNet regroups them: two exact
    arrangements of its decay's gradient (in_proj_a, dt_bias, A_log) part by 1e-4 relative, which Adam carries into
    the weights; the others one forward per document."""
    (input_ids, position_ids), labels = batch
    moe = moe_spec(model.config)
    docs = [
        (input_ids[r, a:b], position_ids[r, a:b], labels[r, a:b])
        for r in range(input_ids.shape[0])
        for a, b in document_bounds(position_ids[r].tolist())
    ]
    if model.config.model_type in BATCHED:
        mask = pad_sequence([torch.ones_like(ids) for ids, _, _ in docs], batch_first=True)  # [N,Lmax]
        pieces = [[pad_sequence(t, batch_first=True) for t in list(zip(*docs))[:2]]]
        pieces[0].append(pad_sequence([lab for _, _, lab in docs], batch_first=True, padding_value=IGNORE_INDEX))
    else:
        mask = None
        pieces = [[t[None] for t in doc] for doc in docs]
    ce, router_logits = 0.0, []
    for ids, positions, doc_labels in pieces:
        kwargs = {"output_router_logits": True} if moe.router_loss else {}
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False, **kwargs)
        ce = ce + model.loss_function(out.logits, doc_labels, model.config.vocab_size, num_items_in_batch=n)
        if moe.router_loss:
            router_logits.append(out.router_logits)
    if not moe.router_loss:
        return ce, None
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*router_logits))  # each layer's [T,E], every document
    return ce, balance(layers, moe.num_experts, moe.top_k, mask)


def micro_batch_loss(model, batch, n: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, float]:
    """A micro-batch's share of the step's loss (its cross entropy + coef x its router loss / the step's
    micro-batches), and its router loss (0 without one)."""
    ce, router = forward_apart(model, batch, n)
    if router is None:
        return ce, 0.0
    return ce + model.config.router_aux_loss_coef * router / micro_batches, router.item()


def reference_run(hf_dir: str, model_type: str, steps: list[list], speed: float = 0.0):
    """The single-process loop over ``steps`` (per step, every rank's micro-batches as train.py computes them);
    with ``speed``, after each step every router bias moved by ``speed * sign(mean load - load)`` from the step's
    loads (tests/test_deepseek_bias_update.py's rule). Returns per step the loss and the mean router loss, and the
    trained model."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=ATTENTION[model_type])
    cfg = TrainConfig(optim=OptimConfig(**OPTIM))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    loads = step_loads(model) if speed else {}
    losses, routers = [], []
    for micro_batches in steps:
        n = torch.tensor(sum(label_tokens(labels) for _, labels in micro_batches))
        loss, router_sum = 0.0, 0.0
        for batch in micro_batches:
            share, router = micro_batch_loss(model, batch, n, len(micro_batches))
            loss, router_sum = loss + share, router_sum + router
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():
            for layer, load in loads.items():
                load = load.float()
                model.get_buffer(f"model.layers.{layer}.{BIAS}").add_(speed * torch.sign(load.mean() - load))
        loads.clear()
        losses.append(loss.item())
        routers.append(router_sum / len(micro_batches))
    return (losses, routers), model


def weight_diffs(weights: dict[str, torch.Tensor], model) -> tuple[float, float]:
    """(relative L2 difference of every weight but Qwen3.5's DeltaNet decay tensors, the worst of those alone)."""
    decay = {k: v for k, v in weights.items() if k.endswith(DECAY)}
    rest = max_rel_weight_diff({k: v for k, v in weights.items() if k not in decay}, model)
    return rest, max((max_rel_weight_diff({k: v}, model) for k, v in decay.items()), default=0.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("moe2026")
    data = str(root / "train.jsonl")
    write_uneven_sft(data, 200, seed=0)
    out = {"root": root}

    def launch(name: str, model_type: str, ranks: int, **overrides) -> None:
        args = parity_args(
            str(root / f"{model_type}-ckpt"), data, str(root / name), SEQ, MICRO, STEPS, OPTIM, **overrides
        )
        train_run(root, name, ranks, args + ["data.format=sft", "data.packing=true"])

    layout = {"gradient_accumulation_steps": GAS, "partition_method": PARTITION}
    for model_type, (config_overrides, train_overrides) in RUNS.items():
        hf_dir = make_hf_dir(root, tokenizer_dir, f"{model_type}-hf", model_type=model_type, **config_overrides)
        perturb_(hf_dir, model_type)
        hf_to_stages(hf_dir, str(root / f"{model_type}-ckpt"))
        launch(model_type, model_type, 4, num_stages=2, expert_parallel=2, **layout, **train_overrides)
        out[f"{model_type}-hf"] = hf_dir
    # DeepSeek-V3's step-3 checkpoint (as a crash right after saving it would leave the run) on one stage of 2 ranks
    # without expert parallelism: the same global batch, its biases as step 3 left them
    shutil.copytree(root / "deepseek_v3", root / "deepseek_v3_resumed")
    shutil.rmtree(root / "deepseek_v3_resumed" / f"global_step{STEPS}")
    (root / "deepseek_v3_resumed" / "latest").write_text("global_step3")
    launch("deepseek_v3_resumed", "deepseek_v3", 2, num_stages=1, **layout, **RUNS["deepseek_v3"][1])
    # DeepSeek-V3 in bf16 at ZeRO-1 on the same layout: its router bias stays an fp32 buffer
    bf16 = {**RUNS["deepseek_v3"][1], "ds_config": "zero1", "precision": "bf16", "save_steps": 0}
    launch("deepseek_v3_bf16", "deepseek_v3", 4, num_stages=2, expert_parallel=2, **layout, **bf16)

    out["steps"] = steps = computed_batches(cached_rows(str(root / "cache"), data))
    for model_type, (_, train_overrides) in RUNS.items():
        speed = train_overrides.get("moe.bias_update_speed", 0.0)
        out[f"{model_type}-ref"] = reference_run(out[f"{model_type}-hf"], model_type, steps, speed)
    return out


@pytest.mark.parametrize("model_type", sorted(RUNS))
def test_expert_parallel_training_equals_its_hugging_face_loop(runs, model_type):
    (losses, routers), model = runs[f"{model_type}-ref"]
    metrics = read_metrics(str(runs["root"] / model_type))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    weights = trained_weights(str(runs["root"] / model_type), load_config(runs[f"{model_type}-hf"]))
    weight_diff, decay_diff = weight_diffs(weights, model)
    print(
        f"{model_type}: vs {type(model).__name__} loop: loss {loss_diff:.2e}, weights {weight_diff:.2e} relative"
        + (f" (DeltaNet decay tensors: worst {decay_diff:.2e})" if decay_diff else "")
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL and decay_diff < DECAY_TOL
    assert losses[-1] < losses[0] - 0.05  # the run learns: the comparison is not over a frozen model
    moe = moe_spec(model.config)
    # the tokens spread over the experts: the busiest takes well under every token (E/k x the mean)
    assert min(m["expert_load_max"] for m in metrics) < 0.6 * moe.num_experts / moe.top_k
    if moe.router_loss:
        assert max(rel(m["router_loss"], r) for m, r in zip(metrics, routers)) < REL_TOL


def test_deepseek_v3_router_bias_moves_as_the_rule_over_all_ranks_loads(runs):
    """The biases the run saved after step 5 equal the reference's bit for bit (each moved by +-speed per step from
    the loads of the global batch: a load counted on one rank only would flip signs), and they moved."""
    _, model = runs["deepseek_v3-ref"]
    weights = trained_weights(str(runs["root"] / "deepseek_v3"), model.config)
    initial = AutoModelForCausalLM.from_pretrained(runs["deepseek_v3-hf"], dtype=torch.float32)
    for layer in moe_spec(model.config).moe_layers:
        key = f"model.layers.{layer}.{BIAS}"
        assert torch.equal(weights[key], model.get_buffer(key)), key
        assert (weights[key] - initial.get_buffer(key)).abs().max() > 2 * SPEED, key


def test_resumed_on_one_stage_without_expert_parallelism_continues_the_reference(runs):
    """DeepSeek-V3's step-3 checkpoint of the expert_parallel 2 run (ZeRO-0: each expert rank's Adam moments in its
    own file) resumed on one stage of 2 ranks: steps 4-5, the final weights and biases as the reference's."""
    log = (runs["root"] / "deepseek_v3_resumed.log").read_text()
    assert f"steps 4..{STEPS} (resumed from global_step3)" in log
    (losses, _), model = runs["deepseek_v3-ref"]
    resumed = read_metrics(str(runs["root"] / "deepseek_v3_resumed"))
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert max(rel(m["loss"], r) for m, r in zip(resumed[3:], losses[3:])) < REL_TOL
    weights = trained_weights(str(runs["root"] / "deepseek_v3_resumed"), model.config)
    assert max_rel_weight_diff(weights, model) < REL_TOL
    for layer in moe_spec(model.config).moe_layers:
        key = f"model.layers.{layer}.{BIAS}"
        assert torch.equal(weights[key], model.get_buffer(key)), key


def test_deepseek_v3_in_bf16_follows_the_fp32_reference_within_bf16s_rounding(runs):
    """bf16 at ZeRO-1, expert_parallel 2: losses and weights within bf16's rounding of the fp32 loop, and the router
    biases fp32 buffers moved by whole steps of the speed (in bf16 a step of 0.01 at a bias of 0.5 would round away)."""
    (losses, _), model = runs["deepseek_v3-ref"]
    metrics = read_metrics(str(runs["root"] / "deepseek_v3_bf16"))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    weights = trained_weights(str(runs["root"] / "deepseek_v3_bf16"), model.config)
    weight_diff = max_rel_weight_diff({k: v.float() for k, v in weights.items()}, model)
    print(f"deepseek_v3 bf16: vs the fp32 loop: loss {loss_diff:.2e}, weights {weight_diff:.2e} relative")
    assert loss_diff < BF16_LOSS_REL and weight_diff < BF16_WEIGHT_REL
    initial = AutoModelForCausalLM.from_pretrained(runs["deepseek_v3-hf"], dtype=torch.float32)
    for layer in moe_spec(model.config).moe_layers:
        key = f"model.layers.{layer}.{BIAS}"
        assert weights[key].dtype == torch.float32, key
        steps = (weights[key] - initial.get_buffer(key)) / SPEED  # [E] a sum of +-1 per step
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() >= 3, (key, steps)
    assert "bf16" in (runs["root"] / "deepseek_v3_bf16.log").read_text()


def test_each_run_used_the_layout_it_asked_for(runs):
    """Pipe 2 x data 2 with expert_parallel 2 (each rank holding half of each MoE layer's experts), and each
    family's special layers on both stages (a setting silently ignored would make the parity prove less)."""
    for model_type in RUNS:
        log = (runs["root"] / f"{model_type}.log").read_text()
        config = load_config(runs[f"{model_type}-hf"])
        experts = moe_spec(config).num_experts
        assert "world 4 = pipe 2 x data 2 (experts 2)" in log, model_type
        assert f"{experts} per MoE layer over expert_parallel 2 ranks of each stage ({experts // 2} per rank" in log
        assert read_metrics(str(runs["root"] / model_type))[0]["layout"]["experts"] == 2
        assert f"(model_type {model_type}), 4 decoder layers | partition_method={PARTITION}" in log
        for rank in range(4):
            assert f"rank {rank}: stage {rank // 2} specs {STAGE_SPECS[rank // 2]} " in log, (model_type, rank)
    for layers in STAGE_LAYERS:
        gpt_oss = load_config(runs["gpt_oss-hf"])
        assert sorted(gpt_oss.layer_types[i] for i in layers) == ["full_attention", "sliding_attention"]
        qwen = load_config(runs["qwen3_5_moe_text-hf"])
        assert sorted(qwen.layer_types[i] for i in layers) == [FULL, LINEAR]
    deepseek = load_config(runs["deepseek_v3-hf"])
    assert moe_spec(deepseek).moe_layers == (1, 2, 3) and deepseek.n_group > deepseek.topk_group > 1
    assert "world 2 = pipe 1 x data 2" in (runs["root"] / "deepseek_v3_resumed.log").read_text()


@pytest.mark.parametrize("model_type", sorted(RUNS))
def test_export_after_training_gives_the_reference_models_loss(runs, model_type, tmp_path):
    """The trained run exported to Hugging Face (every expert whole) loads with from_pretrained and computes the
    reference model's loss on the first step's first micro-batch."""
    stages_to_hf(str(runs["root"] / model_type), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation=ATTENTION[model_type]
    )
    _, model = runs[f"{model_type}-ref"]
    batch = runs["steps"][0][0]
    n = torch.tensor(label_tokens(batch[1]))
    with torch.no_grad():
        ours, ref = (micro_batch_loss(m, batch, n, 1)[0].item() for m in (exported, model))
    assert rel(ours, ref) < REL_TOL, (ours, ref)
    weight_diff, decay_diff = weight_diffs(exported.state_dict(), model)
    assert weight_diff < REL_TOL and decay_diff < DECAY_TOL
