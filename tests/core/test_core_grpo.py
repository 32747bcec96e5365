"""GRPO / Dr. GRPO / DAPO / RLOO math: group-normalised and leave-one-out advantages, DAPO's filters
of the rows to train on, and the GRPO policy loss — hand-worked float64 values (the expected numbers
come from plain Python arithmetic, never from the functions under test), where the gradient is and
is not zero, Dr. GRPO's length property, the on-policy REINFORCE identity, and garbage at masked
positions."""

import math
import statistics

import pytest
import torch
from f64 import F64, INF, NAN, b, close, t  # tests/core/f64.py

from proximal.core import (
    aggregation_units,
    group_advantages,
    grpo_advantages,
    grpo_policy_loss,
    masked_aggregate,
    rloo_advantages,
    uniform_groups,
)

EPS = 1e-4


# ---------------------------------------------------------------------------------- advantages
# Two groups of G = 3: [1, 2, 6] (mean 3, deviations −2, −1, 3, sample variance 14/2 = 7) and the
# uniform [0.1, 0.1, 0.1] (0.1 + 0.1 + 0.1 = 0.30000000000000004 in floats, so only an explicit
# uniform-group rule gives exactly 0). A third group [4, 0, 2]: mean 2, deviations 2, −2, 0,
# sample variance 8/2 = 4.
SCORES = [1.0, 2.0, 6.0, 0.1, 0.1, 0.1, 4.0, 0.0, 2.0]
DEVS = [-2.0, -1.0, 3.0, 0.0, 0.0, 0.0, 2.0, -2.0, 0.0]
GROUP_STD = [math.sqrt(7)] * 3 + [0.0] * 3 + [2.0] * 3
BATCH_STD = statistics.stdev(SCORES)  # sample std of all nine scores (Python's own ÷(n − 1))


def test_group_advantages_each_scale_by_hand():
    s = t(SCORES)
    close(
        group_advantages(s, 3, "group", eps=EPS),
        [d / (sd + EPS) if sd else 0.0 for d, sd in zip(DEVS, GROUP_STD)],
    )
    close(group_advantages(s, 3, "batch", eps=EPS), [d / (BATCH_STD + EPS) for d in DEVS])
    close(group_advantages(s, 3, "none"), DEVS)
    assert (
        group_advantages(s, 3).dtype == F64
        and group_advantages(s.float(), 3).dtype == torch.float32
    )


def test_rloo_advantages_by_hand():
    # r_i − mean of the two others: group 1: 1 − 4, 2 − 3.5, 6 − 1.5; group 3: 4 − 1, 0 − 3, 2 − 2
    close(rloo_advantages(t(SCORES), 3), [-3.0, -1.5, 4.5, 0.0, 0.0, 0.0, 3.0, -3.0, 0.0])
    # the identity Â_i = G/(G − 1)·(r_i − mean)
    close(rloo_advantages(t(SCORES), 3), [1.5 * d for d in DEVS])


def test_rloo_equals_a_loop_over_the_other_responses():
    torch.manual_seed(0)
    s = torch.randn(4 * 5, dtype=F64)
    want = []
    for i in range(len(s)):
        g = i // 5
        others = [float(s[j]) for j in range(g * 5, g * 5 + 5) if j != i]
        want.append(float(s[i]) - sum(others) / 4)
    close(rloo_advantages(s, 5), want)


@pytest.mark.parametrize("scale", ["group", "batch", "none", "rloo"])
@pytest.mark.parametrize("value", [0.1, 0.0, -3.7, 1e6])
def test_a_uniform_group_gives_exactly_zero_and_no_nan(scale, value):
    s = t([value] * 4 + [1.0, 0.0, 0.0, 1.0])
    for eps in (EPS, 0.0):
        adv = rloo_advantages(s, 4) if scale == "rloo" else group_advantages(s, 4, scale, eps=eps)
        assert torch.isfinite(adv).all()
        assert adv[:4].tolist() == [0.0] * 4
        assert (adv[4:] != 0).all()
    # a batch where every group is uniform: the batch std is 0 too, still no NaN (even with ε = 0)
    uniform = t([value] * 8)
    adv = (
        rloo_advantages(uniform, 4)
        if scale == "rloo"
        else group_advantages(uniform, 4, scale, eps=0.0)
    )
    assert adv.tolist() == [0.0] * 8


