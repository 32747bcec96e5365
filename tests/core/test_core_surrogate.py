"""The clipped surrogate every policy objective is built from (proximal/core/surrogate.py): dual-clip
PPO/GRPO and per-token importance weights by hand (float64, 1e-12), and one set of statistics and
keyword-only ε for every objective."""

import math

import pytest
import torch
from f64 import F64, b, close, t  # tests/core/f64.py

from proximal.core import (
    SURROGATE_STATS,
    cispo_policy_loss,
    clipped_ratio,
    clipped_surrogate_loss,
    grpo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    reference_kl_loss,
)

LOG = math.log


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


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


# ------------------------------------------------------------------ one ratio, one set of stats
def test_clipped_ratio_by_hand():
    lr = t([LOG(0.5), 0.0, LOG(1.5)])
    ratio, clipped = clipped_ratio(lr, clip_eps_low=0.2, clip_eps_high=0.28)
    close(ratio, [0.5, 1.0, 1.5])
    close(clipped, [0.8, 1.0, 1.28])
    _, no_floor = clipped_ratio(lr, clip_eps_low=None, clip_eps_high=0.28)  # CISPO's default
    close(no_floor, [0.5, 1.0, 1.28])


# ε = 0.2 on both sides; one response of four tokens:
#   r     Â    min(r·Â, clip(r)·Â)            min-surrogate clipped?     CISPO: r outside [0.8, 1.2]?
#   1.5   +1   min(1.5, 1.2)   =  1.2        yes, high (zero gradient)   yes, high
#   0.5   −1   min(−0.5, −0.8) = −0.8        yes, low (zero gradient)    yes, low
#   1.1   −1   min(−1.1, −1.1) = −1.1        no                          no
#   0.7   +2   min(1.4, 1.6)   =  1.4        no (unclipped is smaller)   yes, low
ST_R = [1.5, 0.5, 1.1, 0.7]
ST_A = [1.0, -1.0, -1.0, 2.0]


def _stats_batch():
    lp = t([[LOG(r) for r in ST_R]], requires_grad=True)
    return lp, torch.zeros_like(lp), t([ST_A]), b([[1, 1, 1, 1]])


def test_surrogate_stats_by_hand():
    lp, old, adv, mask = _stats_batch()
    loss, st = ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2)
    close(loss, -(1.2 - 0.8 - 1.1 + 1.4) / 4)
    close(st["pg_loss"], -(1.2 - 0.8 - 1.1 + 1.4) / 4)
    close(st["clipfrac_low"], 1 / 4)
    close(st["clipfrac_high"], 1 / 4)
    close(st["clipfrac"], 2 / 4)
    close(st["clipfrac_dual"], 0.0)
    close(st["ratio_mean"], sum(ST_R) / 4)
    close(st["ratio_min"], 0.5)
    close(st["ratio_max"], 1.5)
    close(st["approx_kl_k1"], sum(-LOG(r) for r in ST_R) / 4)
    close(st["approx_kl"], sum(r - 1 - LOG(r) for r in ST_R) / 4)
    close(st["advantage_mean"], sum(ST_A) / 4)
    close(st["advantage_min"], -1.0)
    close(st["advantage_max"], 2.0)
    # CISPO's clip moves a weight wherever r leaves the interval, whatever the sign of Â
    _, cst = cispo_policy_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    close(cst["clipfrac_low"], 2 / 4)
    close(cst["clipfrac_high"], 1 / 4)
    close(cst["clipfrac"], 3 / 4)
    for k in ("ratio_mean", "approx_kl", "approx_kl_k1", "advantage_mean", "advantage_max"):
        close(cst[k], st[k].item())


def test_every_objective_reports_the_same_stats():
    lp, old, adv, mask = _stats_batch()
    ref = lp.detach() - 0.1
    seq_adv = t([1.0])
    eps = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    stats = {
        "ppo": ppo_policy_loss(lp, old, adv, mask, clip_eps=0.2)[1],
        "grpo": grpo_policy_loss(lp, old, ref, adv, mask, beta=0.1, **eps)[1],
        "gspo": gspo_policy_loss(lp, old, seq_adv, mask, **eps)[1],
        "gspo_token": gspo_policy_loss(lp, old, adv, mask, token_level=True, **eps)[1],
        "cispo": cispo_policy_loss(lp, old, adv, mask, **eps)[1],
    }
    for name, st in stats.items():
        extra = {"kl_loss", "kl_ref"} if name == "grpo" else set()
        assert set(st) == set(SURROGATE_STATS) | extra, name


def test_grpo_is_the_surrogate_plus_the_reference_kl_term():
    lp, old, adv, mask = _stats_batch()
    ref = t([[LOG(0.9), LOG(0.6), LOG(1.3), LOG(0.4)]])
    kw = {"aggregation": "seq-mean-token-mean", "clip_eps_high": 0.28}
    loss, st = grpo_policy_loss(lp, old, ref, adv, mask, clip_eps_low=0.2, beta=0.1, **kw)
    pg, _ = clipped_surrogate_loss(lp, old, adv, mask, clip_eps_low=0.2, **kw)
    kl, kl_ref = reference_kl_loss(lp, ref, mask, 0.1, "seq-mean-token-mean")
    assert torch.equal(loss, pg + kl)
    assert torch.equal(st["pg_loss"], pg.detach()) and torch.equal(st["kl_loss"], kl.detach())
    assert torch.equal(st["kl_ref"], kl_ref)


def test_eps_are_keyword_only():
    lp, old, adv, mask = _stats_batch()
    with pytest.raises(TypeError):
        ppo_policy_loss(lp, old, adv, mask, 0.2)
    with pytest.raises(TypeError):
        grpo_policy_loss(lp, old, None, adv, mask, 0.2)
    with pytest.raises(TypeError):
        gspo_policy_loss(lp, old, t([1.0]), mask, 0.2)
    with pytest.raises(TypeError):
        cispo_policy_loss(lp, old, adv, mask, 0.2)


def test_cispo_upper_eps_defaults_to_the_lower():
    lp, old, adv, mask = _stats_batch()
    one, _ = cispo_policy_loss(lp, old, adv, mask, clip_eps_low=0.1)
    both, _ = cispo_policy_loss(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.1)
    assert torch.equal(one, both)
    # r = 1.5 is capped at 1.1 (not at 1.2, say): its term is −1.1·1·log 1.5 / 4
    close(_grad(one, lp)[0, 0], -1.1 * 1.0 / 4)
    with pytest.raises(ValueError, match="clip_eps_high"):
        cispo_policy_loss(lp, old, adv, mask)
