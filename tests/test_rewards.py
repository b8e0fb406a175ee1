"""GRPO reward functions named as ``module:function`` (data/rewards.py): every loading and calling problem reported
at once with its fix, and the rewards [N, F], weighted total and reward metrics equal to those of TRL 1.16.0's
GRPOTrainer (its ``_calculate_rewards`` and its metric code, on a tiny random model) with None rewards, an unscorable
completion, weights other than 1, an async function and extra dataset columns."""

from __future__ import annotations

import functools
import math
import os
import sys
import textwrap

import pytest
import torch

from data.rewards import (
    TRL_ARGUMENTS,
    RewardConfigError,
    RewardError,
    callable_name,
    is_async_callable,
    load_reward_functions,
    reward_function_problems,
    reward_metrics,
)
from tests.support.models import make_hf_dir

GENERATIONS = 4
WEIGHTS = [0.5, 2.0, -1.5]
# format_reward: None for every third completion; answer_reward: None for even answers; judge_reward (async): None
# where format_reward is. Completions 0-3 have answer 0, so 0 and 3 are scored by no function (TRL: unscorable).
REWARDS_MODULE = """
import asyncio

CALLS = []


def format_reward(prompts, completions, completion_ids, **kwargs):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
    return [None if i % 3 == 0 else float(len(c)) for i, c in enumerate(completions)]


def answer_reward(prompts, completions, answer, level, **kwargs):
    return [None if a % 2 == 0 else a * (1.0 if lv == "hard" else 0.25) for a, lv in zip(answer, level)]


async def judge_reward(prompts, completions, completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [None if i % 3 == 0 else sum(ids) % 5 - 1.5 for i, ids in enumerate(completion_ids)]
"""
SPECS = ["grpo_rewards:format_reward", "grpo_rewards:answer_reward", "grpo_rewards:judge_reward"]


def write_modules(root, **modules: str) -> None:
    for name, source in modules.items():
        with open(os.path.join(str(root), f"{name}.py"), "w") as f:
            f.write(textwrap.dedent(source))


