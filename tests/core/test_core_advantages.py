"""Shaped rewards (Ziegler et al. 2019), GAE (Schulman et al. 2015) and whitening: hand-worked values,
the λ = 0 and λ = 1 limits, and properties (loop vs vectorised, garbage at masked positions,
right-padding, holes)."""

import inspect
import math
import statistics

import pytest
import torch
from f64 import F64, INF, NAN, b, close, t  # tests/core/f64.py
from hypothesis import given, settings
from hypothesis import strategies as st

from proximal.core import (
    gae,
    kl_reward_advantages,
    last_valid_index,
    reinforce_pp_advantages,
    returns_to_go,
    shape_rewards,
    whiten,
)

# ------------------------------------------------------------------------------ shape_rewards


def test_shape_rewards_hand_values_score_on_eos_not_pad():
    # row 0: 3 real tokens (the third is EOS) then one pad; row 1: 4 real tokens (length limit)
    mask = b([[True, True, True, False], [True, True, True, True]])
    logp = t([[-1.0, -2.0, -0.5, NAN], [-0.2, -0.3, -0.4, -0.1]])
    ref = t([[-1.5, -1.0, -0.5, INF], [-0.2, -0.1, -0.4, -0.6]])
    scores = t([2.0, -1.0])
    rewards, kl = shape_rewards(scores, logp, ref, mask, beta=0.1)
    # k1 = logp − ref: row 0 [0.5, −1.0, 0.0], row 1 [0.0, −0.2, 0.0, 0.5]
    close(kl, [[0.5, -1.0, 0.0, 0.0], [0.0, -0.2, 0.0, 0.5]], 1e-15)
    # R_t = −β·k1, plus the score at the last valid token (col 2 of row 0 — the EOS, not the pad)
    close(rewards, [[-0.05, 0.1, 0.0 + 2.0, 0.0], [0.0, 0.02, 0.0, -0.05 - 1.0]], 1e-15)


def test_shape_rewards_other_estimator_and_zero_beta():
    mask = b([[True, True]])
    logp, ref = t([[math.log(0.5), math.log(0.2)]]), t([[math.log(0.25), math.log(0.6)]])
    rewards, kl = shape_rewards(t([1.5]), logp, ref, mask, beta=0.5, estimator="k3")
    k3 = [(0.5 - 1) + math.log(2.0), (3 - 1) - math.log(3.0)]
    close(kl, [k3], 1e-12)
    close(rewards, [[-0.5 * k3[0], -0.5 * k3[1] + 1.5]], 1e-12)
    rewards, _ = shape_rewards(t([1.5]), logp, ref, mask, beta=0.0)
    close(rewards, [[0.0, 1.5]], 0)


def test_shape_rewards_row_without_tokens_raises():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        shape_rewards(
            t([1.0, 2.0]),
            t([[0.0, 0.0]] * 2),
            t([[0.0, 0.0]] * 2),
            b([[True, False], [False, False]]),
            beta=0.1,
        )


def test_last_valid_index():
    mask = b([[True, True, False], [False, False, False], [True, False, True]])
    assert last_valid_index(mask).tolist() == [1, -1, 2]


# ---------------------------------------------------------------------------------------- GAE

R3, V3 = [1.0, 0.5, 2.0], [0.4, 0.3, 0.8]


def test_gae_defaults_are_gamma_one_lambda_095():
    params = inspect.signature(gae).parameters
    assert params["gamma"].default == 1.0 and params["lam"].default == 0.95


def test_gae_lambda_zero_is_td_residual():
    mask = b([[True, True, True]])
    # γ = 0.9: δ_t = R_t + 0.9·V_{t+1} − V_t with V_3 ≡ 0
    adv, ret = gae(t([R3]), t([V3]), mask, gamma=0.9, lam=0.0)
    close(adv, [[1.0 + 0.9 * 0.3 - 0.4, 0.5 + 0.9 * 0.8 - 0.3, 2.0 - 0.8]])  # [0.87, 0.92, 1.2]
    close(ret, [[0.87 + 0.4, 0.92 + 0.3, 1.2 + 0.8]])
    # γ = 1 (the usual default)
    adv, _ = gae(t([R3]), t([V3]), mask, gamma=1.0, lam=0.0)
    close(adv, [[1.0 + 0.3 - 0.4, 0.5 + 0.8 - 0.3, 2.0 - 0.8]])


