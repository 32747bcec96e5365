"""``reasoning_gym``: a completion scored by the reasoning-gym generator that made its row, with that
generator's own ``score_answer``. Needs the ``reasoning`` extra: ``pip install
'proximal-rlhf[reasoning]'``."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from reasoning_gym import get_score_answer_fn
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from proximal.rewards.rules import completion_text

#: reasoning-gym's answer convention: the text of the last ``<answer>…</answer>`` in the completion.
ANSWER_TAG = "answer"


def get_reasoning_gym_reward(answer_tag: str | None = ANSWER_TAG) -> Callable:
    """A :func:`reasoning_gym` reward function that reads the answer by another rule: from the last
    ``<answer_tag>…</answer_tag>`` (reasoning-gym's ``extract_answer``: inner text, stripped), or,
    with ``answer_tag`` None, the whole completion stripped (for a policy taught to reply with the
    answer alone). From a config: ``model.reward_function_kwargs:
    {"proximal.rewards:get_reasoning_gym_reward": {answer_tag: null}}``.

    Raises:
        ValueError: ``answer_tag`` is not a tag name (letters, digits, ``_`` and ``-``).
    """
    if answer_tag is not None and not (
        isinstance(answer_tag, str) and answer_tag.replace("_", "").replace("-", "").isalnum()
    ):
        raise ValueError(
            f"answer_tag = {answer_tag!r} must be a tag name such as 'answer', or null"
        )
    return ReasoningGymReward(answer_tag)


get_reasoning_gym_reward.reward_function_factory = True  # type: ignore[attr-defined]


class ReasoningGymReward:
    """The function :func:`get_reasoning_gym_reward` returns (a class, so that it pickles)."""

    __name__ = "reasoning_gym"

    def __init__(self, answer_tag: str | None):
        self.answer_tag = answer_tag

    def __call__(
        self,
        completions: list,
        answer: list,
        metadata: list,
        generator_config: list | None = None,
        **kwargs,
    ) -> list[float | None]:
        n = len(completions)
        configs = generator_config if generator_config is not None else [None] * n
        scores: list[float | None] = []
        for completion, gold, meta, config in zip(completions, answer, metadata, configs):
            meta = json.loads(meta) if isinstance(meta, str) else meta
            name = meta.get("source_dataset") if isinstance(meta, Mapping) else None
            if name is None:
                scores.append(None)  # not a reasoning-gym row: does not apply
                continue
            entry = {"answer": gold, "metadata": meta}
            score = _scorer(name, _key(config))(self.extract(completion_text(completion)), entry)
            scores.append(float(score))
        return scores

    def extract(self, text: str) -> str | None:
        """The answer read from a completion's text; None when the tag is missing (the generator's
        scorer then gives what it gives no answer, 0.0 for most)."""
        if self.answer_tag is None:
            return text.strip()
        return extract_answer(text, tag_name=self.answer_tag)

    def __repr__(self) -> str:
        return f"get_reasoning_gym_reward(answer_tag={self.answer_tag!r})"


def _key(config: Any) -> str | None:
    """A generator config as a hashable key (its JSON); None for the default config."""
    if config is None:
        return None
    config = json.loads(config) if isinstance(config, str) else config
    if not isinstance(config, Mapping):
        raise ValueError(f"generator_config {config!r:.80} is not a mapping of the config's fields")
    return json.dumps(dict(config), sort_keys=True) if config else None


@functools.lru_cache(maxsize=256)
def _scorer(name: str, config: str | None) -> Callable[[str | None, dict], float]:
    """Generator ``name``'s ``score_answer``, built once: reasoning-gym's own
    ``get_score_answer_fn(name)`` (the generator under its default config), or under ``config``
    (JSON of its config fields) where the row gives one."""
    if name not in DATASETS:
        raise ValueError(
            f"metadata source_dataset {name!r} is not a reasoning-gym generator (the installed "
            f"reasoning-gym registers {len(DATASETS)}: {', '.join(sorted(DATASETS)[:5])}, ...)"
        )
    if config is None:
        return get_score_answer_fn(name)
    dataset_cls, config_cls = DATASETS[name]
    return dataset_cls(config=config_cls(**json.loads(config))).score_answer


def reasoning_gym(
    completions: list,
    answer: list,
    metadata: list,
    generator_config: list | None = None,
    **kwargs,
) -> list[float | None]:
    """Score each completion with the ``score_answer(answer, entry)`` of the reasoning-gym generator
    that made its row (reasoning-gym 0.1.25, Open-Thought, Apache-2.0): 1.0 for a right answer, the
    generator's partial credit (the default scorer gives ``len(gold) / len(answer)`` when the answer
    holds the gold; countdown 0.01 for a wrong but well-formed one) or 0.0.

    The answer is reasoning-gym's convention: the text of the last ``<answer>…</answer>`` in the
    completion, stripped (``reasoning_gym.utils.extract_answer``); without the tag the scorer is given
    no answer (None: 0.0 for most generators). Another rule: :func:`get_reasoning_gym_reward`.

    The row carries the generator's entry as columns, as a row ``{question, answer, metadata}``
    written from a reasoning-gym dataset has them. The scorer is reasoning-gym's
    ``get_score_answer_fn(source_dataset)``: the generator under its default config. A few
    generators' scorers read their config (decimal_arithmetic's precision, time_intervals' date
    range, puzzle24, polynomial_equations, ...); a row made under another config gives it in
    ``generator_config``, and is scored under it.

    Args:
        completions: one per row, text or messages (:func:`~proximal.rewards.rules.completion_text`).
        answer: the entry's gold answer per row.
        metadata: the entry's metadata per row (a mapping, or its JSON), with ``source_dataset``, the
            generator's name; a row whose metadata names none is not scored (None), so
            reasoning-gym rows mix with others.
        generator_config: optional column, the generator's config fields per row (a mapping, or its
            JSON; None: the default config).
        **kwargs: the other arguments a trainer passes, unused.

    Raises:
        ValueError: a ``source_dataset`` that names no reasoning-gym generator.
    """
    return _DEFAULT(completions, answer, metadata, generator_config)


_DEFAULT = ReasoningGymReward(ANSWER_TAG)
