"""The objectives after GRPO (issue 25): GSPO and GSPO-token, CISPO, dual-clip PPO/GRPO, per-token
importance weights, REINFORCE++ (and -baseline) advantages — hand-worked float64 values (expected
numbers from plain Python arithmetic, never from the functions under test) at 1e-12, both advantage
signs on both sides of every clip boundary, where the gradient is and is not zero, and the defining
properties of each objective."""

import math
import statistics

import pytest
import torch
from f64 import F64, INF, NAN, b, close, t  # tests/core/f64.py

from proximal.core import (
    cispo_policy_loss,
    grpo_policy_loss,
    gspo_policy_loss,
    kl_reward_advantages,
    ppo_policy_loss,
    reference_kl_loss,
    reinforce_pp_advantages,
    returns_to_go,
)

LOG = math.log


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# --------------------------------------------------------------------------------------- GSPO
# Interval [1 − ε, 1 + ε_high] = [0.9, 1.2]. Six responses, each a mean log-ratio m_i = log s_i
# spread unevenly over its tokens (old log-probs 0, so the log-ratio is the log-prob itself):
#   s    Â    min(s·Â, clip(s)·Â)        live gradient?
#   1.1  +2   min(2.2, 2.2)  = 2.2        yes (inside)
#   1.3  +2   min(2.6, 2.4)  = 2.4        no  (Â > 0 above 1 + ε_high)
#   0.8  +2   min(1.6, 1.8)  = 1.6        yes (Â > 0 below: unclipped is smaller)
#   0.8  −1   min(−0.8, −0.9) = −0.9      no  (Â < 0 below 1 − ε)
#   1.3  −1   min(−1.3, −1.2) = −1.3      yes (Â < 0 above: unclipped is smaller)
#   1.0  −1   −1                          yes
# plus a seventh row with no valid token, which weighs nothing.
GS_S = [1.1, 1.3, 0.8, 0.8, 1.3, 1.0]
GS_A = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
GS_TERM = [2.2, 2.4, 1.6, -0.9, -1.3, -1.0]
GS_LIVE = [True, False, True, False, True, True]
GS_N = [1, 2, 3, 2, 3, 1]  # valid tokens per row
# how each row's total log-ratio n·m is spread over its tokens (weights summing to 1)
GS_SPLIT = [[1.0], [0.9, 0.1], [-0.5, 1.0, 0.5], [0.5, 0.5], [3.0, -1.0, -1.0], [1.0]]


def _gspo_batch(split=GS_SPLIT):
    T = 3
    lp = torch.zeros(7, T, dtype=F64)
    mask = torch.zeros(7, T, dtype=torch.bool)
    for i, (s, n, w) in enumerate(zip(GS_S, GS_N, split)):
        total = n * LOG(s)
        for j in range(n):
            lp[i, j] = w[j] * total
            mask[i, j] = True
    lp[~mask] = NAN  # never read
    old = torch.where(mask, 0.0, INF).to(F64)
    return lp.requires_grad_(), old, mask


