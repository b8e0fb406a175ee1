"""deepspeed train.py trains Mixture-of-Experts models exactly as Hugging Face would, with expert parallelism.

Pipe 2 x data 2 on 4 CPU ranks, five fp32 steps, against a single-process
``<Family>ForCausalLM(output_router_logits=True)`` + torch AdamW loop over the same global batches, micro-batches of one
row (so the reference's router loss is per row, as the run's is per micro-batch). The step's loss: the cross entropy
normalised as Trainer does (``num_items_in_batch``) + router_aux_loss_coef x the mean over the step's micro-batches of
each one's load-balancing loss over every MoE layer.

- qwen3_moe: a dense first layer (mlp_only_layers), the routed layers on both stages; expert_parallel 2, ZeRO-0;
             an eval set; resumed from step 3 on its layout and on one stage without expert parallelism.
- mixtral:   every layer routed; expert_parallel 2 with ZeRO-0, clipping and activation checkpointing; expert_parallel
             2 with ZeRO-1, clipping and the chunked loss, resumed from step 3 on one stage without expert parallelism;
             and on one stage of data 4 (each expert on two ranks: its states partitioned over them) in bf16 at ZeRO-1
             and at ZeRO-0 (DeepSpeed's bf16 optimizer), against the fp32 reference within bf16's rounding.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.sampling import MicroBatchIterator
from models.families import load_config, moe_spec
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.files.pipeline_dir import load_deepspeed_file
from models.loss import label_tokens
from models.router_loss import RouterStats, load_balancing_loss
from models.tiny import write_uneven_sft
from tests.support.models import make_hf_dir
from tests.support.parity import (
    SFT_OPTIM,
    STEPS,
    cached_rows,
    hf_forward,
    max_rel_weight_diff,
    parity_args,
    rel,
    trained_weights,
)
from tests.support.ranks import train_run
from tests.support.runs import read_metrics
from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups

pytestmark = pytest.mark.multirank  # starts DeepSpeed ranks

REL_TOL = 1e-6
SEQ, MICRO, GAS, DP = 128, 1, 2, 2
COEF = 0.5  # large, so that a wrong router loss shows in the loss and the weights
CLIP = 0.5  # Mixtral's runs clip (below every step's gradient norm): the norm counts each expert once
MOE_RUNS = {
    # name: (model_type, config overrides, train.py overrides)
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0]), dict(ds_config="zero0", expert_parallel=2, save_steps=3)),
    "mixtral": (
        "mixtral",
        {},
        {"ds_config": "zero0", "expert_parallel": 2, "activation_checkpoint_interval": 1, "optim.max_grad_norm": CLIP},
    ),
    "mixtral_zero1": (
        "mixtral",
        {},
        {
            "ds_config": "zero1",
            "expert_parallel": 2,
            "optim.max_grad_norm": CLIP,
            "loss_chunk_tokens": 48,
            "save_steps": 3,
            "save_async": "true",  # step 3's checkpoint, resumed on two layouts, written in the background
        },
    ),
}
# One stage, data 4, expert_parallel 2: the expert-data-parallel groups have two ranks, over which DeepSpeed's MoE
# parameter groups partition the experts' states and reduce their gradients; bf16, so compared with the fp32 reference
# within bf16's rounding, far below what a wrong expert gives (the test shows it)
BF16_RUNS = {
    "mixtral_bf16_zero1": {"ds_config": "zero1"},
    "mixtral_bf16_zero0": {"ds_config": "zero0"},
}
BF16_LOSS_REL, BF16_WEIGHT_REL = 2e-3, 1e-2


def reference_run(hf_dir: str, steps: list[list], per_stage: list[list[int]] | None = None, clip: float = 0.0):
    """The single-process loop: per micro-batch Hugging Face's loss with ``num_items_in_batch`` (its cross entropy over
    the step's label tokens + coef x its router loss), the router loss's share divided by the step's micro-batches
    (the mean); AdamW, clipping at ``clip`` (0: none). Returns per step the loss, the mean router loss and the
    pre-clip gradient norm, and the trained model. ``per_stage`` (layers per stage): the router loss computed per
    stage instead, each over its own layers and the losses added (what a pipeline that does not combine the stages
    would train)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    moe = moe_spec(model.config)
    cfg = TrainConfig(optim=OptimConfig(**{**SFT_OPTIM, "max_grad_norm": clip}))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    losses, routers, norms = [], [], []
    for micro_batches in steps:
        n = torch.tensor(sum(label_tokens(labels) for _, labels in micro_batches))
        loss, router_sum = 0.0, 0.0
        for batch in micro_batches:
            out = hf_forward(model, batch, n, output_router_logits=True)
            router = out.aux_loss
            if per_stage is not None:
                logits = dict(zip(moe.moe_layers, out.router_logits))
                router = sum(
                    load_balancing_loss(stats_of([logits[i] for i in layers if i in logits], moe))
                    for layers in per_stage
                )
            loss = loss + out.loss - COEF * out.aux_loss + COEF * router / len(micro_batches)
            router_sum += router.item()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        routers.append(router_sum / len(micro_batches))
    return (losses, routers, norms), model


