"""A reward function for tests that name one in grpo.reward_funcs (``tests.support.rewards_fixture:length_reward``)."""


def length_reward(prompts, completions, **kwargs):
    """Each completion's length in characters: TRL's call, one float per completion."""
    return [float(len(c)) for c in completions]