def test_gae_lambda_one_is_monte_carlo_return_minus_baseline():
    adv, ret = gae(t([R3]), t([V3]), b([[True, True, True]]), gamma=1.0, lam=1.0)
    # Σ_{l ≥ 0} R_{t+l} − V_t: returns-to-go 3.5, 2.5, 2.0
    close(adv, [[3.5 - 0.4, 2.5 - 0.3, 2.0 - 0.8]])
    close(ret, [[3.5, 2.5, 2.0]])  # the returns are the Monte-Carlo returns themselves


def test_gae_three_tokens_by_hand():
    # γ = 0.9, λ = 0.8, γλ = 0.72; R = [0.5, −1, 2], V = [1, 0.5, −0.5]
    # δ_2 = 2 + 0 − (−0.5)          = 2.5
    # δ_1 = −1 + 0.9·(−0.5) − 0.5   = −1.95
    # δ_0 = 0.5 + 0.9·0.5 − 1       = −0.05
    # Â_2 = 2.5
    # Â_1 = −1.95 + 0.72·2.5        = −0.15
    # Â_0 = −0.05 + 0.72·(−0.15)    = −0.158
    adv, ret = gae(
        t([[0.5, -1.0, 2.0]]), t([[1.0, 0.5, -0.5]]), b([[True] * 3]), gamma=0.9, lam=0.8
    )
    close(adv, [[-0.158, -0.15, 2.5]])
    close(ret, [[-0.158 + 1.0, -0.15 + 0.5, 2.5 - 0.5]])


def test_gae_right_padded_rows_of_different_lengths():
    rewards = t([[1.0, 0.5, NAN], [1.0, 0.5, 2.0]])
    values = t([[0.4, 0.3, INF], [0.4, 0.3, 0.8]])
    mask = b([[True, True, False], [True, True, True]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # row 0 ends after 2 tokens: V(s_3) ≡ 0, so Â = [1.5 − 0.4, 0.5 − 0.3]; zeros at the pad
    close(adv, [[1.1, 0.2, 0.0], [3.1, 2.2, 1.2]])
    close(ret, [[1.5, 0.5, 0.0], [3.5, 2.5, 2.0]])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lam": 1.5}, "lam"),
        ({"lam": -0.1}, "lam"),
        ({"gamma": 1.01}, "gamma"),
        ({"lam": NAN}, "lam"),
    ],
)
def test_gae_validates_gamma_lambda(kw, match):
    with pytest.raises(ValueError, match=match):
        gae(t([[1.0]]), t([[0.0]]), b([[True]]), **kw)


def _gae_loop(rewards, values, lengths, gamma, lam):
    """GAE's sum form Â_t = Σ_{l=0}^{n−t−1} (γλ)^l δ_{t+l}, one row and one token at a time."""
    out = []
    for r, v, n in zip(rewards, values, lengths):
        delta = [r[i] + gamma * (v[i + 1] if i + 1 < n else 0.0) - v[i] for i in range(n)]
        adv = [sum((gamma * lam) ** k * delta[i + k] for k in range(n - i)) for i in range(n)]
        out.append(adv + [0.0] * (len(r) - n))
    return out


