"""train_objective=grpo through train.py equals TRL's GRPOTrainer fed the same completions (its rollout_func), fp32:
loss per step and the exported weights, for each loss type, beta 0 and > 0, num_iterations 1 and 2 on pipe 2 x data
2, with tensor parallelism inside the stages and for a MoE family; the rewards, advantages and metrics it logs are
TRL's; LoRA trains against the base; a resumed run equals the uninterrupted one; a failing reward function stops the
run with its name, the checkpoint intact.

The pipeline run generates on its own stages (sampled, seeded per step and rank) and writes every completion to
completions.jsonl; the reference (tests/support/grpo_reference.py) trains TRL on those completions in one process
(micro-batch 2, gradient_accumulation_steps 2 x dp)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.support.grpo_reference import read_generations, trl_grpo_reference
from tests.support.grpo_rewards import letter_share, names_target
from tests.support.models import make_hf_dir
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics
from tests.support.scripts import load_entry_point

STEPS, MICRO, GAS, GENERATIONS, COMPLETION = 4, 2, 2, 4, 8
LR, EPS = 2e-3, 1e-5  # Adam's eps above the gradients' fp32 noise (tests/support/grpo_reference.py's note)
REL_TOL = 1e-5  # of each step's loss, against the loss's own scale (the mean |advantage|: a loss near 0 stays one)
WEIGHT_TOL = 1e-5  # the weights' distance from TRL's, over the distance they moved
WORDS = ["apple", "river", "stone", "green", "light", "music", "table", "cloud"]
# (loss type, beta, num_iterations, other grpo settings, other train.py settings): every loss type, beta 0 and > 0,
# num_iterations 1 and 2 on pipe 2 x data 2; tensor parallelism inside the stages (pipe 2 x tensor 2); LoRA
CASES = {
    "dapo": ("dapo", 0.0, 1, {}, {}),
    "grpo": ("grpo", 0.04, 2, {"epsilon_high": 0.28}, {"save_steps": 1}),
    "bnpo": ("bnpo", 0.0, 2, {"mask_truncated_completions": True}, {}),
    "dr_grpo": ("dr_grpo", 0.04, 1, {"scale_rewards": "batch"}, {"eval_steps": 2}),  # and eval prompts
    "tensor_parallel": ("dapo", 0.04, 1, {}, {"tensor_parallel": 2}),
    "lora": ("dapo", 0.04, 1, {}, {"peft.method": "lora"}),
    "moe": ("dapo", 0.0, 1, {}, {}),
}
PARITY = ("dapo", "grpo", "bnpo", "dr_grpo", "tensor_parallel", "moe")
# the MoE case's model: Qwen3-MoE without a router loss (TRL's GRPOTrainer adds router_aux_loss_coef x its masked
# load-balancing loss whenever the coefficient is not 0; train.py adds its own where output_router_logits says so)
MOE = dict(model_type="qwen3_moe", router_aux_loss_coef=0.0)


def data_parallel(case: str) -> int:
    return 4 // 2 // CASES[case][4].get("tensor_parallel", 1)


def eos_prone_model(root, tokenizer_dir: str, name: str = "eos_prone", **config) -> str:
    """The tiny Llama (near-uniform over its vocabulary) with its EOS logit raised after the tokens below 64 (their
    hidden states' direction): about half the completions of COMPLETION tokens end with EOS, the others are
    truncated (both kinds train)."""
    from transformers import AutoModelForCausalLM

    path = make_hf_dir(root, tokenizer_dir, name, **config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(3, 512, (16, 32), generator=torch.Generator().manual_seed(0))  # [16,32]
        hidden = model.model(input_ids=ids).last_hidden_state  # [16,32,H]
        low = ids < 64
        direction = hidden[low].mean(0) - hidden[~low].mean(0)  # [H]
        gap = (hidden[low] @ direction).mean() - (hidden[~low] @ direction).mean()
        model.lm_head.weight[model.config.eos_token_id] = 3.0 * direction / gap
    model.save_pretrained(path)
    return path


def write_prompts(path: str, count: int) -> list[dict]:
    records = [
        {"prompt": f"Tell me about the {WORDS[i % 8]} by the {WORDS[i * 3 % 8]}", "target": WORDS[i % 8][:2]}
        for i in range(count)
    ]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records


def grpo_args(model: str, prompts: str, out: str, case: str, **overrides) -> list[str]:
    loss_type, beta, iterations, extra, run = CASES[case]
    args = {
        "model_name_or_path": model,
        "output_dir": out,
        "data": "grpo",
        "data.train_file": prompts,
        "data.max_seq_length": 32,
        "data.shuffle": "false",  # the reference's shuffle_dataset=False
        "num_stages": 2,
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "precision": "fp32",
        "optim.lr": LR,
        "optim.eps": EPS,
        "optim.max_grad_norm": 1.0,
        "grpo.num_generations": GENERATIONS,
        "grpo.max_completion_length": COMPLETION,
        "grpo.loss_type": loss_type,
        "grpo.beta": beta,
        "grpo.num_iterations": iterations,
        "grpo.reward_funcs": "[tests.support.grpo_rewards:letter_share,tests.support.grpo_rewards:names_target]",
        "grpo.reward_weights": "[1.0,0.5]",
        **{f"grpo.{k}": v for k, v in extra.items()},
        **run,
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, tokenizer_dir):
    """One 4-rank run per case (a checkpoint after every step of the grpo case, for the resume test)."""
    from models.files.hf_convert import hf_to_stages

    root = tmp_path_factory.mktemp("grpo")
    model = eos_prone_model(root, tokenizer_dir)
    layer_files = str(root / "eos_prone_ckpt")  # LoRA adapts a base in layer files
    hf_to_stages(model, layer_files)
    moe = eos_prone_model(root, tokenizer_dir, "eos_prone_moe", **MOE)
    prompts = str(root / "prompts.jsonl")
    records = write_prompts(prompts, 12)
    eval_prompts = str(root / "eval_prompts.jsonl")
    write_prompts(eval_prompts, 3)
    runs = {}
    for case in CASES:
        out = str(root / case)
        start = {"lora": layer_files, "moe": moe}.get(case, model)
        args = grpo_args(start, prompts, out, case)
        if "eval_steps" in CASES[case][4]:
            args.append(f"data.eval_file={eval_prompts}")
        proc = run_deepspeed(4, "train.py", args, str(root / f"{case}.log"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        runs[case] = dict(out=out, log=proc.stdout)
    return dict(root=root, model=model, moe=moe, prompts=prompts, records=records, runs=runs)


def reference(runs: dict, case: str, loss_type: str | None = None, scored: list | None = None):
    """TRL's GRPOTrainer on the case's completions (``loss_type``: another one, to show it does not match)."""
    own_type, beta, iterations, extra, _ = CASES[case]
    generations = read_generations(os.path.join(runs["runs"][case]["out"], "completions.jsonl"), iterations)
    return trl_grpo_reference(
        runs["moe" if case == "moe" else "model"],
        runs["records"],
        generations,
        reward_funcs=[letter_share, names_target],
        reward_weights=[1.0, 0.5],
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        beta=beta,
        loss_type=loss_type or own_type,
        num_iterations=iterations,
        steps=STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS * data_parallel(case),
        lr=LR,
        eps=EPS,
        max_grad_norm=1.0,
        scored=scored,
        **extra,
    )


def exported_weights(out: str, root) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    export = str(root / f"export_{os.path.basename(out)}")
    if not os.path.isdir(export):  # exported once per run
        assert load_entry_point("convert2ckpt.py").main(["--to-hf", "--input", out, "--output", export]) == 0
    return AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()


def weight_error(ours: dict, theirs: dict, start: dict) -> tuple[float, float]:
    """(distance from TRL's weights, distance TRL's moved from the start), all weights as one vector."""
    dist = lambda d: sum(((d[k] - theirs[k]) ** 2).sum() for k in theirs).sqrt().item()  # noqa: E731
    return dist(ours), dist(start)


def loss_errors(ours: list[float], theirs: list[float], scale: float) -> list[float]:
    return [abs(a - b) / scale for a, b in zip(ours, theirs, strict=True)]


@pytest.mark.multirank
@pytest.mark.parametrize("case", PARITY)
def test_the_update_is_trls(grpo_runs, case):
    from transformers import AutoModelForCausalLM

    run = grpo_runs["runs"][case]
    scored: list = []
    losses, weights, trl_metrics = reference(grpo_runs, case, scored=scored)
    metrics = read_metrics(run["out"])
    ours = [m["loss"] for m in metrics]
    lines = [json.loads(line) for line in open(os.path.join(run["out"], "completions.jsonl"))]
    # the completions.jsonl rewards and advantages are TRL's, for every generation
    advantages = [line["advantage"] for line in lines]
    theirs_adv = [a for s in scored for a in s["advantages"]]
    assert advantages == pytest.approx(theirs_adv, abs=1e-6)
    scale = sum(abs(a) for a in advantages) / len(advantages)
    errors = loss_errors(ours, losses, scale)
    model = grpo_runs["moe" if case == "moe" else "model"]
    start = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    off, moved = weight_error(exported_weights(run["out"], grpo_runs["root"]), weights, start)
    print(f"GRPO {case} vs GRPOTrainer: losses {ours} vs {losses}: {max(errors):.2e} of the mean |advantage|; ")
    print(f"weights {off / moved:.2e} of the distance moved")
    assert len(ours) == len(losses) == STEPS
    assert max(errors) < REL_TOL
    assert off < WEIGHT_TOL * moved
    kinds = {line["completion_ids"][-1] == 2 for line in lines}
    assert kinds == {True, False}, "both completions ending with EOS and truncated ones"
    # every generation step logs TRL's reward metrics
    for m, t in zip(metrics, trl_metrics, strict=True):
        if "reward" in t:
            assert m["reward"] == pytest.approx(t["reward"], abs=1e-6)
            assert m["reward_std"] == pytest.approx(t["reward_std"], abs=1e-6)
            assert m["frac_reward_zero_std"] == pytest.approx(t["frac_reward_zero_std"], abs=1e-6)
            assert m["completions/mean_length"] == pytest.approx(t["completions/mean_length"], abs=1e-6)
        if data_parallel(case) == 1:  # one rank per micro-batch: TRL's pooled loss figures are the same means
            for name in ("entropy", "kl", "clip_ratio/region_mean"):
                assert m.get(name, 0.0) == pytest.approx(t.get(name, 0.0), rel=1e-5, abs=1e-7), name
    # another loss type's normalisation is far outside the tolerance
    other = "bnpo" if CASES[case][0] == "dapo" else "dapo"
    wrong, _, _ = reference(grpo_runs, case, loss_type=other)
    print(f"GRPO {case} vs GRPOTrainer with loss_type={other}: {max(loss_errors(ours, wrong, scale)):.2e}")
    assert max(loss_errors(ours, wrong, scale)) > 100 * REL_TOL


@pytest.mark.multirank
@pytest.mark.parametrize("after", [2, 3])
def test_a_resumed_run_generates_and_trains_what_the_whole_run_did(grpo_runs, after):
    """The grpo case (num_iterations 2: steps 1 and 3 generate) resumed after step 2 (step 3 generates again, from
    the seed of its step and rank) and after step 3 (step 4 trains on the generation saved with the checkpoint):
    completions and weights are the uninterrupted run's."""
    run, root = grpo_runs["runs"]["grpo"], grpo_runs["root"]
    resumed = str(root / f"resumed_{after}")
    later = [f"global_step{s}" for s in range(after + 1, STEPS + 1)]
    shutil.copytree(run["out"], resumed, ignore=shutil.ignore_patterns(*later))
    with open(os.path.join(resumed, "latest"), "w") as f:
        f.write(f"global_step{after}")
    args = grpo_args(grpo_runs["model"], grpo_runs["prompts"], resumed, "grpo")
    proc = run_deepspeed(4, "train.py", args, str(root / f"resumed_{after}.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    whole = [json.loads(line) for line in open(os.path.join(run["out"], "completions.jsonl"))]
    again = [json.loads(line) for line in open(os.path.join(resumed, "completions.jsonl"))]
    assert [line["step"] for line in again] == [line["step"] for line in whole]
    assert again == whole
    losses = [m["loss"] for m in read_metrics(run["out"])]
    assert [m["loss"] for m in read_metrics(resumed)][-(STEPS - after) :] == losses[after:]
    a, b = exported_weights(run["out"], root), exported_weights(resumed, root)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multirank
def test_eval_prompts_report_the_mean_reward(grpo_runs):
    """data.eval_file with eval_steps 2: 3 prompts x num_generations completions each eval, spread over the 2
    data-parallel ranks (one wrapped row left out), scored: eval_reward and each function's mean, at steps 2 and 4."""
    run = grpo_runs["runs"]["dr_grpo"]
    evals = read_metrics(run["out"], "eval")
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        share, named = e["eval_rewards/letter_share/mean"], e["eval_rewards/names_target/mean"]
        assert 0 <= share <= 1 and 0 <= named <= 1
        assert e["eval_reward"] == pytest.approx(share + 0.5 * named, abs=1e-6) or math.isnan(named)
    assert "eval @ step 2 | eval_reward " in run["log"]
    assert "3 eval prompts" in run["log"]


@pytest.mark.multirank
def test_lora_trains_the_adapters_against_the_base(grpo_runs):
    """LoRA with beta 0.04: PEFT's fresh adapters change nothing, so step 1 (the same completions: the same seeds and
    layout) is the full fine-tuning run's; the reference is the base with its adapters off, so kl is 0 at step 1
    and positive once the adapters moved; the frozen base is unchanged."""
    lora, full = read_metrics(grpo_runs["runs"]["lora"]["out"]), read_metrics(grpo_runs["runs"]["dapo"]["out"])
    lines = lambda case: open(os.path.join(grpo_runs["runs"][case]["out"], "completions.jsonl")).readlines()  # noqa: E731
    step_1 = lambda case: [line for line in lines(case) if json.loads(line)["step"] == 1]  # noqa: E731
    assert step_1("lora") == step_1("dapo")
    assert lora[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6, abs=1e-7)
    assert lora[0]["kl"] == 0.0 and all(m["kl"] > 0 for m in lora[1:])
    assert "peft: LoRA r=" in grpo_runs["runs"]["lora"]["log"]


@pytest.mark.multirank
def test_a_reward_function_failing_mid_run_stops_with_its_name_and_the_checkpoint_intact(grpo_runs, tmp_path):
    """A reward function that passes the check before start (and step 1), then raises at step 2: the run stops
    non-zero with the function, the step, the exception and the prompts named once, global_step1 intact."""
    out = str(tmp_path / "fails")
    args = grpo_args(grpo_runs["model"], grpo_runs["prompts"], out, "dapo", save_steps=1)
    args = [a for a in args if not a.startswith(("grpo.reward_funcs=", "grpo.reward_weights="))]
    args.append("grpo.reward_funcs=[tests.support.grpo_rewards:fails_after_first_step]")
    proc = run_deepspeed(2, "train.py", args, str(tmp_path / "fails.log"))
    assert proc.returncode != 0
    assert proc.stderr.count("train.py: error: step 2:") == 1, proc.stderr[-3000:]
    assert "fails_after_first_step" in proc.stderr and "ConnectionError" in proc.stderr
    assert "prompts.jsonl:" in proc.stderr  # the prompts' file:line
    assert f"the last checkpoint, {os.path.join(out, 'global_step1')}, is intact" in proc.stderr
    assert [m["step"] for m in read_metrics(out)] == [1]
