"""TRL 1.16's GRPOTrainer in one process on the completions a pipeline run wrote: the reference GRPO parity compares
with. ``read_generations`` reads the run's ``output_dir/completions.jsonl``; ``trl_grpo_reference`` trains on them."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from unittest import mock

import torch

from training.configuration.schema import OptimConfig, TrainConfig
from training.optim import lr_lambda, param_groups


def read_generations(path: str, num_iterations: int = 1) -> list[list[dict]]:
    """Each generation's completion records, in order, from a ``completions.jsonl`` (one JSON line per completion,
    ``step`` 1-based, the step's global order). Generations happen at steps 1, 1 + k, 1 + 2k, ... (k =
    ``num_iterations``); a step between them reuses its generation: it may have no lines, or repeat that
    generation's prompt and completion ids (checked)."""
    by_step = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]].append(record)
    if not by_step:
        raise ValueError(f"{path}: no completions")
    last = max(by_step)
    generations, problems = [], []
    for step in range(1, last + 1):
        if (step - 1) % num_iterations == 0:
            if not by_step[step]:
                problems.append(f"step {step} generates (num_iterations={num_iterations}) but has no lines")
            generations.append(by_step[step])
        elif by_step[step] and _ids(by_step[step]) != _ids(generations[-1]):
            problems.append(
                f"step {step} reuses step {step - (step - 1) % num_iterations}'s generation, but its "
                "lines hold other prompt/completion ids"
            )
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return generations


def _ids(records: list[dict]) -> list[tuple]:
    return [(tuple(r["prompt_ids"]), tuple(r["completion_ids"])) for r in records]