@st.composite
def rollouts(draw, min_len=0):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(min_len, T), min_size=B, max_size=B))
    gamma = draw(st.sampled_from([1.0, 0.0, 0.5, 0.99]) | st.floats(0, 1))
    lam = draw(st.sampled_from([0.95, 0.0, 1.0]) | st.floats(0, 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    garbage = torch.tensor([NAN, INF, -INF, 1e300], dtype=F64)[
        torch.randint(0, 4, (2, B, T), generator=g)
    ]
    return rewards, values, mask, lengths, gamma, lam, garbage


@settings(max_examples=50, deadline=None)
@given(rollouts())
def test_gae_matches_per_element_loop(case):
    rewards, values, mask, lengths, gamma, lam, _ = case
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    want = t(_gae_loop(rewards.tolist(), values.tolist(), lengths, gamma, lam))
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, want + values, 0.0), rtol=1e-12, atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(rollouts())
def test_gae_ignores_garbage_at_masked_positions(case):
    rewards, values, mask, _, gamma, lam, garbage = case
    clean = gae(rewards, values, mask, gamma=gamma, lam=lam)
    dirty = gae(
        torch.where(mask, rewards, garbage[0]),
        torch.where(mask, values, garbage[1]),
        mask,
        gamma=gamma,
        lam=lam,
    )
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@settings(max_examples=50, deadline=None)
@given(rollouts(), st.integers(1, 4))
def test_gae_right_padding_changes_nothing(case, extra):
    rewards, values, mask, _, gamma, lam, _ = case
    B, T = rewards.shape

    def pad(x, fill):
        return torch.cat([x, torch.full((B, extra), fill, dtype=x.dtype)], dim=1)

    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    adv_p, ret_p = gae(pad(rewards, NAN), pad(values, INF), pad(mask, False), gamma=gamma, lam=lam)
    assert torch.equal(adv_p[:, :T], adv) and torch.equal(ret_p[:, :T], ret)
    assert torch.equal(adv_p[:, T:], torch.zeros(B, extra, dtype=F64))


@settings(max_examples=50, deadline=None)
@given(rollouts(), st.integers(0, 2**31 - 1))
def test_gae_skips_holes_in_the_mask(case, seed):
    # Masked columns inserted anywhere (e.g. tool output) are not steps: same result as without them.
    rewards, values, mask, _, gamma, lam, _ = case
    B, T = rewards.shape
    g = torch.Generator().manual_seed(seed)
    holes = torch.rand(T, generator=g) < 0.4  # insert one masked column before these positions
    cols = []
    for i in range(T):
        if holes[i]:
            cols.append(None)
        cols.append(i)
    idx = torch.tensor([c if c is not None else 0 for c in cols])
    is_hole = torch.tensor([c is None for c in cols])

    def widen(x, fill):
        return torch.where(is_hole, torch.full_like(x[:, idx], fill), x[:, idx])

    adv_h, ret_h = gae(
        widen(rewards, NAN), widen(values, -INF), widen(mask, False), gamma=gamma, lam=lam
    )
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    assert torch.equal(adv_h[:, ~is_hole], adv) and torch.equal(ret_h[:, ~is_hole], ret)
    assert not adv_h[:, is_hole].any()


# ------------------------------------------------------------------------------------- whiten


def test_whiten_hand_values():
    x = t([[1.0, 2.0, NAN], [3.0, INF, 4.0]])
    m = b([[True, True, False], [True, False, True]])
    # μ = 2.5, σ² = 1.25 (biased: deviations² 2.25 + 0.25 + 0.25 + 2.25 = 5, over 4), σ = √1.25;
    # docs/formulas.md's (x − μ)/(σ + ε_norm)
    sd = math.sqrt(1.25)
    s = sd + 1e-8
    close(whiten(x, m), [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]])
    close(
        whiten(x, m, keep_mean=True),
        [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.0], [0.5 / s + 2.5, 0.0, 1.5 / s + 2.5]],
    )
    e = sd + 0.5  # ε is added to σ, not to σ²
    close(whiten(x, m, eps=0.5), [[-1.5 / e, -0.5 / e, 0.0], [0.5 / e, 0.0, 1.5 / e]])


def test_whiten_constant_input_gives_zeros_not_nan():
    out = whiten(t([[3.0, 3.0, 3.0]]), b([[True, True, True]]))
    close(out, [[0.0, 0.0, 0.0]], 0)


def test_whiten_empty_mask_raises():
    with pytest.raises(ValueError, match="no valid"):
        whiten(t([[1.0, 2.0]]), b([[False, False]]))


@settings(max_examples=50, deadline=None)
@given(rollouts(min_len=1))
def test_whiten_zero_mean_unit_population_variance_and_ignores_garbage(case):
    x, _, mask, _, _, _, garbage = case
    n = int(mask.sum())
    assert torch.equal(whiten(torch.where(mask, x, garbage[0]), mask), whiten(x, mask))
    assert not whiten(x, mask)[~mask].any()
    if n == 1:  # σ = 0: the single token whitens to 0
        assert not whiten(x, mask).any()
        return
    vals = whiten(x, mask, eps=0.0)[mask].tolist()
    assert abs(sum(vals) / n) < 1e-12
    assert sum(v * v for v in vals) / n == pytest.approx(1.0, abs=1e-10)  # ÷n variance → exactly 1


@pytest.mark.parametrize("keep_mean", [False, True])
def test_whiten_over_two_simulated_ranks_equals_full_batch(simulate_ranks, keep_mean):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g, dtype=F64) * 2 + 3
    mask = torch.arange(6)[None, :] < torch.randint(1, 7, (8,), generator=g)[:, None]
    full = whiten(x, mask, keep_mean=keep_mean)
    halves = [(x[:4], mask[:4]), (x[4:], mask[4:])]
    got = simulate_ranks(
        [lambda ar, h=h: whiten(*h, keep_mean=keep_mean, all_reduce=ar) for h in halves]
    )
    torch.testing.assert_close(torch.cat(got), full, rtol=0, atol=1e-12)
    # and a local whiten of one half is different (the statistics really are global)
    assert not torch.allclose(whiten(*halves[0], keep_mean=keep_mean), full[:4])


