"""Reward functions the GRPO runs of the tests name in grpo.reward_funcs (``tests.support.grpo_rewards:...``)."""

from __future__ import annotations


def letter_share(prompts, completions, **kwargs):
    """The share of a completion's characters that are the letter 'e' (0 for an empty completion)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def names_target(prompts, completions, target, **kwargs):
    """1 where the completion holds the record's ``target`` column, else 0; None (unscored) for an empty one."""
    return [None if not c else float(t in c) for c, t in zip(completions, target, strict=True)]


def fails_after_first_step(prompts, completions, trainer_state, **kwargs):
    """Scores like letter_share until one optimizer step is done, then raises (a reward server gone mid-run)."""
    if trainer_state.global_step >= 1:
        raise ConnectionError("the reward server at http://127.0.0.1:9 refused the connection")
    return letter_share(prompts, completions)
