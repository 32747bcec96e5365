"""The pieces that make micro-batches and ranks add up to the whole batch: aggregation units, the
``normalizer`` of every loss, the Dr. GRPO aggregation, the SFT loss, pair means and the one table
of hyperparameter ranges. Expected values are worked by hand in float64."""

import math

import pytest
import torch
from f64 import F64, b  # tests/core/f64.py

from proximal.core import (
    aggregation_units,
    bradley_terry_loss,
    masked_aggregate,
    pair_mean,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from proximal.core.ranges import RANGES, check, problem

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], dtype=F64)
MASK = b([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # rows of 3, 1 and 0 valid tokens


def test_units_by_hand():
    assert float(aggregation_units(MASK, "token-mean")) == 4
    assert (
        float(aggregation_units(MASK, "seq-mean-token-mean")) == 2
    )  # the empty row is not a response
    assert float(aggregation_units(MASK, "seq-mean-token-sum-norm")) == 2
    with pytest.raises(ValueError, match="unknown aggregation 'seq-sum'"):
        aggregation_units(MASK, "seq-sum")


def test_aggregations_by_hand():
    assert float(masked_aggregate(LOSS, MASK, "token-mean")) == (1 + 2 + 3 + 4) / 4
    assert (
        float(masked_aggregate(LOSS, MASK, "seq-mean-token-mean")) == ((1 + 2 + 3) / 3 + 4 / 1) / 2
    )
    # Dr. GRPO: Σ over each row's tokens ÷ L (here L = 8), then the mean over rows
    assert (
        float(masked_aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_length=8))
        == ((6 / 8) + (4 / 8)) / 2
    )
    with pytest.raises(ValueError, match="needs max_length"):
        masked_aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_shares_of_a_split_batch_add_up_to_the_whole(aggregation):
    """Each slice normalised by the whole batch's unit count: the slices sum to the whole loss, and a
    slice with no valid token contributes exactly 0 (it does not raise)."""
    whole = masked_aggregate(LOSS, MASK, aggregation, max_length=8)
    total_units = aggregation_units(MASK, aggregation)
    parts = [
        masked_aggregate(
            LOSS[i : i + 1], MASK[i : i + 1], aggregation, max_length=8, normalizer=total_units
        )
        for i in range(3)
    ]
    assert float(parts[2]) == 0.0
    assert float(sum(parts)) == pytest.approx(float(whole), abs=1e-15)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        masked_aggregate(LOSS, MASK, aggregation, max_length=8, normalizer=0.0)


def test_policy_and_value_losses_take_the_normalizer():
    """At ratio 1 the policy loss is −Σ A / n; with normalizer N it is −Σ A / N. The value loss alike."""
    lp = torch.zeros(2, 3, dtype=F64)
    adv = torch.tensor([[1.0, 2.0, 5.0], [3.0, 7.0, 7.0]], dtype=F64)
    mask = b([[1, 1, 0], [1, 0, 0]])
    loss, stats = ppo_policy_loss(lp, lp, adv, mask, normalizer=10.0)
    assert float(loss) == -(1 + 2 + 3) / 10
    assert float(stats["clipfrac"]) == 0.0
    empty, stats = ppo_policy_loss(lp, lp, adv, torch.zeros_like(mask), normalizer=10.0)
    assert (
        float(empty) == 0.0 and float(stats["clipfrac"]) == 0.0
    )  # an empty share, no NaN, no raise
    v = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]], dtype=F64)
    ret = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    vl, _ = value_loss(
        v, v, ret, mask, normalizer=4.0
    )  # V = V_old: no clipping effect, ½·Σ(V − R)²/N
    assert float(vl) == 0.5 * (4 + 0 + 4) / 4