# ------------------------------------------------------------------------------- REINFORCE++
def _pstd(xs):
    return statistics.pstdev(xs)


def test_returns_to_go_by_hand_with_a_hole():
    r = t([[1.0, NAN, 2.0, 4.0], [3.0, 5.0, NAN, NAN]])
    mask = b([[1, 0, 1, 1], [1, 1, 0, 0]])
    # γ = 0.5; the hole is not a step: G_0 = 1 + 0.5·(2 + 0.5·4)
    close(
        returns_to_go(r, mask, 0.5), [[1 + 0.5 * 4.0, 0.0, 2 + 0.5 * 4, 4.0], [5.5, 5.0, 0.0, 0.0]]
    )


def test_reinforce_pp_beta_zero_is_the_whitened_score_on_every_token():
    scores = t([1.0, 0.0, 3.0])
    mask = b([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    kl = torch.full((3, 3), NAN, dtype=F64)
    got = reinforce_pp_advantages(scores, kl, mask, beta=0.0)
    vals = [1.0, 1.0, 0.0, 3.0, 3.0, 3.0]  # the score on each valid token
    mu, sd = statistics.fmean(vals), _pstd(vals)
    z = lambda v: (v - mu) / (sd + 1e-8)  # noqa: E731
    close(got, [[z(1), z(1), 0.0], [z(0), 0.0, 0.0], [z(3), z(3), z(3)]])


def test_reinforce_pp_kl_in_the_reward_and_discount_by_hand():
    scores = t([1.0, -1.0])
    kl = t([[0.2, 0.4, NAN], [0.1, -0.3, 0.5]])
    mask = b([[1, 1, 0], [1, 1, 1]])
    beta, g = 0.5, 0.9
    # rewards: row 0: [−0.1, −0.2 + 1]; row 1: [−0.05, 0.15, −0.25 − 1]
    r0 = [-0.1, -0.2 + 1.0]
    r1 = [-0.05, 0.15, -0.25 - 1.0]
    G0 = [r0[0] + g * r0[1], r0[1]]
    G1 = [r1[0] + g * (r1[1] + g * r1[2]), r1[1] + g * r1[2], r1[2]]
    vals = G0 + G1
    mu, sd = statistics.fmean(vals), _pstd(vals)
    z = [(v - mu) / (sd + 1e-8) for v in vals]
    got = reinforce_pp_advantages(scores, kl, mask, beta, gamma=g)
    close(got, [[z[0], z[1], 0.0], z[2:]])


def test_reinforce_pp_baseline_is_group_centring_then_batch_whitening():
    # groups of 2: [4, 2] (mean 3) and [1, 1] (mean 1); an invalid fifth/sixth group member excluded
    scores = t([4.0, 2.0, 1.0, 1.0, 7.0, NAN])
    valid = b([1, 1, 1, 1, 1, 0])
    mask = b([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])
    kl = torch.zeros(6, 2, dtype=F64)
    got = reinforce_pp_advantages(scores, kl, mask, 0.0, baseline=True, group_size=2, valid=valid)
    # third group [7, invalid]: mean over its one valid row is 7 → centred 0
    centred = [1.0, -1.0, 0.0, 0.0, 0.0]
    tok = [centred[0]] * 2 + [centred[1]] + [centred[2]] * 2 + [centred[3]] + [centred[4]] * 2
    mu, sd = statistics.fmean(tok), _pstd(tok)
    z = lambda v: (v - mu) / (sd + 1e-8)  # noqa: E731
    close(
        got,
        [[z(1), z(1)], [z(-1), 0.0], [z(0), z(0)], [z(0), 0.0], [z(0), z(0)], [0.0, 0.0]],
    )
    with pytest.raises(ValueError, match="group_size"):
        reinforce_pp_advantages(scores, kl, mask, 0.0, baseline=True, valid=valid)
    with pytest.raises(ValueError, match="no valid response token"):
        reinforce_pp_advantages(t([1.0]), t([[0.0]]), b([[0]]), 0.0)


def test_kl_reward_advantages_by_hand():
    adv = t([1.5, -0.5])
    kl = t([[0.2, 0.4, NAN], [0.1, NAN, 0.3]])
    mask = b([[1, 1, 0], [1, 0, 1]])
    close(
        kl_reward_advantages(adv, kl, mask, 0.5),
        [[1.5 - 0.5 * 0.6, 1.5 - 0.5 * 0.4, 0.0], [-0.5 - 0.5 * 0.4, 0.0, -0.5 - 0.5 * 0.3]],
    )
