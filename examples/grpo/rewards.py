"""The reward of the GRPO example (grpo.reward_funcs=[examples.grpo.rewards:spaces]): a rule, no model."""

from __future__ import annotations


def spaces(prompts, completions, **kwargs):
    """The share of a completion's words that are space-separated: its spaces, up to 8, over 8 (TRL's call)."""
    return [min(c.count(" "), 8) / 8.0 for c in completions]