def test_uniform_groups_by_hand():
    assert uniform_groups(t(SCORES), 3).tolist() == [False, True, False]
    valid = b(
        [1, 1, 1, 1, 1, 1, 1, 0, 0]
    )  # the third group has one valid row left: no signal either
    assert uniform_groups(t(SCORES), 3, valid=valid).tolist() == [False, True, True]


def test_invalid_rows_are_left_out_of_every_statistic_and_never_read():
    # group 1 loses its "6" (non-finite score): [1, 2] — mean 1.5, sample std √0.5; group 2 is intact
    s = t([1.0, 2.0, NAN, 4.0, 0.0, 2.0])
    valid = b([1, 1, 0, 1, 1, 1])
    sd1 = math.sqrt(0.5)
    close(
        group_advantages(s, 3, "group", eps=EPS, valid=valid),
        [-0.5 / (sd1 + EPS), 0.5 / (sd1 + EPS), 0.0, 2 / (2 + EPS), -2 / (2 + EPS), 0.0],
    )
    close(group_advantages(s, 3, "none", valid=valid), [-0.5, 0.5, 0.0, 2.0, -2.0, 0.0])
    valid_scores = [1.0, 2.0, 4.0, 0.0, 2.0]
    sd_b = statistics.stdev(valid_scores)
    close(
        group_advantages(s, 3, "batch", eps=EPS, valid=valid),
        [-0.5 / (sd_b + EPS), 0.5 / (sd_b + EPS), 0.0, 2 / (sd_b + EPS), -2 / (sd_b + EPS), 0.0],
    )
    close(rloo_advantages(s, 3, valid=valid), [-1.0, 1.0, 0.0, 3.0, -3.0, 0.0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: group_advantages(t([1.0, 2.0, 3.0]), 2), "do not split into groups of 2"),
        (lambda: group_advantages(t([1.0, 2.0]), 0), "group_size must be a positive int"),
        (lambda: group_advantages(t([1.0, 2.0]), 2, "std"), "unknown scale 'std'"),
        (lambda: group_advantages(t([1.0, 2.0]), 2, eps=-1.0), "group-advantage"),
        (lambda: group_advantages(t([[1.0, 2.0]]), 2), r"scores must be \(B,\)"),
        (lambda: rloo_advantages(t([1.0, 2.0]), 1), "group_size must be ≥ 2"),
    ],
)
def test_advantage_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ a step's advantages and rows
# SCORES again, with the middle response of group 1 and the first of group 3 truncated (no stop).
ENDED = b([1, 0, 1, 1, 1, 1, 0, 1, 1])
ALL = b([1] * 9)


@pytest.mark.parametrize(
    "skip_uniform, mask_truncated, train",
    [
        (False, False, [1, 1, 1, 1, 1, 1, 1, 1, 1]),  # every valid row
        (True, False, [1, 1, 1, 0, 0, 0, 1, 1, 1]),  # group 2 is uniform
        (False, True, [1, 0, 1, 1, 1, 1, 0, 1, 1]),  # the two truncated responses
        (True, True, [1, 0, 1, 0, 0, 0, 0, 1, 1]),
    ],
)
def test_grpo_advantages_filters_pick_the_rows_and_leave_the_advantages_alone(
    skip_uniform, mask_truncated, train
):
    adv, rows, uniform = grpo_advantages(
        t(SCORES),
        ALL,
        ENDED,
        3,
        scale="none",
        eps=EPS,
        skip_uniform_groups=skip_uniform,
        mask_truncated=mask_truncated,
    )
    assert rows.tolist() == [bool(x) for x in train]
    assert uniform.tolist() == [False, True, False]
    # a truncated response still counts in its group's mean: group 1's is 3 (not (1 + 6)/2 = 3.5 as
    # it would be without the "2"), so the "1" gets −2 (not −2.5)
    close(adv, DEVS)


@pytest.mark.parametrize(
    "scale, want",
    [
        ("group", [d / (sd + EPS) if sd else 0.0 for d, sd in zip(DEVS, GROUP_STD)]),
        ("batch", [d / (BATCH_STD + EPS) for d in DEVS]),
        ("none", DEVS),
        (None, [-3.0, -1.5, 4.5, 0.0, 0.0, 0.0, 3.0, -3.0, 0.0]),  # RLOO, as by hand above
    ],
)
def test_grpo_advantages_each_estimator_by_hand(scale, want):
    adv, _, _ = grpo_advantages(
        t(SCORES),
        ALL,
        ENDED,
        3,
        scale=scale,
        eps=EPS,
        skip_uniform_groups=True,
        mask_truncated=True,
    )
    close(adv, want)


