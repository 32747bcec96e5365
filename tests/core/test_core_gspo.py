"""GSPO and GSPO-token (Zheng et al. 2025, proximal/core/gspo.py): hand-worked float64 values
(expected numbers from plain Python arithmetic, never from the functions under test) at 1e-12, both
advantage signs on both sides of every clip boundary, where the gradient is and is not zero, and the
defining properties of the sequence ratio."""

import math

import pytest
import torch
from f64 import F64, INF, NAN, b, close, t  # tests/core/f64.py

from proximal.core import grpo_policy_loss, gspo_policy_loss

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