def test_sft_loss_by_hand_and_prompt_positions_never_read():
    torch.manual_seed(0)
    B, L, V = 2, 7, 5
    logits = torch.randn(B, L, V, dtype=F64)
    ids = torch.randint(0, V, (B, L))
    # row 0: prompt of 3, response of 4; row 1: prompt of 2, response of 2, then 3 pads
    response = b([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]])
    expected, n = 0.0, 0
    for row, (start, end) in enumerate([(3, 7), (2, 4)]):
        for t in range(start, end):  # token t is predicted by the logits at t − 1
            expected -= float(torch.log_softmax(logits[row, t - 1], -1)[ids[row, t]])
            n += 1
    assert n == 6
    loss = sft_loss(logits[:, :-1], ids[:, 1:], response[:, 1:])
    assert float(loss) == pytest.approx(expected / n, rel=1e-12)
    assert float(
        sft_loss(logits[:, :-1], ids[:, 1:], response[:, 1:], normalizer=12.0)
    ) == pytest.approx(expected / 12, rel=1e-12)
    # Logits that predict prompt tokens, or sit on the last token / padding, are never read: NaN
    # there changes nothing, and their gradient is exactly zero.
    unused = torch.ones(B, L, dtype=torch.bool)
    unused[0, 2:6] = False
    unused[1, 1:3] = False
    garbage = logits.clone()
    garbage[unused] = math.nan
    garbage.requires_grad_(True)
    loss2 = sft_loss(garbage[:, :-1], ids[:, 1:], response[:, 1:])
    assert float(loss2.detach()) == float(loss)
    loss2.backward()
    assert torch.all(garbage.grad[unused] == 0)
    assert torch.all(garbage.grad[~unused].abs().sum(-1) > 0)


def test_pair_mean_and_bradley_terry_normalizer():
    x = torch.tensor([1.0, 2.0, 6.0], dtype=F64)
    assert float(pair_mean(x)) == 3.0
    assert float(pair_mean(x, 6.0)) == 1.5
    with pytest.raises(ValueError):
        pair_mean(x, 0.0)
    w, lo = torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0.0, 0.0], dtype=F64)
    loss, _ = bradley_terry_loss(w, lo, normalizer=4.0)
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1.0)) + math.log(2.0)) / 4, rel=1e-14)


def test_ranges_one_table():
    assert check("clip_eps", 0.2) == 0.2
    with pytest.raises(ValueError, match=r"clip_eps = 1.5 must lie in \(0, 1\)"):
        check("clip_eps", 1.5)
    assert problem("lam", 1.0) is None and problem("lam", -0.1, "ppo.lam").startswith(
        "ppo.lam = -0.1"
    )
    assert problem("value_clip_eps", math.inf) is None  # ∞ turns value clipping off
    assert problem("beta", 0.0) is None and problem("beta", math.nan) is not None
    assert problem("label_smoothing", 0.5) is not None and problem("label_smoothing", 0.0) is None
    for name, (interval, what) in RANGES.items():
        assert what and str(interval).startswith(("(", "[")), name
    # the core functions enforce the same table
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), b([[1]]), clip_eps=1.0
        )


def test_value_clipfrac_does_not_count_rounding_inside_the_interval():
    """V within ε_v of V_old: V_clip = V_old + (V − V_old) can differ from V in its last bit, and the
    clipped error is then "larger" by an ulp on about half such tokens. That is not clipping: the
    fraction stays 0. (Before this definition, 1 and 2 processes logged different value clip
    fractions from the same update: the coin-flips landed differently.)"""
    g = torch.Generator().manual_seed(0)
    v = 3 * torch.randn(1, 4096, generator=g)
    old = (v + 0.4 * (2 * torch.rand(1, 4096, generator=g) - 1)) * 1.0000001  # all inside ε_v = 0.5
    ret = 10 * torch.randn(1, 4096, generator=g)
    v_clip = old + torch.clamp(v - old, -0.5, 0.5)
    coin_flips = int(((v_clip - ret) ** 2 > (v - ret) ** 2).sum())
    assert coin_flips > 0  # float32 rounding does show on some tokens
    mask = torch.ones_like(old, dtype=torch.bool)
    _, stats = value_loss(v, old, ret, mask, clip_eps=0.5)
    assert float(stats["vf_clipfrac"]) == 0.0
    # Outside the interval it counts. V_old = (0.1, 0.3, 0), V = (1.0, −0.3, 0.9), ε_v = 0.5, so V_clip =
    # (0.6, −0.2, 0.5); with R = (5, −5, 0) the clipped errors are 19.36 > 16, 23.04 > 22.09, 0.25 < 0.81.
    old3, v3, r3 = (
        torch.tensor([[0.1, 0.3, 0.0]]),
        torch.tensor([[1.0, -0.3, 0.9]]),
        torch.tensor([[5.0, -5.0, 0.0]]),
    )
    _, stats = value_loss(v3, old3, r3, b([[1, 1, 1]]), clip_eps=0.5)
    assert float(stats["vf_clipfrac"]) == pytest.approx(2 / 3)