def test_grpo_advantages_never_trains_an_invalid_row():
    # group 1 loses its "6" (a non-finite score, never read); group 3 keeps one valid row only, so
    # it has no signal: uniform, and skipped with the filter
    s = t([1.0, 2.0, NAN, 4.0, 0.0, 2.0, 5.0, NAN, NAN])
    valid = b([1, 1, 0, 1, 1, 1, 1, 0, 0])
    for skip, train in ((False, [1, 1, 0, 1, 1, 1, 1, 0, 0]), (True, [1, 1, 0, 1, 1, 1, 0, 0, 0])):
        adv, rows, uniform = grpo_advantages(
            s,
            valid,
            ALL,
            3,
            scale="none",
            eps=EPS,
            skip_uniform_groups=skip,
            mask_truncated=True,
        )
        assert rows.tolist() == [bool(x) for x in train]
        assert uniform.tolist() == [False, False, True]
        close(adv, [-0.5, 0.5, 0.0, 2.0, -2.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("ended", [b([1] * 8), t([1.0] * 9)])
def test_grpo_advantages_checks_ended(ended):
    with pytest.raises(ValueError, match="ended must be bool"):
        grpo_advantages(
            t(SCORES),
            ALL,
            ended,
            3,
            scale="group",
            eps=EPS,
            skip_uniform_groups=False,
            mask_truncated=True,
        )


# ---------------------------------------------------------------------------------- the loss
# ε = 0.2, ε_high = 0.28: the interval is [0.8, 1.28]. Row 0 has Â = +2 and three tokens, row 1
# Â = −2 and four tokens (row 0's fourth column is padding, filled with garbage).
#   row tok  Â    ρ     ρ·Â    clip(ρ)·Â  min    flattened?
#   0   0   +2   1.5   3.0    2.56       2.56   yes (above 1 + ε_high, Â > 0)
#   0   1   +2   1.25  2.5    2.5        2.5    no  (inside; a symmetric ε = 0.2 would clip it)
#   0   2   +2   0.5   1.0    1.6        1.0    no  (Â > 0 below 1 − ε: still pushed up)
#   1   0   −2   1.5  −3.0   −2.56      −3.0    no  (Â < 0 above the interval: still pushed down)
#   1   1   −2   0.5  −1.0   −1.6       −1.6    yes (below 1 − ε, Â < 0)
#   1   2   −2   0.9  −1.8   −1.8       −1.8    no
#   1   3   −2   1.1  −2.2   −2.2       −2.2    no
RATIOS = [[1.5, 1.25, 0.5], [1.5, 0.5, 0.9, 1.1]]
ADV = [2.0, -2.0]
MINS = [[2.56, 2.5, 1.0], [-3.0, -1.6, -1.8, -2.2]]
FLAT = [[True, False, False], [False, True, False, False]]
OLD = [[-1.0, -2.0, -0.5, NAN], [-3.0, -1.5, -0.7, -2.5]]
REF = [[-1.2, -1.9, -0.1, INF], [-2.0, -2.0, -0.3, -2.6]]
L = 8  # max_length for Dr. GRPO
MASK = b([[1, 1, 1, 0], [1, 1, 1, 1]])
N = [3, 4]


def _inputs():
    old = t(OLD)
    new = old.clone()
    for i, row in enumerate(RATIOS):
        for j, r in enumerate(row):
            new[i, j] = OLD[i][j] + math.log(r)
    new[0, 3] = NAN  # garbage at the padded position
    return new.requires_grad_(True), old, t(REF), t(ADV), MASK


def _weights(aggregation):
    """The weight each token's ℓ gets in the aggregated loss (two responses)."""
    if aggregation == "token-mean":
        return [[1 / 7] * n for n in N]
    if aggregation == "seq-mean-token-mean":
        return [[1 / (n * 2)] * n for n in N]
    return [[1 / (L * 2)] * n for n in N]


def _k3(lp, ref):
    return math.exp(ref - lp) - (ref - lp) - 1


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_and_gradient_by_hand(aggregation, beta):
    new, old, ref, adv, mask = _inputs()
    loss, stats = grpo_policy_loss(
        new,
        old,
        ref,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        beta=beta,
        aggregation=aggregation,
        max_length=L,
    )
    w = _weights(aggregation)
    lps = [[OLD[i][j] + math.log(r) for j, r in enumerate(row)] for i, row in enumerate(RATIOS)]
    pg = sum(-MINS[i][j] * w[i][j] for i in range(2) for j in range(N[i]))
    kl = sum(_k3(lps[i][j], REF[i][j]) * w[i][j] for i in range(2) for j in range(N[i]))
    assert loss.item() == pytest.approx(pg + beta * kl, abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(pg, abs=1e-12)
    assert stats["kl_loss"].item() == pytest.approx(beta * kl, abs=1e-12)

    loss.backward()
    for i in range(2):
        for j in range(N[i]):
            r, a = RATIOS[i][j], ADV[i]
            d_pg = 0.0 if FLAT[i][j] else -r * a  # d(−min)/d log π on the unclipped branch
            d_kl = 1 - math.exp(REF[i][j] - lps[i][j])  # d k3 / d log π
            want = (d_pg + beta * d_kl) * w[i][j]
            assert new.grad[i, j].item() == pytest.approx(want, abs=1e-12)
            if FLAT[i][j] and beta == 0:
                assert new.grad[i, j].item() == 0.0  # exactly, not nearly
    assert new.grad[0, 3].item() == 0.0  # the padded position: no gradient, no NaN


def test_stats_by_hand():
    new, old, ref, adv, mask = _inputs()
    _, stats = grpo_policy_loss(
        new, old, ref, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, beta=0.1
    )
    flat = [r for row in RATIOS for r in row]
    lps = [OLD[i][j] + math.log(r) for i, row in enumerate(RATIOS) for j, r in enumerate(row)]
    refs = [REF[i][j] for i, row in enumerate(RATIOS) for j, _ in enumerate(row)]
    assert stats["clipfrac_high"].item() == pytest.approx(1 / 7, abs=1e-15)
    assert stats["clipfrac_low"].item() == pytest.approx(1 / 7, abs=1e-15)
    assert stats["ratio_mean"].item() == pytest.approx(sum(flat) / 7, abs=1e-12)
    assert stats["ratio_min"].item() == pytest.approx(0.5, abs=1e-12)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-12)
    assert stats["kl_ref"].item() == pytest.approx(
        sum(_k3(lp, r) for lp, r in zip(lps, refs)) / 7, abs=1e-12
    )
    # KL(π_old ‖ π_θ) from samples of π_old with k3: (ρ − 1) − log ρ
    assert stats["approx_kl"].item() == pytest.approx(
        sum((r - 1) - math.log(r) for r in flat) / 7, abs=1e-12
    )
    assert stats["advantage_mean"].item() == pytest.approx((3 * 2 - 4 * 2) / 7, abs=1e-15)
    assert stats["advantage_min"].item() == -2.0 and stats["advantage_max"].item() == 2.0
    assert all(not v.requires_grad for v in stats.values())


def test_symmetric_clip_by_default():
    """Without ε_high the interval is [1 − ε, 1 + ε]: ρ = 1.25 with Â > 0 is now clipped (gradient 0)."""
    new, old, ref, adv, mask = _inputs()
    loss, stats = grpo_policy_loss(
        new, old, None, adv, mask, clip_eps_low=0.2, beta=0.0, aggregation="token-mean"
    )
    loss.backward()
    assert new.grad[0, 1].item() == 0.0
    assert stats["clipfrac_high"].item() == pytest.approx(2 / 7, abs=1e-15)
    mins = [2.4, 2.4, 1.0, -3.0, -1.6, -1.8, -2.2]
    assert loss.item() == pytest.approx(-sum(mins) / 7, abs=1e-12)
    assert stats["kl_ref"].item() == 0.0 and stats["kl_loss"].item() == 0.0


def test_dr_grpo_token_gradient_does_not_depend_on_its_response_length():
    """Liu et al. 2025, §3.1: with seq-mean-token-mean a token of a response of n tokens gets weight
    1/n, so the same token with the same advantage moves less in a longer response; Dr. GRPO's
    Σ/L aggregation gives every token the same weight whatever the length."""

    def first_token_grad(aggregation, length):
        T = 6
        lp = torch.zeros(2, T, dtype=F64, requires_grad=True)
        mask = torch.zeros(2, T, dtype=torch.bool)
        mask[0, :length] = True  # the response whose first token we watch
        mask[1, :2] = True  # another response in the group, length fixed
        loss, _ = grpo_policy_loss(
            lp,
            lp.detach(),
            None,
            t([1.0, -1.0]),
            mask,
            beta=0.0,
            aggregation=aggregation,
            max_length=T,
        )
        loss.backward()
        return lp.grad[0, 0].item()

    sum_norm = [first_token_grad("seq-mean-token-sum-norm", n) for n in (1, 3, 6)]
    assert sum_norm == [-1 / (6 * 2)] * 3  # −Â/(L·G), the same for every length
    seq_mean = [first_token_grad("seq-mean-token-mean", n) for n in (1, 3, 6)]
    assert seq_mean == pytest.approx(
        [-1 / (1 * 2), -1 / (3 * 2), -1 / (6 * 2)], abs=1e-15
    )  # −Â/(n·G)
    assert len(set(seq_mean)) == 3


@pytest.mark.parametrize("aggregation", AGGS)
def test_on_policy_ratio_is_one_and_gradient_is_reinforce_with_baseline(aggregation):
    """μ = 1, first update: π_old is the current policy, so ρ = 1 exactly and (β = 0) the parameter
    gradient equals that of the REINFORCE-with-baseline loss −agg(Â·log π_θ) (Williams 1992)."""
    torch.manual_seed(0)
    B, T, V = 4, 5, 7
    theta = torch.randn(B, T, V, dtype=F64, requires_grad=True)  # a tabular policy's logits
    tokens = torch.randint(0, V, (B, T))
    mask = b([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = group_advantages(t([1.0, 0.0, 0.0, 1.0]), 4)  # one group of G = 4

    def logprobs():
        return torch.log_softmax(theta, -1).gather(-1, tokens[..., None]).squeeze(-1)

    lp = logprobs()
    loss, stats = grpo_policy_loss(
        lp, lp.detach(), None, adv, mask, beta=0.0, aggregation=aggregation, max_length=T
    )
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clipfrac_low"].item() == 0.0 and stats["clipfrac_high"].item() == 0.0
    (g_grpo,) = torch.autograd.grad(loss, theta)

    lp = logprobs()
    reinforce = masked_aggregate(-adv[:, None] * lp, mask, aggregation, max_length=T)
    (g_rb,) = torch.autograd.grad(reinforce, theta)
    torch.testing.assert_close(g_grpo, g_rb, rtol=0, atol=1e-15)
    # and by hand at the log-probabilities: −Â_i times the token's aggregation weight
    lp = logprobs().detach().requires_grad_(True)
    loss, _ = grpo_policy_loss(
        lp, lp.detach(), None, adv, mask, beta=0.0, aggregation=aggregation, max_length=T
    )
    loss.backward()
    n = mask.sum(1).tolist()
    weight = {
        "token-mean": [1 / sum(n)] * B,
        "seq-mean-token-mean": [1 / (k * B) for k in n],
        "seq-mean-token-sum-norm": [1 / (T * B)] * B,
    }[aggregation]
    want = torch.where(mask, (-adv * t(weight))[:, None].expand(B, T), 0.0)
    torch.testing.assert_close(lp.grad, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("aggregation", AGGS)
def test_garbage_at_masked_positions_changes_nothing(aggregation):
    torch.manual_seed(1)
    B, T = 3, 5
    mask = b([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    lp = -torch.rand(B, T, dtype=F64)
    old = lp + 0.3 * torch.randn(B, T, dtype=F64)
    ref = lp + 0.3 * torch.randn(B, T, dtype=F64)
    adv = torch.randn(B, T, dtype=F64)
    results = []
    for fill in (0.0, NAN, INF, -INF, 1e30):

        def dirty(x):
            return torch.where(mask, x, fill)

        x = dirty(lp).requires_grad_(True)
        loss, stats = grpo_policy_loss(
            x,
            dirty(old),
            dirty(ref),
            dirty(adv),
            mask,
            clip_eps_high=0.28,
            beta=0.05,
            aggregation=aggregation,
            max_length=T,
        )
        loss.backward()
        assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()
        results.append((loss.detach(), x.grad, {k: v for k, v in stats.items()}))
    for loss, grad, stats in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert all(torch.equal(stats[k], results[0][2][k]) for k in stats)


@pytest.mark.parametrize("aggregation", AGGS)
def test_shares_with_the_whole_batch_normalizer_add_up(aggregation):
    """Micro-batches (and ranks) each normalised by the whole batch's unit count: their losses and
    gradients add up to the whole batch's, and a share with no valid token gives exactly 0."""
    new, old, ref, adv, mask = _inputs()
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    new = torch.cat([new.detach(), t([[0.0] * 4])]).requires_grad_(True)
    old, ref, adv = (
        torch.cat([old, t([[0.0] * 4])]),
        torch.cat([ref, t([[0.0] * 4])]),
        torch.cat([adv, t([1.0])]),
    )
    kw = dict(clip_eps_high=0.28, beta=0.1, aggregation=aggregation, max_length=L)
    whole, _ = grpo_policy_loss(new, old, ref, adv, mask, **kw)
    (g_whole,) = torch.autograd.grad(whole, new)
    units = aggregation_units(mask, aggregation)
    parts, grads = [], []
    for i in range(3):
        part, _ = grpo_policy_loss(
            new[i : i + 1],
            old[i : i + 1],
            ref[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            normalizer=units,
            **kw,
        )
        parts.append(part.item())
        grads.append(torch.autograd.grad(part, new, allow_unused=True)[0])
    assert parts[2] == 0.0
    assert sum(parts) == pytest.approx(whole.item(), abs=1e-15)
    torch.testing.assert_close(sum(grads), g_whole, rtol=0, atol=1e-15)


def test_uniform_group_trains_nothing_without_beta():
    adv = group_advantages(t([0.5, 0.5, 0.5, 0.5]), 4)
    lp = torch.zeros(4, 3, dtype=F64, requires_grad=True)
    loss, _ = grpo_policy_loss(
        lp, lp.detach(), None, adv, torch.ones(4, 3, dtype=torch.bool), beta=0.0
    )
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"beta": 0.1, "ref": None}, "needs ref_logprobs"),
        ({"clip_eps_high": 0.0}, "clip_eps_high"),
        ({"clip_eps_high": -0.1}, "clip_eps_high"),
        ({"clip_eps_low": 1.0}, "clip_eps"),
        ({"beta": -0.1}, "beta"),
        ({"aggregation": "seq-sum"}, "'seq-sum'"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "needs max_length"),
        ({"adv": t([1.0, 2.0, 3.0])}, r"advantages must be \(B,\) or \(B, T\)"),
    ],
)
def test_loss_validation(kw, match):
    x = t([[0.0, 0.0]] * 2)
    ref = kw.pop("ref", x)
    adv = kw.pop("adv", t([1.0, -1.0]))
    with pytest.raises(ValueError, match=match):
        grpo_policy_loss(x, x, ref, adv, b([[1, 1], [1, 0]]), **kw)


def test_kl_logprobs_carry_the_reference_term_and_the_ratio_keeps_logprobs():
    """Under a replayed top-k/top-p filter the ratio is on the truncated support (``logprobs``)
    and the k3 term on the full softmax (``kl_logprobs``): each term reads only its own input."""
    lp = t([[-0.5, -1.0]]).requires_grad_(True)  # log π_θ^f (filtered)
    full = t([[-0.7, -1.3]]).requires_grad_(True)  # log π_θ (full softmax)
    old, ref = t([[-0.5, -1.0]]), t([[-0.9, -1.0]])
    mask = b([[True, True]])
    loss, st = grpo_policy_loss(
        lp, old, ref, t([1.0]), mask, beta=0.5, aggregation="token-mean", kl_logprobs=full
    )
    # on-policy ratio 1: the surrogate is −Â = −1 per token; k3(full, ref) = e^d − d − 1, d = ref − full
    k3 = [math.exp(d) - d - 1 for d in (-0.9 + 0.7, -1.0 + 1.3)]
    close(st["kl_ref"], sum(k3) / 2)
    close(loss, -1.0 + 0.5 * sum(k3) / 2)
    loss.backward()
    close(lp.grad, [[-0.5, -0.5]])  # the surrogate's −Â·ρ/N, nothing of the KL
    # β·(1 − π_ref/π_θ)/N on the full log-probabilities, nothing of the surrogate
    close(full.grad, [[0.5 * (1 - math.exp(-0.2)) / 2, 0.5 * (1 - math.exp(0.3)) / 2]])