def computed_batches(rows, len_of: bool = False, dp: int = DP, gas: int = GAS) -> list[list]:
    """Per step, the micro-batches of every data-parallel rank as train.py computes on them: each cut to its longest
    row (a multiple of 8). The router loss counts every token a forward computes, padding included (Hugging Face's
    forward without an attention mask), so the reference takes the same rows. ``len_of``: one pass over ``rows``
    (an eval set), as one list."""
    iterators = [MicroBatchIterator(rows, MICRO, r, dp, False, 0, pad_multiple=8) for r in range(dp)]
    if len_of:
        return [next(it) for it in iterators for _ in range(len(rows) // dp // MICRO)]
    return [[next(it) for it in iterators for _ in range(gas)] for _ in range(STEPS)]


def stats_of(layer_logits: list[torch.Tensor], moe) -> RouterStats:
    stats = RouterStats.zeros(moe.num_experts)
    for logits in layer_logits:
        stats = stats.add_layer(logits, moe.top_k)
    return stats


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("moe")
    data, eval_data = str(root / "train.jsonl"), str(root / "eval.jsonl")
    write_uneven_sft(data, 200, seed=0)
    write_uneven_sft(eval_data, 12, seed=1)
    out = {"root": root}

    def launch(name: str, model_type: str, ranks: int, *extra: str, **overrides) -> None:
        """train.py on ``model_type``'s layer files, the shared SFT data packed, output in ``root / name``."""
        args = parity_args(
            str(root / f"{model_type}-ckpt"), data, str(root / name), SEQ, MICRO, STEPS, SFT_OPTIM, **overrides
        )
        train_run(root, name, ranks, args + ["data.format=sft", "data.packing=true", *extra])

    for name, (model_type, config_overrides, train_overrides) in MOE_RUNS.items():
        if model_type in out:
            hf_dir = out[model_type]
        else:
            hf_dir = make_hf_dir(
                root,
                tokenizer_dir,
                f"{name}-hf",
                model_type=model_type,
                output_router_logits=True,
                router_aux_loss_coef=COEF,
                **config_overrides,
            )
            hf_to_stages(hf_dir, str(root / f"{model_type}-ckpt"))
        evals = [f"data.eval_file={eval_data}"] if name == "qwen3_moe" else []
        overrides = {"num_stages": 2, "gradient_accumulation_steps": GAS, "partition_method": "uniform"}
        launch(name, model_type, 4, *evals, **overrides, **train_overrides)
        out[name] = out[model_type] = hf_dir
    for name, overrides in BF16_RUNS.items():
        bf16 = {"num_stages": 1, "gradient_accumulation_steps": 1, "precision": "bf16", "expert_parallel": 2}
        launch(name, "mixtral", 4, **bf16, **{"optim.max_grad_norm": CLIP}, **overrides)
    # Resumed from a step-3 checkpoint (as a crash right after saving it would leave the run): Qwen3-MoE's (ZeRO-0) on
    # the same layout and on one stage of 2 ranks without expert parallelism (the same global batch), Mixtral's
    # (ZeRO-1: DeepSpeed's MoE parameter groups in its files) on one stage of 2 ranks without expert parallelism
    resumed = {
        "same_layout": ("qwen3_moe", 4, {"num_stages": 2, "expert_parallel": 2, "ds_config": "zero0"}),
        "ep1_one_stage": ("qwen3_moe", 2, {"num_stages": 1, "ds_config": "zero0"}),
        "zero1_ep1_one_stage": (
            "mixtral_zero1",
            2,
            {"num_stages": 1, "ds_config": "zero1", "optim.max_grad_norm": CLIP, "loss_chunk_tokens": 48},
        ),
        # data 2 -> 4 with expert_parallel 2: each expert's states now cut over the two ranks holding it
        "zero1_data4_ep2": (
            "mixtral_zero1",
            4,
            {
                "num_stages": 1,
                "gradient_accumulation_steps": 1,
                "ds_config": "zero1",
                "expert_parallel": 2,
                "optim.max_grad_norm": CLIP,
                "loss_chunk_tokens": 48,
            },
        ),
    }
    for name, (source, ranks, overrides) in resumed.items():
        shutil.copytree(root / source, root / name)
        shutil.rmtree(root / name / f"global_step{STEPS}")
        (root / name / "latest").write_text("global_step3")
        launch(
            name,
            MOE_RUNS[source][0],
            ranks,
            **{"gradient_accumulation_steps": GAS, "partition_method": "uniform", **overrides},
        )
    out["steps"] = steps = computed_batches(cached_rows(str(root / "cache"), data))
    out["qwen3_moe_ref"] = reference_run(out["qwen3_moe"], steps)
    out["mixtral_ref"] = reference_run(out["mixtral"], steps, clip=CLIP)
    data4 = computed_batches(cached_rows(str(root / "cache"), data), dp=4, gas=1)
    out["mixtral_data4_ref"] = reference_run(out["mixtral"], data4, clip=CLIP)
    out["eval"] = computed_batches(cached_rows(str(root / "cache"), eval_data), len_of=True)
    return out


@pytest.mark.parametrize("name", sorted(MOE_RUNS))
def test_moe_training_equals_its_hugging_face_loop(runs, name):
    (losses, routers, norms), model = runs[f"{MOE_RUNS[name][0]}_ref"]
    metrics = read_metrics(str(runs["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    config = load_config(runs[name])
    weight_diff = max_rel_weight_diff(trained_weights(str(runs["root"] / name), config), model)
    print(
        f"{name}: vs {type(model).__name__} loop: loss {loss_diff:.2e} relative, weights {weight_diff:.2e} relative L2"
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    assert losses[-1] < losses[0] - 0.05
    # the progress line's router loss (each micro-batch's, averaged) and the load of the busiest expert
    assert max(rel(m["router_loss"], r) for m, r in zip(metrics, routers)) < REL_TOL
    assert all(1.0 <= m["expert_load_max"] <= 2.0 for m in metrics)  # 4 experts, top-2: at most 2
    if "optim.max_grad_norm" in MOE_RUNS[name][2]:
        assert min(norms) > CLIP  # every step clipped: the norm decides the update
        if name == "mixtral_zero1":  # DeepSpeed's ZeRO-1 reports the pre-clip norm (fp32 at ZeRO-0 keeps none)
            assert max(rel(m["grad_norm"], r) for m, r in zip(metrics, norms)) < 1e-5


def test_a_router_loss_per_stage_would_miss_by_far_more_than_the_tolerance(runs):
    """The stages' layers 2 | 2 (uniform): each stage's router loss over its own layers, added: another model."""
    (per_stage, _, _), _ = reference_run(runs["qwen3_moe"], runs["steps"], per_stage=[[0, 1], [2, 3]])
    metrics = read_metrics(str(runs["root"] / "qwen3_moe"))
    miss = max(rel(m["loss"], r) for m, r in zip(metrics, per_stage))
    print(f"router loss per stage: {miss:.2e} relative from the run")
    assert miss > 1000 * REL_TOL


@torch.no_grad()
def test_eval_reports_cross_entropy_and_the_router_loss_apart(runs):
    """The eval loss is the cross entropy alone (over every label token of the set), the router loss beside it."""
    _, model = runs["qwen3_moe_ref"]
    batches = runs["eval"]
    n = torch.tensor(sum(label_tokens(labels) for _, labels in batches))
    ce, routers = 0.0, []
    for batch in batches:
        out = hf_forward(model, batch, n, output_router_logits=True)
        ce += (out.loss - COEF * out.aux_loss).item()
        routers.append(out.aux_loss.item())
    record = read_metrics(str(runs["root"] / "qwen3_moe"), "eval")[-1]
    assert rel(record["eval_loss"], ce) < REL_TOL
    assert rel(record["eval_router_loss"], sum(routers) / len(routers)) < REL_TOL
    assert abs(record["eval_loss"] - ce) * 1000 < COEF * min(routers)  # the router loss is not in the eval loss


def test_each_rank_held_its_share_of_the_experts(runs):
    """expert_parallel 2: each rank of a stage holds 2 of the 4 experts of each MoE layer (the announcement counts them
    per rank), and the export of the trained run holds all four."""
    log = (runs["root"] / "qwen3_moe.log").read_text()
    assert "world 4 = pipe 2 x data 2 (experts 2)" in log
    assert "4 per MoE layer over expert_parallel 2 ranks of each stage (2 per rank" in log
    layouts = {name: read_metrics(str(runs["root"] / name))[0]["layout"]["experts"] for name in (*MOE_RUNS, *BF16_RUNS)}
    assert layouts == {
        "qwen3_moe": 2,
        "mixtral": 2,
        "mixtral_zero1": 2,
        "mixtral_bf16_zero1": 2,
        "mixtral_bf16_zero0": 2,
    }


@pytest.mark.parametrize("name", sorted(BF16_RUNS))
def test_bf16_expert_parallel_runs_follow_the_fp32_reference_within_bf16s_rounding(runs, name):
    """Data 4, expert_parallel 2, bf16 (ZeRO-1; ZeRO-0: DeepSpeed's bf16 optimizer): each expert's states on the two
    ranks holding it, its gradient summed over them. Losses, pre-clip gradient norms (each expert counted once) and
    weights follow the fp32 reference within bf16's rounding; a model whose experts of one rank were the other's (what
    partitioning over the whole data axis did) is 10 times farther."""
    (losses, _, norms), model = runs["mixtral_data4_ref"]
    metrics = read_metrics(str(runs["root"] / name))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses))
    norm_diff = max(rel(m["grad_norm"], r) for m, r in zip(metrics, norms))
    weights = trained_weights(str(runs["root"] / name), load_config(runs["mixtral"]))
    weight_diff = max_rel_weight_diff(weights, model)
    print(f"{name}: vs the fp32 loop: loss {loss_diff:.2e}, grad norm {norm_diff:.2e}, weights {weight_diff:.2e}")
    assert loss_diff < BF16_LOSS_REL and norm_diff < 5 * BF16_LOSS_REL and weight_diff < BF16_WEIGHT_REL
    assert min(norms) > CLIP
    swapped = {k: torch.cat([v[:2], v[:2]]) if ".experts." in k else v for k, v in model.state_dict().items()}
    assert max_rel_weight_diff(swapped, model) > 10 * BF16_WEIGHT_REL


@pytest.mark.parametrize("name", ["same_layout", "ep1_one_stage", "zero1_ep1_one_stage", "zero1_data4_ep2"])
def test_resumed_moe_run_continues_the_reference_exactly(runs, name):
    """The step-3 checkpoint of an expert_parallel 2 run, resumed on its own layout, on one stage without expert
    parallelism, and on one stage of data 4 (the same global batch): steps 4-5 as the reference's (every expert's
    Adam moments were saved, each rank read its own)."""
    log = (runs["root"] / f"{name}.log").read_text()
    assert f"steps 4..{STEPS} (resumed from global_step3)" in log
    family = "mixtral" if name.startswith("zero1") else "qwen3_moe"
    (losses, _, _), model = runs[f"{family}_ref"]
    resumed = read_metrics(str(runs["root"] / name))  # steps 1-3 as the checkpoint's metrics.jsonl held them
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    resumed = resumed[3:]
    assert max(rel(m["loss"], r) for m, r in zip(resumed, losses[3:])) < REL_TOL
    config = load_config(runs[family])
    assert max_rel_weight_diff(trained_weights(str(runs["root"] / name), config), model) < REL_TOL


def test_export_after_training_equals_the_reference_model(runs, tmp_path):
    """The expert_parallel 2 run's final checkpoint exported to Hugging Face (one tensor per expert) loads with
    from_pretrained as the reference model's weights."""
    stages_to_hf(str(runs["root"] / "qwen3_moe"), str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    _, model = runs["qwen3_moe_ref"]
    assert max_rel_weight_diff(exported.state_dict(), model) < REL_TOL


def test_each_rank_saves_only_its_experts_moments(runs, tmp_path):
    """expert_parallel 2: DeepSpeed's engine file of each stage holds data-parallel rank 0's experts' Adam moments, the
    other expert rank's are in a file of its own (no rank gathers them); a checkpoint missing one is refused whole."""
    from training.checkpoints.reshard import SavedOptimizerState

    tag = runs["root"] / "qwen3_moe" / "global_step3"
    engine = load_deepspeed_file(str(tag / "mp_rank_01_model_states.pt"))["optimizer"]["state"]
    own = load_deepspeed_file(str(tag / "expert_moments_mp_rank_01_ep_01.pt"))["optimizer"]["state"]
    assert own and all(engine[i]["exp_avg"].shape == own[i]["exp_avg"].shape for i in own)
    assert {engine[i]["exp_avg"].shape[0] for i in own} == {2}  # 2 of the 4 experts each
    shutil.copytree(tag, tmp_path / "tag")
    (tmp_path / "tag" / "expert_moments_mp_rank_01_ep_01.pt").unlink()
    assert (
        "stage 1's expert-parallel ranks [1] are expected, [] found"
        in SavedOptimizerState(str(tmp_path / "tag")).problems[0]
    )


def test_zero1_expert_states_reshard_to_the_portable_form(runs, tmp_path):
    """convert2ckpt.py --reshard of the expert_parallel 2 ZeRO-1 checkpoint: every expert's states joined from
    DeepSpeed's MoE parameter groups (each expert slot's partitions), the same in the portable form; the experts of
    the two slots differ (a join that took one slot twice would not)."""
    from training.checkpoints.reshard import SavedOptimizerState, reshard

    tag = runs["root"] / "mixtral_zero1" / "global_step3"
    saved = SavedOptimizerState(str(tag))
    assert not saved.problems and saved.format == "ZeRO-1/2"
    reshard(str(runs["root"] / "mixtral_zero1"), str(tmp_path / "portable"), tag="global_step3")
    portable = SavedOptimizerState(str(tmp_path / "portable" / "global_step3"))
    experts = [k for k in saved.keys() if k[1].endswith("experts.gate_up_proj")]
    assert len(experts) == 4  # one per layer
    for key in experts:
        whole, again = saved.get(key), portable.get(key)
        assert set(whole) == {"fp32", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(whole[s], again[s]) for s in whole)
        halves = whole["exp_avg"].view(4, -1)
        assert not torch.equal(halves[:2], halves[2:])
