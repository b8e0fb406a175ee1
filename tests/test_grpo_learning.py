"""A tiny model learns a rule-based reward with train_objective=grpo: the GRPO example (examples/grpo/), pipe 2 x data
2 on CPU ranks, raises the mean reward of its last 5 steps above its first 5 by more than MARGIN, and the held-out
prompts' reward (eval_reward at the end) as far above the first steps'.

The model is scripts/make_tiny_model.py's (the session's ``tiny_hf``: the same random weights and tokenizer), the
prompts examples/grpo/make_prompts.py's, the reward examples/grpo/rewards.py's ``spaces`` (a completion's spaces, up
to 8, over 8). The same run at optim.lr=1e-9 (optim.lr=0 is refused) moves its 5-step mean by 0.05 at most (seeds 0
and 1); at LR it rises by 0.7 (docs/grpo.md's table is this run's: ``pytest -s`` prints it)."""

from __future__ import annotations

import os

import pytest

from examples.grpo.make_prompts import write_prompts
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics

STEPS, LR, MARGIN, WINDOW = 20, 1e-2, 0.3, 5
SETTINGS = {
    "num_stages": 2,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 2,  # x dp 2: 16 completions a step, 2 prompts x grpo.num_generations 8
    "max_steps": STEPS,
    "precision": "fp32",
    "optim.lr": LR,
    "data": "grpo",
    "data.max_seq_length": 48,
    "data.eval_fraction": 0.125,  # 8 of the 64 prompts held out, evaluated at steps 10 and 20
    "eval_steps": 10,
    "log_steps": 1,
    "grpo.num_generations": 8,
    "grpo.max_completion_length": 16,
    "grpo.reward_funcs": "[examples.grpo.rewards:spaces]",
}


@pytest.mark.multirank
def test_the_mean_reward_rises(tmp_path, tiny_hf):
    prompts, out = str(tmp_path / "prompts.jsonl"), str(tmp_path / "run")
    write_prompts(prompts, 64)  # what `python examples/grpo/make_prompts.py --output ...` writes
    args = {"model_name_or_path": tiny_hf, "output_dir": out, "data.train_file": prompts, **SETTINGS}
    proc = run_deepspeed(4, "train.py", [f"{k}={v}" for k, v in args.items()], str(tmp_path / "grpo.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rewards = [m["reward"] for m in read_metrics(out)]
    evals = [m["eval_reward"] for m in read_metrics(out, "eval")]
    print("step | reward\n" + "\n".join(f"{step} | {r:.3f}" for step, r in enumerate(rewards, 1)))
    print(f"eval_reward at steps 10, 20: {evals}")
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert len(rewards) == STEPS and os.path.isfile(os.path.join(out, "completions.jsonl"))
    assert last > first + MARGIN, f"mean reward of the first {WINDOW} steps {first:.3f}, of the last {last:.3f}"
    assert evals[-1] > first + MARGIN, f"eval_reward {evals}: the held-out prompts did not gain"
