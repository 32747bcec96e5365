"""The rule-based rewards that need no package: TRL's ``think_format_reward``, DAPO's soft overlong
punishment (TRL's ``get_soft_overlong_punishment``) and exact match; and how every function of
:mod:`proximal.rewards` reads a completion (:func:`completion_text`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: TRL's ``think_format_reward`` pattern (trl/rewards/format_rewards.py), with its flags: one
#: ``<think>`` at the very start, no second ``<think>``, a ``</think>`` after it, anything after.
THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of one completion as a reward function is given it: the text itself, or for a
    conversational row (TRL's form, a list of messages) the content of its last assistant message
    ("" when it has none, or when that message holds only tool calls).

    TRL's functions read ``completion[0]["content"]``; for a one-message completion, the form
    proximal and TRL give a single-turn conversational row, that is the same message. For a
    multi-turn trajectory the final answer is in the last assistant message, so it is read there."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion)):
        if message.get("role", "assistant") == "assistant":
            return message.get("content") or ""
    return ""


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 where the completion is ``<think>…</think>`` followed by anything, else 0.0: TRL's
    ``trl.rewards.think_format_reward``, the same pattern (:data:`THINK_FORMAT`) and flags. The
    completion must *start* with ``<think>`` (no leading space or newline) and hold no second
    ``<think>``; the reasoning may be empty and may span lines.

    Args:
        completions: one per row, text or messages (:func:`completion_text`).
        **kwargs: the other arguments a trainer passes, unused.

    Returns:
        one float per completion.
    """
    return [1.0 if THINK_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def exact_match(
    completions: list,
    solution: list | None = None,
    answer: list | None = None,
    **kwargs,
) -> list[float | None]:
    """1.0 where the completion equals the row's reference answer, else 0.0; None (does not apply)
    where the row has none.

    The reference is the ``solution`` column (TRL's name for it), else ``answer``. Normalisation:
    both are stripped of leading and trailing whitespace (``str.strip()``) and nothing else — case,
    inner spaces and punctuation count, and a number in the data (``4``) is compared as its text
    (``"4"``). A completion that holds its answer in a sentence or in tags does not match: use
    :func:`proximal.rewards.accuracy_reward` (math) or :func:`proximal.rewards.reasoning_gym`
    (``<answer>`` tags) for those.

    Args:
        completions: one per row, text or messages (:func:`completion_text`).
        solution: the reference answer per row (a column), or None.
        answer: the reference answer per row where ``solution`` is not given or is None there.
        **kwargs: the other arguments a trainer passes, unused.

    Raises:
        ValueError: the rows have neither a ``solution`` nor an ``answer`` column.
    """
    if solution is None and answer is None:
        raise ValueError(
            "exact_match needs the reference answer in a column 'solution' or 'answer' (map yours "
            "to one with data.columns)"
        )
    n = len(completions)
    solution = solution if solution is not None else [None] * n
    answer = answer if answer is not None else [None] * n
    scores: list[float | None] = []
    for completion, s, a in zip(completions, solution, answer):
        gold = s if s is not None else a
        if gold is None:
            scores.append(None)
        else:
            scores.append(float(completion_text(completion).strip() == str(gold).strip()))
    return scores


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: an open-source LLM reinforcement
    learning system at scale", eq. 13), as TRL's ``trl.rewards.get_soft_overlong_punishment``: a
    factory that returns the reward function of a completion's length |y| in tokens, with
    L_max = ``max_completion_len`` and L_cache = ``soft_punish_cache``::

        R(y) = 0                                  |y| ≤ L_max − L_cache
               ((L_max − L_cache) − |y|) / L_cache  L_max − L_cache < |y| ≤ L_max
               −1                                 L_max < |y|

    It only punishes: 0 up to the soft limit, then a linear ramp down to −1 at L_max. |y| is
    ``len(completion_ids)``: the response's tokens as proximal passes them to every reward function,
    the stop token included (as TRL counts them), and in a multi-turn trajectory the observations
    too. DAPO sets L_max to the generation limit (``rollout.max_new_tokens``), so a response cut at
    the limit gets −1 and the third branch is never reached; a smaller L_max punishes earlier.

    From a config, the arguments come from ``model.reward_function_kwargs`` (docs/rewards.md)::

        reward_functions: [proximal.rewards:get_soft_overlong_punishment]
        reward_function_kwargs:
          proximal.rewards:get_soft_overlong_punishment: {max_completion_len: 512, soft_punish_cache: 128}

    Raises:
        ValueError: ``max_completion_len`` < 1, or ``soft_punish_cache`` not in [0, L_max].
    """
    for name, value in (
        ("max_completion_len", max_completion_len),
        ("soft_punish_cache", soft_punish_cache),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} = {value!r} must be a whole number of tokens")
    if max_completion_len < 1:
        raise ValueError(f"max_completion_len = {max_completion_len} must be ≥ 1 token")
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache = {soft_punish_cache} must be in [0, max_completion_len = "
            f"{max_completion_len}]"
        )
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


get_soft_overlong_punishment.reward_function_factory = True  # type: ignore[attr-defined]


class SoftOverlongPunishment:
    """The function :func:`get_soft_overlong_punishment` returns. A class rather than a closure, as
    TRL's, so that it pickles (a worker process can be handed it)."""

    __name__ = "soft_overlong_punishment_reward"  # TRL's name for it

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list, **kwargs) -> list[float]:
        soft = self.max_completion_len - self.soft_punish_cache  # L_max − L_cache
        scores = []
        for ids in completion_ids:
            length = len(ids)
            if length <= soft:
                scores.append(0.0)
            elif length <= self.max_completion_len:
                scores.append((soft - length) / self.soft_punish_cache)
            else:
                scores.append(-1.0)
        return scores

    def __repr__(self) -> str:
        return (
            f"get_soft_overlong_punishment(max_completion_len={self.max_completion_len}, "
            f"soft_punish_cache={self.soft_punish_cache})"
        )
