"""``accuracy_reward``: a completion's final mathematical answer checked against the row's solution
by math-verify (Hugging Face's answer checker, the one TRL's ``accuracy_reward`` and open-r1 use).
Needs the ``reasoning`` extra: ``pip install 'proximal-rlhf[reasoning]'``."""

from __future__ import annotations

import logging
import threading

from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify

from proximal.rewards.rules import completion_text

#: TRL's bounds on one parse and one comparison, in seconds, where math-verify can enforce them: in
#: the main thread only, as its timeouts are ``signal.alarm``. They matter: ``\boxed{9^{9^{9^{9}}}}``
#: parses in milliseconds and then compares for ever (measured: still running after 60 s).
PARSING_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5

#: How the answer is read from a completion (TRL's): LaTeX only, ``\boxed{}`` first, and only
#: behind an anchor (``\boxed{}``, ``$…$`` after "final answer is" and the like) — a bare number in
#: the text is not an answer; units such as "cm" are dropped.
ANSWER_EXTRACTION = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
]


def accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    r"""1.0 where the completion's answer equals the row's ``solution`` mathematically, 0.0 where it
    does not or cannot be read, None (does not apply) where the solution itself does not parse:
    TRL's ``trl.rewards.accuracy_reward`` (trl/rewards/accuracy_rewards.py), the same calls.

    The solution is parsed with math-verify's default extraction (LaTeX, then a plain expression:
    ``\frac{1}{2}``, ``$\frac{1}{2}$``, ``0.5`` and ``1/2`` all parse); the completion with
    :data:`ANSWER_EXTRACTION` (``\boxed{0.5}`` or ``the final answer is $0.5$``; a bare ``0.5`` is
    not read; two boxes are read as the set of both, so ``\boxed{3} or \boxed{4}`` is not 3).
    ``verify(gold, answer)`` then compares them as sympy does, numbers to 6 decimals: ½ equals
    ``\boxed{0.5}``, ``\boxed{5 \text{ cm}}`` equals 5, ``\boxed{x \cdot x}`` equals x². Bare LaTeX
    solutions other than fractions do not parse (``\sqrt{2}``: None; ``$\sqrt{2}$`` parses).

    Safe in any thread: math-verify's time limits use ``signal.alarm``, which raises outside the
    main thread, so there they are off (``parsing_timeout=None``, ``timeout_seconds=None``) and the
    run's ``model.reward_timeout_s`` is the bound; in the main thread, where proximal calls reward
    functions, TRL's limits apply (:data:`PARSING_TIMEOUT_S`, :data:`VERIFY_TIMEOUT_S`: a parse or a
    comparison that runs out counts as no answer, 0.0), so one pathological answer costs seconds
    rather than the run.

    Args:
        completions: one per row, text or messages (:func:`~proximal.rewards.rules.completion_text`).
        solution: the reference answer per row (a column), LaTeX or plain.
        **kwargs: the other arguments a trainer passes, unused.

    Returns:
        one float, or None, per completion.
    """
    main = threading.current_thread() is threading.main_thread()
    parsing_timeout = PARSING_TIMEOUT_S if main else None
    verify_timeout = VERIFY_TIMEOUT_S if main else None
    if not main:  # as TRL: the "timeout is disabled" warning is the point here, not news
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    scores: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = parse(str(gold), parsing_timeout=parsing_timeout) if gold is not None else []
        if not gold_parsed:
            scores.append(None)  # TRL: a solution that does not parse skips the row
            continue
        answer_parsed = parse(
            completion_text(completion),
            extraction_config=ANSWER_EXTRACTION,
            extraction_mode="first_match",
            parsing_timeout=parsing_timeout,
        )
        scores.append(float(verify(gold_parsed, answer_parsed, timeout_seconds=verify_timeout)))
    return scores
