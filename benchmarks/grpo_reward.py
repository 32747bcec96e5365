"""The reward of the GRPO benchmark, shared by both sides: a pure-Python function that costs
microseconds, so the step times compare the trainers, not a reward model.

proximal calls ``module:function(prompts, completions)``; TRL calls ``f(prompts=..., completions=...,
**kwargs)``. Both get plain strings here.
"""


def distinct_chars(prompts, completions, **kwargs):
    """The fraction of distinct characters in each completion: any deterministic score will do."""
    return [len(set(c)) / max(len(c), 1) for c in completions]
