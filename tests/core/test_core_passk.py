"""pass@k, mean@n and maj@n (proximal.core.passk) against values derived by hand and against the
closed form 1 − C(n−c, k)/C(n, k) of Chen et al. 2021, evaluated exactly with ``math.comb`` and
fractions: a different computation from the product form under test."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from proximal.core.passk import group_metrics, majority_passes, pass_at_k


def _closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_by_hand():
    # n = 5, c = 2: 1 − C(3, k)/C(5, k) = 2/5, 1 − 3/10, 1 − 1/10, then 1 (fewer than k failures)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9, abs=1e-15)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-15)  # 1 − 21/252


def test_pass_at_k_edges():
    for n in (1, 4, 9):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0  # c = 0: nothing passes
            assert pass_at_k(n, n, k) == 1.0  # c = n: everything does
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)  # k = 1: the pass rate
            assert pass_at_k(n, c, n) == (1.0 if c else 0.0)  # k = n: any pass
    for bad in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match="0 ≤ c ≤ n and 1 ≤ k ≤ n"):
            pass_at_k(*bad)


def test_pass_at_k_equals_the_closed_form_everywhere_small_and_is_stable_large():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_closed_form(n, c, k)), abs=1e-13)
    # C(2000, 1000) has 600 digits (no float holds it); the product form needs none of it:
    # one pass in 2000, k = 1000 of them drawn: 1 − C(1999, 1000)/C(2000, 1000) = 1000/2000.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(2000, 7, 300) == pytest.approx(float(_closed_form(2000, 7, 300)), abs=1e-12)


def test_group_metrics_average_per_prompt():
    # three prompts of n = 4: c = 2, 0, 4
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    answers = [["7", "8", "9", "7"], ["1", "2", "2", "3"], ["5", "5", "6", "5"]]
    got = group_metrics(scores, answers, ks=[1, 2, 4], threshold=1.0)
    assert got["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3, abs=1e-15)
    assert got["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3, abs=1e-15)  # 1 − C(2,2)/C(4,2)
    assert got["pass@4"] == pytest.approx(2 / 3, abs=1e-15)
    assert got["mean@n"] == pytest.approx((0.5 + 0 + 1) / 3, abs=1e-15)
    # majorities: "7" (passes), "2" (fails), "5" (passes)
    assert got["maj@n"] == pytest.approx(2 / 3, abs=1e-15)


def test_threshold_decides_a_pass_and_mean_at_n_reads_the_scores():
    # a fractional scorer (countdown's 0.01 for a wrong well-formed answer): at 1.0 only exact passes
    scores = [[1.0, 0.01, 0.01, 0.5]]
    answers = [["a", "b", "c", "d"]]
    assert group_metrics(scores, answers, ks=[1], threshold=1.0)["pass@1"] == 0.25
    assert group_metrics(scores, answers, ks=[1], threshold=0.5)["pass@1"] == 0.5
    assert group_metrics(scores, answers, ks=[1], threshold=0.01)["pass@1"] == 1.0
    assert group_metrics(scores, answers, ks=[1], threshold=1.0)["mean@n"] == pytest.approx(
        1.52 / 4, abs=1e-15
    )
    # a missing score (None, NaN: the function did not apply) is no pass and not in mean@n
    got = group_metrics(
        [[None, 1.0], [math.nan, 0.0]], [["x", "y"], ["x", "y"]], ks=[1, 2], threshold=1.0
    )
    assert got["pass@1"] == 0.25 and got["pass@2"] == 0.5
    assert got["mean@n"] == pytest.approx(0.5, abs=1e-15)  # prompt means 1.0 and 0.0


def test_majority_tie_goes_to_the_answer_given_first():
    # 2–2 ties: the answer sampled first wins, so the same votes in another order decide otherwise
    assert majority_passes([True, False, False, True], ["7", "8", "8", "7"]) is True
    assert majority_passes([False, True, True, False], ["8", "7", "7", "8"]) is False
    # a clear majority beats the first answer
    assert majority_passes([True, False, False], ["7", "8", "8"]) is False
    # no answer, no vote; nobody voting: no pass
    assert majority_passes([False, False, True], [None, None, "3"]) is True
    assert majority_passes([True, True], [None, None]) is False
    # the majority answer passes when its first response passed
    assert majority_passes([False, True, True], ["4", "4", "5"]) is False
    with pytest.raises(ValueError, match="2 passes but 1 answers"):
        majority_passes([True, False], ["1"])


def test_group_metrics_refuses_uneven_groups_and_k_above_n():
    with pytest.raises(ValueError, match="same number of responses"):
        group_metrics([[1.0], [1.0, 0.0]], [["a"], ["a", "b"]], ks=[1], threshold=1.0)
    with pytest.raises(ValueError, match=r"\[1, n = 2\]"):
        group_metrics([[1.0, 0.0]], [["a", "b"]], ks=[3], threshold=1.0)
