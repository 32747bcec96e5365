"""Metrics over n sampled responses per prompt: pass@k, mean@n and maj@n.

A prompt's n responses are scored; a response *passes* when its score is at or above a threshold.
With c of the n passing:

* **pass@k** — the probability that at least one of k responses drawn without replacement from
  the n passes, the unbiased estimator of Chen et al. 2021 (*Evaluating Large Language Models
  Trained on Code*, eq. 1): ``1 − C(n−c, k) / C(n, k)``. It is computed as their numerically
  stable product ``1 − ∏_{i=n−c+1}^{n} (1 − k/i)`` (no binomial coefficient is formed, so n in the
  thousands does not overflow), and is exactly 1 when ``n − c < k`` (every k-subset holds a pass).
  pass@1 is c/n, the mean pass rate; pass@n is 1 if any response passed.
* **mean@n** — the mean score over the n responses (the scores themselves, not passes).
* **maj@n** — majority voting (Wang et al. 2023, *self-consistency*): the answer given most often
  among the n responses is the prompt's answer; maj@n is 1 when that answer passes. A response
  without an answer (None) does not vote; a prompt where none voted scores 0. Ties go to the answer
  given first (the lowest sample index), so the rule is deterministic; and the majority answer
  passes when the first response that gave it passed.

Each is computed per prompt and averaged over prompts (:func:`group_metrics`), so a prompt counts
once whatever its n. Pure functions of Python numbers: no torch, no process group — a caller with
responses spread over ranks gathers each prompt's ``(scores, answers)`` first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` passing responses out of ``n`` (Chen et al. 2021,
    eq. 1, in their stable product form): ``1 − C(n−c, k)/C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)``.
    Needs ``0 ≤ c ≤ n`` and ``1 ≤ k ≤ n``; ValueError otherwise."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 ≤ c ≤ n and 1 ≤ k ≤ n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a pass (this also covers c = n)
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_passes(passes: Sequence[bool], answers: Sequence[str | None]) -> bool:
    """One prompt's maj@n: whether the answer given most often among ``answers`` passes (a tie goes
    to the answer given first; a None answer does not vote; no vote at all: False). ``passes[j]``
    says whether response j passed; the majority answer passes when the first response that gave it
    did."""
    if len(passes) != len(answers):
        raise ValueError(f"{len(passes)} passes but {len(answers)} answers")
    votes: dict[str, int] = {}
    first: dict[str, int] = {}
    for j, a in enumerate(answers):
        if a is not None:
            votes[a] = votes.get(a, 0) + 1
            first.setdefault(a, j)
    if not votes:
        return False
    # dicts keep insertion order, so max() returns the first answer among those with the most votes
    winner = max(votes, key=votes.__getitem__)
    return bool(passes[first[winner]])


def group_metrics(
    scores: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str | None]],
    *,
    ks: Sequence[int],
    threshold: float,
) -> dict[str, float]:
    """pass@k for each k of ``ks``, mean@n and maj@n, each per prompt and then averaged over
    prompts. ``scores[p]`` are prompt p's n response scores (NaN or None: no score, which is not a
    pass and is left out of mean@n's mean), ``answers[p]`` their answers (for maj@n); a response
    passes when its score ≥ ``threshold``. Every prompt must have the same n ≥ max(ks).

    Returns ``{"pass@k": …, "mean@n": …, "maj@n": …}`` (mean@n NaN when no response has a score)."""
    if len(scores) != len(answers):
        raise ValueError(f"{len(scores)} prompts' scores but {len(answers)} prompts' answers")
    if not scores:
        raise ValueError("group_metrics needs at least one prompt")
    sizes = {len(s) for s in scores}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of responses; got {sorted(sizes)}")
    n = sizes.pop()
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"every k of pass@k must lie in [1, n = {n}]; got {list(ks)}")
    passes = [[_has(x) and x >= threshold for x in s] for s in scores]
    out = {f"pass@{k}": sum(pass_at_k(n, sum(p), k) for p in passes) / len(passes) for k in ks}
    means = [sum(have) / len(have) for s in scores if (have := [x for x in s if _has(x)])]
    out["mean@n"] = sum(means) / len(means) if means else float("nan")
    out["maj@n"] = sum(majority_passes(p, a) for p, a in zip(passes, answers)) / len(passes)
    return out


def _has(x: float | None) -> bool:
    return x is not None and not math.isnan(x)