@pytest.fixture
def rewards_dir(tmp_path, monkeypatch):
    """A directory on sys.path for the test's reward modules, forgotten (sys.modules too) afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory, tokenizer_dir):
    """(TRL's GRPOTrainer over a 1-layer random Llama, our RewardSet, the reward module), both from ``SPECS`` with
    ``WEIGHTS``; TRL gets the very functions we loaded."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    root = tmp_path_factory.mktemp("grpo_rewards")
    write_modules(root, grpo_rewards=REWARDS_MODULE)
    model = make_hf_dir(root, tokenizer_dir, "model", num_hidden_layers=1)
    args = GRPOConfig(
        output_dir=str(root / "out"),
        per_device_train_batch_size=3 * GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=4,
        reward_weights=WEIGHTS,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        mp.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
        rewards = load_reward_functions(SPECS, WEIGHTS)
        module = sys.modules.pop("grpo_rewards")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[f.func for f in rewards.funcs],
            args=args,
            train_dataset=Dataset.from_list(rows(3, GENERATIONS)[::GENERATIONS]),
            rollout_func=rollout,
        )
    return trainer, rewards, module


def rows(prompts: int, generations: int) -> list[dict]:
    """TRL's ``inputs``: each prompt's row repeated once per completion, with the columns answer and level."""
    return [
        {
            "prompt": f"question {i // generations}: what is {i // generations} + 1?",
            "answer": i // generations,
            "level": "hard" if i % 2 else "easy",
        }
        for i in range(prompts * generations)
    ]


def rollout(prompts: list, trainer) -> dict:
    """Completions of 1-4 tokens (ids 40-99), as TRL's rollout_func hands them over."""
    ids = [[40 + (7 * i + 3 * k) % 60 for k in range(1 + i % 4)] for i in range(len(prompts))]
    return {"prompt_ids": [[5, 6, 7]] * len(prompts), "completion_ids": ids, "logprobs": [[-1.0] * len(x) for x in ids]}


def columns_of(inputs: list[dict]) -> dict[str, list]:
    return {key: [x[key] for x in inputs] for key in inputs[0] if key != "prompt"}


@pytest.mark.slow
def test_rewards_equal_trl_calculate_rewards(trl_run):
    trainer, rewards, module = trl_run
    inputs = rows(3, GENERATIONS)
    prompts = [x["prompt"] for x in inputs]
    completions = [" ".join(["word"] * (i % 5)) + f" {i}" for i in range(len(inputs))]
    completion_ids = [list(range(40, 41 + i % 4)) for i in range(len(inputs))]
    theirs = trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
    trl_call = module.CALLS[-1]
    ours = rewards.score(prompts, completions, completion_ids, columns_of(inputs))
    assert ours.dtype == torch.float32 and ours.shape == (12, 3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(ours).any() and torch.isnan(ours).all(dim=1).tolist()[:4] == [True, False, False, True]
    our_call = module.CALLS[-1]
    assert sorted(our_call) == sorted(trl_call) == sorted([*TRL_ARGUMENTS, "answer", "level"])
    assert our_call["answer"] == trl_call["answer"] and our_call["level"] == trl_call["level"]
    assert rewards.names == trainer.reward_func_names == ["format_reward", "answer_reward", "judge_reward"]


@pytest.mark.slow
def test_metrics_equal_trl_logged_metrics(trl_run):
    """One generation batch through TRL's _generate_and_score_completions: our metrics of the same call equal the
    ones it logs; weights of 1, a biased std or unscorable rows counted as 0 each visibly break the equality."""
    trainer, rewards, module = trl_run
    trainer.model.train()
    trainer._metrics["train"].clear()
    trainer._generate_and_score_completions(rows(3, GENERATIONS))
    logged = {k: v[0] for k, v in trainer._metrics["train"].items() if k.startswith("reward")}
    call = module.CALLS[-1]
    columns = {k: v for k, v in call.items() if k not in TRL_ARGUMENTS}
    per_func = rewards.score(call["prompts"], call["completions"], call["completion_ids"], columns)
    ours = rewards.metrics(per_func)
    assert sorted(ours) == sorted(logged) and len(ours) == 8
    for key, value in logged.items():
        assert math.isclose(ours[key], value, rel_tol=1e-6, abs_tol=1e-6), (key, ours[key], value)

    total = rewards.total(per_func)
    scored = total[~torch.isnan(total)]
    wrong = {
        "weights of 1": reward_metrics(per_func, torch.ones(3), rewards.names)["reward"],
        "biased std": torch.std(scored, correction=0).item(),
        "unscorable as 0": torch.nan_to_num(total).mean().item(),
    }
    right = {"weights of 1": ours["reward"], "biased std": ours["reward_std"], "unscorable as 0": ours["reward"]}
    for what, value in wrong.items():
        assert abs(value - right[what]) > 1e-2, what


def test_names_and_async_as_trl():
    from trl.trainer.utils import get_callable_name
    from trl.trainer.utils import is_async_callable as trl_is_async

    def plain(prompts, completions, **kwargs): ...

    async def judge(prompts, completions, **kwargs): ...

    class Scorer:
        async def __call__(self, prompts, completions, **kwargs): ...

    for f in (plain, judge, functools.partial(functools.partial(judge), x=1), Scorer()):
        assert (callable_name(f), is_async_callable(f)) == (get_callable_name(f), trl_is_async(f))


def test_loading_problems_all_at_once(rewards_dir):
    write_modules(
        rewards_dir,
        my_rewards="""
        THRESHOLD = 0.5

        def no_kwargs(prompts, completions):
            return [1.0] * len(prompts)

        def positional(prompts, completions, /, **kwargs):
            return [1.0] * len(prompts)

        def good(prompts, completions, **kwargs):
            return [1.0] * len(prompts)
        """,
        needs_dep="import not_installed_dependency_xyz\n",
    )
    specs = [
        "missing_module_xyz:reward",
        "my_rewards:nope",
        "my_rewards:THRESHOLD",
        "my_rewards:no_kwargs",
        "my_rewards:positional",
        "needs_dep:reward",
        "my_rewards.good",
        "my_rewards:good",
    ]
    path = os.path.join(str(rewards_dir), "my_rewards.py")
    expected = [
        "grpo.reward_funcs[0] 'missing_module_xyz:reward' cannot be imported: No module named 'missing_module_xyz'"
        " (add the directory that holds it to PYTHONPATH)",
        f"grpo.reward_funcs[1] 'my_rewards:nope': module 'my_rewards' ({path}) has no 'nope' (its functions: good,"
        " no_kwargs, positional)",
        "grpo.reward_funcs[2] 'my_rewards:THRESHOLD' is a float, not a function",
        "grpo.reward_funcs[3] 'my_rewards:no_kwargs' has no **kwargs and does not take completion_ids, trainer_state,"
        " log_extra, log_metric, which TRL's GRPOTrainer passes every reward function by name with each dataset"
        " column: add **kwargs to its parameters",
        "grpo.reward_funcs[4] 'my_rewards:positional' takes prompts, completions only by position, but TRL passes"
        " every argument by name: remove the '/' from its parameters",
        "grpo.reward_funcs[5] 'needs_dep:reward' cannot be imported: importing 'needs_dep' raised No module named"
        " 'not_installed_dependency_xyz' (install 'not_installed_dependency_xyz')",
        "grpo.reward_funcs[6] 'my_rewards.good' is not 'module:function' (e.g. 'my_rewards:format_reward')",
        "grpo.reward_weights has 2 weights for 8 reward functions in grpo.reward_funcs: give one weight per"
        " function, in order, or none (each 1.0)",
        "grpo.reward_weights[1] is nan: a weight must be a finite number",
    ]
    assert reward_function_problems(specs, [1.0, float("nan")]) == expected
    with pytest.raises(RewardConfigError) as e:
        load_reward_functions(specs, [1.0, float("nan")])
    assert str(e.value) == "invalid reward functions:\n  " + "\n  ".join(expected)
    loaded = load_reward_functions(["my_rewards:good"])
    assert loaded.names == ["good"] and loaded.weights.tolist() == [1.0]
    assert reward_function_problems([]) == [
        "grpo.reward_funcs is empty: GRPO needs at least one reward function ('module:function')"
    ]


def test_two_functions_of_one_name_refused(rewards_dir):
    reward = "def reward(prompts, completions, **kwargs):\n    return [0.0] * len(prompts)\n"
    write_modules(rewards_dir, mod_a=reward, mod_b=reward)
    assert reward_function_problems(["mod_a:reward", "mod_b:reward"]) == [
        "grpo.reward_funcs[0] 'mod_a:reward' and grpo.reward_funcs[1] 'mod_b:reward' both log as"
        " rewards/reward/mean (TRL names a reward by its function's __name__): rename one of them"
    ]


@pytest.mark.slow
def test_trl_refuses_what_loading_refuses(trl_run, rewards_dir):
    """TRL's own call fails on a function without **kwargs and on a wrong count, as our checks say."""
    trainer, _, _ = trl_run
    write_modules(
        rewards_dir,
        strict="""
        def no_kwargs(prompts, completions, completion_ids):
            return [1.0] * len(prompts)

        def short(prompts, completions, **kwargs):
            return [1.0]
        """,
    )
    import strict

    inputs = rows(1, 2)
    saved = trainer.reward_funcs, trainer.reward_func_names, trainer.reward_processing_classes
    try:
        for func, error in ((strict.no_kwargs, "unexpected keyword argument 'answer'"), (strict.short, "returned 1")):
            trainer.reward_funcs, trainer.reward_func_names, trainer.reward_processing_classes = [func], ["f"], [None]
            with pytest.raises((TypeError, ValueError), match=error):
                trainer._calculate_rewards(inputs, ["p", "p"], ["c", "c"], [[1], [1]])
    finally:
        trainer.reward_funcs, trainer.reward_func_names, trainer.reward_processing_classes = saved
    assert "has no **kwargs" in reward_function_problems(["strict:no_kwargs"])[0]
    with pytest.raises(RewardError, match=r"returned 1 rewards for 2 completions"):
        load_reward_functions(["strict:short"]).score(["p", "p"], ["c", "c"], [[1], [1]], {})


def test_calling_problems_all_at_once(rewards_dir):
    write_modules(
        rewards_dir,
        faulty="""
        def raises(prompts, completions, **kwargs):
            return [1.0 / 0 for _ in prompts]

        def wrong_count(prompts, completions, **kwargs):
            return [1.0]

        def text(prompts, completions, **kwargs):
            return [0.5, "yes", 1.0]

        def infinite(prompts, completions, **kwargs):
            return [0.5, 1.0, float("inf")]

        def scalar(prompts, completions, **kwargs):
            return 1.0

        def fine(prompts, completions, **kwargs):
            return [None, 1, True]
        """,
    )
    rewards = load_reward_functions([f"faulty:{n}" for n in ("raises", "wrong_count", "text", "infinite", "scalar")])
    prompts = ["short prompt", "a prompt " * 20, [{"role": "user", "content": "a chat   prompt"}]]
    with pytest.raises(RewardError) as e:
        rewards.score(prompts, ["a", "b", "c"], [[1], [2], [3]], {"answer": [1, 2, 3]})
    assert str(e.value).split("\n  ") == [
        "reward functions failed:",
        "grpo.reward_funcs[0] 'faulty:raises' raised ZeroDivisionError: float division by zero (at faulty.py:3) on a"
        " batch of 3 completions, the first prompt 'short prompt'",
        "grpo.reward_funcs[1] 'faulty:wrong_count' returned 1 rewards for 3 completions: one per completion, in order"
        " (None where it does not apply)",
        "grpo.reward_funcs[2] 'faulty:text' returned 'yes' (str) for completion 1 (prompt 'a prompt a prompt a prompt"
        " a prompt a prompt a prompt a p...'): a reward must be a number, or None where it does not apply",
        "grpo.reward_funcs[3] 'faulty:infinite' returned inf (float) for completion 2 (prompt 'a chat prompt'): a"
        " reward must be finite, or None where it does not apply",
        "grpo.reward_funcs[4] 'faulty:scalar' returned 1.0 (float), not a list of 3 rewards",
    ]
    fine = load_reward_functions(["faulty:fine"]).score(prompts, ["a", "b", "c"], [[1], [2], [3]], {})
    assert torch.isnan(fine[0, 0]) and fine[1:, 0].tolist() == [1.0, 1.0]


def test_columns_checked_against_signature(rewards_dir):
    write_modules(
        rewards_dir,
        cols="""
        def needs_solution(prompts, completions, solution, **kwargs):
            return [1.0] * len(prompts)

        def every_name(prompts, completions, completion_ids, trainer_state, log_extra, log_metric):
            return [1.0] * len(prompts)
        """,
    )
    rewards = load_reward_functions(["cols:needs_solution", "cols:every_name"])
    with pytest.raises(RewardError) as e:
        rewards.score(["p"], ["c"], [[1]], {"answer": [1], "prompt": ["p"]}, trainer_state=object())
    assert str(e.value).split("\n  ")[1:] == [
        "grpo.reward_funcs[0] 'cols:needs_solution' needs 'solution', which the data has no column for (its columns:"
        " 'answer'): add the column or give the parameter a default",
        "grpo.reward_funcs[1] 'cols:every_name' has no **kwargs and does not take the data's column(s) 'answer',"
        " which TRL passes by name: add **kwargs to its parameters",
    ]
    needs = load_reward_functions(["cols:needs_solution"])
    assert needs.score(["p"], ["c"], [[1]], {"solution": [1]}, trainer_state=object()).tolist() == [[1.0]]


def test_dry_run_and_logging_hooks(rewards_dir):
    write_modules(
        rewards_dir,
        task="""
        def math_only(prompts, completions, task, trainer_state, log_metric, log_extra, **kwargs):
            log_metric("math_share", task.count("math") / len(task))
            log_extra("step", [trainer_state.global_step] * len(prompts))
            return [float(len(c)) if t == "math" else None for c, t in zip(completions, task)]
        """,
    )
    rewards = load_reward_functions(["task:math_only"], [2.0])
    rows_ = [{"prompt": "1+1?", "task": "math"}, {"prompt": [{"role": "user", "content": "hi"}], "task": "chat"}]
    problems, warnings = rewards.dry_run(rows_)
    assert problems == []
    assert warnings == [
        "every reward function returned None for 1 of 2 completions (the first: completion 1, prompt 'hi'): they get"
        " advantage 0; make some reward function score them"
    ]
    assert dict(rewards.logged_metrics) == {"math_share": [0.5]} and dict(rewards.logged_extra) == {"step": [0, 0]}
    assert rewards.dry_run([{"prompt": "1+1?"}])[0][0].startswith("grpo.reward_funcs[0] 'task:math_only' needs 'task'")