def trl_grpo_reference(
    model_dir: str,
    prompts: list[dict],
    generations: list[list[dict]],
    *,
    reward_funcs: list,
    reward_weights: list[float] | None = None,
    num_generations: int,
    max_completion_length: int,
    temperature: float = 1.0,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    scale_rewards: str = "group",
    num_iterations: int = 1,
    mask_truncated_completions: bool = False,
    steps: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    lr: float,
    seed: int = 0,
    scored: list | None = None,
    **optim,
) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """TRL's GRPOTrainer on ``model_dir`` (fp32, CPU, one process) for ``steps`` optimizer steps, generation g's
    completions taken from ``generations[g]`` (records of ``completions.jsonl``, see ``read_generations``) by a
    ``rollout_func``. Returns the loss of each optimizer step, the trained model's state dict, and TRL's logged
    metrics of each step (its log history: ``loss``, ``reward``, ``kl``, ``entropy``, ``clip_ratio/*``,
    ``completions/*``, ``grad_norm``, ``learning_rate``...; the reward metrics only at generation steps).

    Our pipe x data run in one process: its global batch is micro x gas x dp rows, DeepSpeed averages each rank's
    micro-batch losses over gas and over dp. TRL with ``per_device_train_batch_size`` = micro and
    ``gradient_accumulation_steps`` = gas x dp averages the same micro-batches (each a contiguous block of micro rows of
    the generation batch) for grpo / bnpo / dr_grpo, and dapo divides by the generation batch's active tokens: the
    same. The caller passes those two numbers. TRL shuffles a generation batch's rows before cutting micro-batches
    (``shuffle_sequence_dict``); our run does not, so it is the identity here, and ``shuffle_dataset=False`` takes
    the prompts in data order. The rollout asserts that TRL asks for generation g's prompts, each
    ``num_generations`` times in a row, and hands back the records' ``prompt_ids`` and ``completion_ids`` (no
    sampling log-probabilities: TRL uses them only with vLLM). On this path TRL's completion mask is all ones: an
    EOS a completion ends with is trained on; ``mask_truncated_completions`` masks a completion whose last token is
    neither EOS nor the pad token. TRL scores the completions with ``reward_funcs`` itself (on its own decoding);
    ``scored``, a list, receives per generation {"rewards": {name: [..]}, "advantages": [..]} as TRL computed them.

    The optimizer is train.py's: torch AdamW over ``training.optim.param_groups`` (no decay on 1-D tensors) and
    ``lr_lambda``'s schedule over ``steps``, ``optim`` = the other ``OptimConfig`` fields (betas, eps,
    weight_decay, max_grad_norm (0 = no clipping, as Trainer), scheduler, warmup_steps, min_lr)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = per_device_train_batch_size * gradient_accumulation_steps
    _check_generations(generations, rows, num_generations, steps, num_iterations)
    cfg = TrainConfig(optim=OptimConfig(lr=lr, **optim))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps))

    class Recording(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self.per_func = per_func.clone()
            return per_func

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if scored is not None:
                names = self.reward_func_names
                rewards = {
                    n: [None if math.isnan(v) else v for v in self.per_func[:, i].tolist()] for i, n in enumerate(names)
                }
                scored.append({"rewards": rewards, "advantages": out["advantages"].tolist()})
            return out

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_steps=steps,
            learning_rate=lr,  # the optimizer and schedule below are what train.py builds
            max_grad_norm=cfg.optim.max_grad_norm,
            num_generations=num_generations,
            max_completion_length=max_completion_length,
            temperature=temperature,
            beta=beta,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            loss_type=loss_type,
            scale_rewards=scale_rewards,
            num_iterations=num_iterations,
            mask_truncated_completions=mask_truncated_completions,
            reward_weights=reward_weights,
            shuffle_dataset=False,
            use_cpu=True,
            bf16=False,  # TRL's default is bf16 autocast, on CPU too
            gradient_checkpointing=False,  # TRL's default is on: the same numbers, recomputed
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            seed=seed,
        )
        trainer = Recording(
            model=model,
            reward_funcs=list(reward_funcs),
            args=config,
            train_dataset=Dataset.from_list(prompts),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            optimizers=(opt, schedule),
            rollout_func=_Rollout(generations, num_generations),
        )
        with mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch):
            trainer.train()
    metrics = [entry for entry in trainer.state.log_history if "loss" in entry]
    if len(metrics) != steps:
        raise RuntimeError(f"TRL logged {len(metrics)} training steps, expected {steps}")
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return [m["loss"] for m in metrics], state, metrics


def _check_generations(generations, rows, num_generations, steps, num_iterations) -> None:
    problems = []
    needed = math.ceil(steps / num_iterations)
    if len(generations) < needed:
        problems.append(
            f"{steps} steps with num_iterations={num_iterations} need {needed} generations, got {len(generations)}"
        )
    if rows % num_generations:
        problems.append(
            f"per_device_train_batch_size x gradient_accumulation_steps = {rows} rows is not a multiple "
            f"of num_generations={num_generations}"
        )
    for g, records in enumerate(generations[:needed]):
        if len(records) != rows:
            problems.append(
                f"generation {g} has {len(records)} completions, the step's batch is {rows} rows (micro x gas x dp)"
            )
    if problems:
        raise ValueError("; ".join(problems))


class _Rollout:
    """TRL's ``rollout_func``: the next generation's records, after checking that TRL asks for their prompts."""

    def __init__(self, generations: list[list[dict]], num_generations: int) -> None:
        self.generations, self.num_generations, self.calls = generations, num_generations, 0

    def __call__(self, prompts: list, trainer) -> dict:
        records = self.generations[self.calls]
        expected = [r["prompt"] for r in records]
        assert prompts == expected, f"generation {self.calls}: TRL asks for {prompts}, the records hold {expected}"
        groups = [expected[i : i + self.num_generations] for i in range(0, len(expected), self.num_generations)]
        assert all(g == [g[0]] * self.num_generations for g in groups), (
            f"generation {self.calls}: each prompt must come num_generations={self.num_generations} times in a row"
        )
        self.calls += 1
        return {
            "prompt_ids": [list(r["prompt_ids"]) for r in records],
            "completion_ids": [list(r["completion_ids"]) for r in records],
            "logprobs": None,
        }
