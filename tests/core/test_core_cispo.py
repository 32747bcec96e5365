"""CISPO (MiniMax-M1 2025, proximal/core/cispo.py): hand-worked float64 values at 1e-12, the
gradient through clipped tokens (which PPO's surrogate drops), the weights and the normaliser."""

import math

import pytest
import torch
from f64 import NAN, b, close, t  # tests/core/f64.py

from proximal.core import cispo_policy_loss, ppo_policy_loss

LOG = math.log


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


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
