"""The named statistics of PPO's (and GRPO's) update passes: :func:`proximal.train.batches.accumulate`
sums what each micro-batch returns and, for the keys named as extremes (PPO's ``ratio_max``, GRPO's
ratio and advantage extremes), takes the largest or smallest value instead — over micro-batches and
over ranks, in one all-reduce of the sums and one of the extremes. Expected values are worked out by
hand from the rows; the two-rank test runs real gloo processes.
"""

from __future__ import annotations

import math

import pytest
import torch
from multiproc import run_ranks

from proximal.train import batches
from proximal.train.batches import accumulate


def _stats(part: list[float]) -> dict:
    """A micro-batch's report: its size and sum (to be added up), its largest and smallest value
    (extremes; ∓inf when it has no positive value, the way a loss reports an empty mask)."""
    x = torch.tensor(part, dtype=torch.float32)
    pos = x[x > 0]
    return {
        "n": len(part),
        "sum": x.sum(),
        "hi": pos.max() if len(pos) else torch.tensor(-math.inf),
        "lo": pos.min() if len(pos) else torch.tensor(math.inf),
    }


def test_sums_maxima_and_minima_over_micro_batches_by_hand():
    # micro-batches of 2: [3, -1], [0.5, 7], [-2]: n 5, sum 7.5; positive values 3, 0.5, 7
    # (the last micro-batch has none and reports −inf / +inf, which change nothing)
    rows = [3.0, -1.0, 0.5, 7.0, -2.0]
    got = accumulate(rows, 2, _stats, maxima=("hi",), minima=("lo",))
    assert got == {"n": 5.0, "sum": 7.5, "hi": 7.0, "lo": 0.5}
    assert all(isinstance(v, float) for v in got.values())


def test_without_extremes_every_key_is_summed_as_before():
    # the call SFT, RM and DPO make: rows, micro-batch size, step, device — every output summed
    def sums(part):
        return {k: v for k, v in _stats(part).items() if k in ("n", "sum")}

    assert accumulate([3.0, -1.0, 0.5, 7.0, -2.0], 2, sums, "cpu") == {"n": 5.0, "sum": 7.5}
    assert accumulate([], 2, sums, "cpu") == {}


def test_micro_batches_cut_beforehand_go_one_at_a_time():
    # PPO hands accumulate its micro-batches already cut (micro_batch_size 1: a list of one each)
    seen = []

    def step(part):
        [micro] = part
        seen.append(micro)
        return _stats(micro)

    got = accumulate([[3.0, -1.0], [0.5, 7.0, -2.0]], 1, step, maxima=("hi",), minima=("lo",))
    assert seen == [[3.0, -1.0], [0.5, 7.0, -2.0]]
    assert got == {"n": 5.0, "sum": 7.5, "hi": 7.0, "lo": 0.5}


@pytest.mark.parametrize("extremes", [False, True])
def test_one_all_reduce_for_the_sums_and_one_for_the_extremes(monkeypatch, extremes):
    calls = []
    for name in ("all_reduce_sum", "all_reduce_max"):
        fn = getattr(batches.dist, name)
        monkeypatch.setattr(
            batches.dist, name, lambda t, fn=fn, name=name: calls.append(name) or fn(t)
        )
    kw = {"maxima": ("hi",), "minima": ("lo",)} if extremes else {}
    accumulate([3.0, -1.0, 0.5, 7.0, -2.0], 2, _stats, **kw)
    assert calls == (["all_reduce_sum", "all_reduce_max"] if extremes else ["all_reduce_sum"])


def _on_rank(rows_by_rank: list[list[float]]) -> dict:
    from proximal import dist

    return accumulate(rows_by_rank[dist.rank()], 2, _stats, maxima=("hi",), minima=("lo",))


def test_two_ranks_reduce_sums_and_extremes_globally():
    # rank 0: [3, -1], [0.5]; rank 1: [-4, -2] (no positive value: −inf / +inf only), [9, 0.25]
    # all rows: n 7, sum 5.75; positive values 3, 0.5, 9, 0.25
    rows = [[3.0, -1.0, 0.5], [-4.0, -2.0, 9.0, 0.25]]
    for got in run_ranks(2, _on_rank, rows):
        assert got == {"n": 7.0, "sum": 5.75, "hi": 9.0, "lo": 0.25}