def test_gspo_by_hand_both_signs_both_sides_of_each_clip():
    lp, old, mask = _gspo_batch()
    adv = t(GS_A + [NAN])
    loss, st = gspo_policy_loss(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    close(loss, -sum(GS_TERM) / 6)
    # gradient of a live row i: −Â_i·s_i / (G·n_i) on each of its tokens; 0 where clipped
    g = _grad(loss, lp)
    want = torch.zeros(7, 3, dtype=F64)
    for i in range(6):
        if GS_LIVE[i]:
            want[i, : GS_N[i]] = -GS_A[i] * GS_S[i] / (6 * GS_N[i])
    close(g, want.tolist())
    close(st["clipfrac_high"], 1 / 6)
    close(st["clipfrac_low"], 1 / 6)
    close(st["ratio_mean"], sum(GS_S) / 6)
    close(st["ratio_min"], 0.8)
    close(st["ratio_max"], 1.3)
    close(st["advantage_mean"], sum(GS_A) / 6)
    close(st["pg_loss"], -sum(GS_TERM) / 6)


def test_gspo_ratio_ignores_how_the_log_ratio_is_spread_over_tokens():
    even = [[1 / n] * n for n in GS_N]
    lp1, old, mask = _gspo_batch()
    lp2, _, _ = _gspo_batch(even)
    adv = t(GS_A + [0.0])
    l1, s1 = gspo_policy_loss(lp1, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    l2, s2 = gspo_policy_loss(lp2, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    close(l1, l2.item())
    close(s1["ratio_mean"], float(s2["ratio_mean"]))
    # and the gradient is the same for every token of a response, however it was spread
    close(_grad(l1, lp1), _grad(l2, lp2).tolist())
    # a token ratio (GRPO's) does depend on the spread
    g1, _ = grpo_policy_loss(
        lp1, old, None, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, beta=0.0
    )
    g2, _ = grpo_policy_loss(
        lp2, old, None, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, beta=0.0
    )
    assert abs(g1.item() - g2.item()) > 1e-3


def test_gspo_token_equals_gspo_with_sequence_advantages():
    lp1, old, mask = _gspo_batch()
    lp2, _, _ = _gspo_batch()
    adv = t(GS_A + [0.0])
    l1, _ = gspo_policy_loss(lp1, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    l2, _ = gspo_policy_loss(
        lp2, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, token_level=True
    )
    close(l2, l1.item())
    close(_grad(l2, lp2), _grad(l1, lp1).tolist())


def test_gspo_token_with_token_advantages_by_hand():
    # one response, s = 1.3 (log-ratio spread 0.9/0.1), token advantages +1 and −1: the first token
    # is clipped at 1.2 (no gradient), the second unclipped (−1.3, gradient s·(−Â)/n·1/G = 1.3/2).
    # A second response, s = 0.8, tokens Â = +2, −2, −2: +2 unclipped (1.6 < 1.8), −2 clipped at 0.9.
    lp = t([[0.9 * 2 * LOG(1.3), 0.1 * 2 * LOG(1.3), 0.0], [LOG(0.8)] * 3], requires_grad=True)
    old = torch.zeros_like(lp)
    mask = b([[1, 1, 0], [1, 1, 1]])
    adv = t([[1.0, -1.0, NAN], [2.0, -2.0, -2.0]])
    loss, st = gspo_policy_loss(
        lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, token_level=True
    )
    row0 = (-1.2 + 1.3) / 2
    row1 = (-1.6 + 1.8 + 1.8) / 3
    close(loss, (row0 + row1) / 2)
    close(_grad(loss, lp), [[0.0, 1.3 / 4, 0.0], [-2 * 0.8 / 6, 0.0, 0.0]])
    close(st["clipfrac_high"], (1 / 2 + 0) / 2)
    close(st["clipfrac_low"], (0 + 2 / 3) / 2)


def test_gspo_sequence_weights_and_normalizer_split():
    lp, old, mask = _gspo_batch()
    adv = t(GS_A + [0.0])
    w = t([0.5, 1.0, 2.0, 0.0, 1.5, 1.0, NAN])
    loss, _ = gspo_policy_loss(
        lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2, is_weights=w
    )
    close(loss, -sum(wi * x for wi, x in zip([0.5, 1.0, 2.0, 0.0, 1.5, 1.0], GS_TERM)) / 6)
    # micro-batches with the whole batch's G as normalizer add up to the whole batch's loss
    whole, _ = gspo_policy_loss(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    parts = [
        gspo_policy_loss(
            lp[i], old[i], adv[i], mask[i], clip_eps_low=0.1, clip_eps_high=0.2, normalizer=6
        )[0]
        for i in (slice(0, 2), slice(2, 5), slice(5, 7))
    ]
    close(sum(parts), whole.item())
    with pytest.raises(ValueError, match="\\(B,\\)"):
        gspo_policy_loss(
            lp, old, adv[:, None].expand(7, 3), mask, clip_eps_low=0.1, clip_eps_high=0.2
        )
    with pytest.raises(ValueError, match="clip_eps"):
        gspo_policy_loss(lp, old, adv, mask, clip_eps_low=0.0)
    with pytest.raises(ValueError, match=">= 0"):
        gspo_policy_loss(lp, old, adv, mask, clip_eps_low=0.1, is_weights=-w.nan_to_num())


# -------------------------------------------------------------------------------------- CISPO
# π_old = 0.5 on every token; ratios r on both sides of [1 − ε_low, 1 + ε_high] = [0.9, 1.2]:
#   r     Â    sg[clip(r)]   loss term −clip(r)·Â·log(0.5·r)
#   1.0   +1   1.0
#   1.5   +1   1.2           (a PPO token here has zero gradient; CISPO's is −1.2·Â)
#   0.5   −1   0.9           (PPO: zero gradient; CISPO: −0.9·Â)
#   1.1   −1   1.1
#   1.5   −2   1.2           (PPO: live, Â < 0 above the interval)
CI_R = [1.0, 1.5, 0.5, 1.1, 1.5]
CI_A = [1.0, 1.0, -1.0, -1.0, -2.0]
CI_W = [1.0, 1.2, 0.9, 1.1, 1.2]


def _cispo_batch():
    lp = t([[LOG(0.5 * r) for r in CI_R[:3]], [LOG(0.5 * r) for r in CI_R[3:]] + [NAN]])
    lp.requires_grad_()
    old = t([[LOG(0.5)] * 3, [LOG(0.5)] * 2 + [NAN]])
    mask = b([[1, 1, 1], [1, 1, 0]])
    adv = t([CI_A[:3], CI_A[3:] + [NAN]])
    return lp, old, adv, mask


def test_cispo_by_hand_and_gradient_through_clipped_tokens():
    lp, old, adv, mask = _cispo_batch()
    loss, st = cispo_policy_loss(lp, old, adv, mask, clip_eps_high=0.2, clip_eps_low=0.1)
    close(loss, -sum(w * a * LOG(0.5 * r) for w, a, r in zip(CI_W, CI_A, CI_R)) / 5)
    g = _grad(loss, lp)
    want = [-w * a / 5 for w, a in zip(CI_W, CI_A)]
    close(g, [want[:3], want[3:] + [0.0]])
    assert bool((g[mask] != 0).all())  # no token's gradient is dropped
    close(st["clipfrac_high"], 2 / 5)
    close(st["clipfrac_low"], 1 / 5)
    close(st["ratio_mean"], sum(CI_R) / 5)
    # PPO's clipped surrogate drops the two tokens whose clipped branch wins
    lp2, old2, adv2, mask2 = _cispo_batch()
    ppo, _ = ppo_policy_loss(lp2, old2, adv2, mask2, clip_eps=0.2)
    g_ppo = _grad(ppo, lp2)
    close(g_ppo[0, 1], 0.0)  # r = 1.5 > 1.2 with Â > 0
    close(g_ppo[0, 2], 0.0)  # r = 0.5 < 0.8 with Â < 0
    assert float(g[0, 1]) != 0 and float(g[0, 2]) != 0


def test_cispo_no_lower_clip_weights_and_normalizer():
    lp, old, adv, mask = _cispo_batch()
    loss, st = cispo_policy_loss(
        lp, old, adv, mask, clip_eps_high=0.2
    )  # ε_low None: r = 0.5 keeps weight 0.5
    w = [1.0, 1.2, 0.5, 1.1, 1.2]
    close(loss, -sum(wi * a * LOG(0.5 * r) for wi, a, r in zip(w, CI_A, CI_R)) / 5)
    close(st["clipfrac_low"], 0.0)
    # a large ε_high is accepted (the weight then only caps far-off tokens)
    big, _ = cispo_policy_loss(lp, old, adv, mask, clip_eps_high=5.0)
    close(_grad(big, lp)[0, 1], -1.5 * 1.0 / 5)
    # per-token importance weights multiply each token's term
    iw = t([[2.0, 0.0, 1.0], [0.5, 1.0, NAN]])
    weighted, _ = cispo_policy_loss(
        lp, old, adv, mask, clip_eps_high=0.2, clip_eps_low=0.1, is_weights=iw
    )
    iws = [2.0, 0.0, 1.0, 0.5, 1.0]
    close(
        weighted,
        -sum(v * w * a * LOG(0.5 * r) for v, w, a, r in zip(iws, CI_W, CI_A, CI_R)) / 5,
    )
    # rows as micro-batches with the whole token count add up
    whole, _ = cispo_policy_loss(lp, old, adv, mask, clip_eps_high=0.2, clip_eps_low=0.1)
    parts = [
        cispo_policy_loss(
            lp[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            clip_eps_high=0.2,
            clip_eps_low=0.1,
            normalizer=5,
        )[0]
        for i in range(2)
    ]
    close(sum(parts), whole.item())
    # (B,) advantages broadcast over the tokens
    seq, _ = cispo_policy_loss(lp, old, t([1.0, -1.0]), mask, clip_eps_high=0.2, clip_eps_low=0.1)
    close(seq, -sum(w * a * LOG(0.5 * r) for w, a, r in zip(CI_W, [1, 1, 1, -1, -1], CI_R)) / 5)
    for bad in (dict(clip_eps_high=0.0), dict(clip_eps_high=0.2, clip_eps_low=1.0)):
        with pytest.raises(ValueError):
            cispo_policy_loss(lp, old, adv, mask, **bad)


# ---------------------------------------------------------------------------------- dual-clip
# ε = 0.2, c = 3; ratios r with the token loss ℓ = −min(r·Â, clip(r)·Â), then min(ℓ, c·|Â|) for Â < 0:
#   r    Â    ℓ                           dual       gradient
#   2    −1   max(2, 1.2)   = 2           2 (< 3)    live: r·|Â|
#   4    −1   max(4, 1.2)   = 4           3          0 (bounded)
#   0.5  −1   max(0.5, 0.8) = 0.8         0.8        0 (PPO's lower clip)
#   4    +1   −min(4, 1.2)  = −1.2        −1.2       0 (unchanged: Â > 0)
#   0.5  +1   −min(0.5, 0.8) = −0.5       −0.5       live
#   5    −2   max(10, 2.4)  = 10          6          0
DC_R = [2.0, 4.0, 0.5, 4.0, 0.5, 5.0]
DC_A = [-1.0, -1.0, -1.0, 1.0, 1.0, -2.0]
DC_PLAIN = [2.0, 4.0, 0.8, -1.2, -0.5, 10.0]
DC_DUAL = [2.0, 3.0, 0.8, -1.2, -0.5, 6.0]
DC_GRAD = [-2.0 * -1.0, 0.0, 0.0, 0.0, -0.5 * 1.0, 0.0]  # −r·Â where live


def _dc_batch():
    lp = t([[LOG(r) for r in DC_R]], requires_grad=True)
    return lp, torch.zeros_like(lp), t([DC_A]), b([[1] * 6])


@pytest.mark.parametrize("which", ["ppo", "grpo"])
def test_dual_clip_by_hand(which):
    lp, old, adv, mask = _dc_batch()

    def loss(dual_clip, is_weights=None):
        if which == "ppo":
            return ppo_policy_loss(
                lp, old, adv, mask, clip_eps=0.2, dual_clip=dual_clip, is_weights=is_weights
            )
        return grpo_policy_loss(
            lp,
            old,
            None,
            adv,
            mask,
            clip_eps_low=0.2,
            beta=0.0,
            aggregation="token-mean",
            dual_clip=dual_clip,
            is_weights=is_weights,
        )

    plain, st0 = loss(None)
    close(plain, sum(DC_PLAIN) / 6)
    close(st0["clipfrac_dual"], 0.0)
    dual, st = loss(3.0)
    close(dual, sum(DC_DUAL) / 6)
    close(st["clipfrac_dual"], 2 / 6)
    close(_grad(dual, lp), [[g / 6 for g in DC_GRAD]])
    # the per-token weights multiply the dual-clipped term
    w = [1.0, 2.0, 0.5, 1.0, 3.0, 0.0]
    weighted, _ = loss(3.0, t([w]))
    close(weighted, sum(wi * x for wi, x in zip(w, DC_DUAL)) / 6)
    with pytest.raises(ValueError, match="dual_clip"):
        loss(1.0)


def test_dual_clip_bounds_negative_advantages_and_leaves_positive_ones():
    # per-token losses (seq-mean over one-token rows = each row's own term), random ratios up to e^9
    torch.manual_seed(0)
    lp = torch.randn(256, 1, dtype=F64) * 3
    adv = torch.randn(256, 1, dtype=F64)
    mask = torch.ones(256, 1, dtype=torch.bool)
    old = torch.zeros_like(lp)

    def per_token(**kw):
        loss, _ = grpo_policy_loss(
            lp, old, None, adv, mask, clip_eps_low=0.2, beta=0.0, aggregation="token-mean", **kw
        )
        return loss

    terms = []
    for i in range(256):
        row = slice(i, i + 1)
        d = ppo_policy_loss(lp[row], old[row], adv[row], mask[row], clip_eps=0.2, dual_clip=3.0)[0]
        p = ppo_policy_loss(lp[row], old[row], adv[row], mask[row], clip_eps=0.2)[0]
        a = float(adv[i, 0])
        if a < 0:
            assert float(d) <= 3.0 * abs(a)
            assert float(d) == min(float(p), 3.0 * abs(a))
        else:
            assert float(d) == float(p)
        terms.append(float(d))
    assert sum(float(adv[i, 0]) < 0 and float(lp[i, 0]) > LOG(3) for i in range(256)) > 10
    close(per_token(dual_clip=3.0), sum(terms) / 256)


def test_grpo_is_weights_leave_the_kl_term_alone():
    lp = t([[LOG(1.1), LOG(0.7)]], requires_grad=True)
    old = torch.zeros_like(lp)
    ref = t([[LOG(1.1) - 0.5, LOG(0.7) + 0.25]])
    adv = t([1.0])
    mask = b([[1, 1]])
    loss, st = grpo_policy_loss(
        lp, old, ref, adv, mask, clip_eps_low=0.2, beta=0.1, is_weights=t([[0.0, 0.0]])
    )
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731  (d = ref − logπ)
    close(loss, 0.1 * (k3(-0.5) + k3(0.25)) / 2)
    close(st["pg_loss"], 0.0)


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


def test_reference_kl_loss_by_hand():
    lp = t([[LOG(0.5), LOG(0.25)], [LOG(0.1), NAN]], requires_grad=True)
    ref = t([[LOG(0.25), LOG(0.25)], [LOG(0.2), NAN]])
    mask = b([[1, 1], [1, 0]])
    k3 = lambda p, q: q / p - LOG(q / p) - 1  # noqa: E731
    ks = [k3(0.5, 0.25), 0.0, k3(0.1, 0.2)]
    loss, mean = reference_kl_loss(lp, ref, mask, 0.1, "token-mean")
    close(loss, 0.1 * sum(ks) / 3)
    close(mean, sum(ks) / 3)
    seq, _ = reference_kl_loss(lp, ref, mask, 0.1, "seq-mean-token-mean")
    close(seq, 0.1 * ((ks[0] + ks[1]) / 2 + ks[2]) / 2)
    assert not torch.isnan(_grad(loss, lp)).any()
