"""PPO policy loss, value loss, entropy (Schulman et al. 2017), PTX loss (Ouyang et al. 2022) and
Bradley–Terry:
hand-worked values, where the gradient is and is not zero, and masking/padding properties."""

import math

import pytest
import torch
import torch.nn.functional as F
from f64 import F64, INF, NAN, b, t  # tests/core/f64.py
from hypothesis import given, settings
from hypothesis import strategies as st

from proximal.core import (
    bradley_terry_loss,
    entropy_from_logits,
    explained_variance,
    ppo_policy_loss,
    ptx_loss,
    value_loss,
)

# ------------------------------------------------------------------------------- policy loss
# ε = 0.2, so the interval is [0.8, 1.2]. One token per case:
#   case  A    r     r·A    clip(r)·A   min     clipped?  (the clipped surrogate's mechanics)
#   0    +2   1.5    3.0    2.4         2.4     yes       A > 0, r > 1 + ε: ceiling, zero gradient
#   1    +2   0.5    1.0    1.6         1.0     no        A > 0, r < 1 − ε: still pushed up
#   2    −2   1.5   −3.0   −2.4        −3.0     no        A < 0, r > 1 + ε: still pushed down
#   3    −2   0.5   −1.0   −1.6        −1.6     yes       A < 0, r < 1 − ε: floor, zero gradient
#   4    +2   1.1    2.2    2.2         2.2     no        inside the interval
#   5    −2   0.9   −1.8   −1.8        −1.8     no        inside the interval
RATIOS = [1.5, 0.5, 1.5, 0.5, 1.1, 0.9]
ADVS = [2.0, 2.0, -2.0, -2.0, 2.0, -2.0]
MINS = [2.4, 1.0, -3.0, -1.6, 2.2, -1.8]
CLIPPED = [True, False, False, True, False, False]


def _policy_inputs():
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.7]])
    new = (old + t([[math.log(r) for r in RATIOS]])).requires_grad_(True)
    return new, old, t([ADVS]), b([[True] * 6])


@pytest.mark.parametrize("i", range(6))
def test_clipped_surrogate_each_case_by_hand(i):
    new, old, adv, mask = _policy_inputs()
    sl = slice(i, i + 1)
    loss, stats = ppo_policy_loss(new[:, sl], old[:, sl], adv[:, sl], mask[:, sl], clip_eps=0.2)
    assert loss.item() == pytest.approx(-MINS[i], abs=1e-12)
    assert stats["clipfrac"].item() == float(CLIPPED[i])


def test_clipped_surrogate_batch_and_stats_by_hand():
    new, old, adv, mask = _policy_inputs()
    loss, stats = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-sum(MINS) / 6, abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(2 / 6, abs=1e-15)
    assert stats["ratio_mean"].item() == pytest.approx(sum(RATIOS) / 6, abs=1e-12)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-12)
    assert stats["ratio_min"].item() == pytest.approx(0.5, abs=1e-12)
    # KL(π_old ‖ π_θ) from samples of π_old: k1 = −log r, k3 = (r − 1) − log r
    assert stats["approx_kl_k1"].item() == pytest.approx(
        sum(-math.log(r) for r in RATIOS) / 6, abs=1e-12
    )
    assert stats["approx_kl"].item() == pytest.approx(
        sum((r - 1) - math.log(r) for r in RATIOS) / 6, abs=1e-12
    )
    assert all(not v.requires_grad for v in stats.values())


def test_policy_gradient_is_zero_exactly_where_clipping_flattens_it():
    new, old, adv, mask = _policy_inputs()
    loss, _ = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    loss.backward()
    grad = new.grad[0].tolist()
    # d(−min)/d log π = −r·A/n on the unclipped branch (n = 6 tokens), exactly 0 on the clipped one
    for g, r, a, clipped in zip(grad, RATIOS, ADVS, CLIPPED):
        if clipped:
            assert g == 0.0
        else:
            assert g == pytest.approx(-r * a / 6, abs=1e-12) and g != 0.0


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    lp = t([[-1.0, -2.0, -3.0]])
    loss, stats = ppo_policy_loss(lp, lp, t([[1.0, -4.0, 0.5]]), b([[True] * 3]))
    assert loss.item() == pytest.approx(-(1.0 - 4.0 + 0.5) / 3, abs=1e-15)
    assert stats["clipfrac"].item() == 0.0 and stats["approx_kl_k1"].item() == 0.0


def test_policy_loss_seq_mean_token_mean_by_hand():
    # row 0: tokens with ratio 1, A = 1 and 3 → row mean of −min = −2; row 1: one token A = −6 → 6
    lp = t([[-1.0, -1.0, NAN], [-2.0, INF, INF]])
    adv = t([[1.0, 3.0, NAN], [-6.0, NAN, 1e300]])
    mask = b([[True, True, False], [True, False, False]])
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2.0 + 6.0) / 2, abs=1e-15)
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation="token-mean")
    assert loss.item() == pytest.approx(-(1.0 + 3.0 - 6.0) / 3, abs=1e-15)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"clip_eps": -0.1}, "clip_eps"),
        ({"clip_eps": NAN}, "clip_eps"),
        ({"aggregation": "sum"}, "'sum'"),
    ],
)
def test_policy_loss_validation(kw, match):
    x = t([[0.0]])
    with pytest.raises(ValueError, match=match):
        ppo_policy_loss(x, x, x, b([[True]]), **kw)


@st.composite
def policy_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    lengths = draw(
        st.lists(st.integers(0, T), min_size=B, max_size=B).filter(lambda ls: sum(ls) > 0)
    )
    eps = draw(st.sampled_from([0.1, 0.2]) | st.floats(0.01, 0.9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    new = old + torch.randn(B, T, generator=g, dtype=F64) * 0.4
    adv = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    garbage = torch.tensor([NAN, INF, -INF, 1e300], dtype=F64)[
        torch.randint(0, 4, (3, B, T), generator=g)
    ]
    return new, old, adv, mask, lengths, eps, garbage


def _policy_loop(new, old, adv, lengths, eps):
    per_row = []
    for n_row, o_row, a_row, n in zip(new, old, adv, lengths):
        terms = []
        for i in range(n):
            r = math.exp(n_row[i] - o_row[i])
            terms.append(-min(r * a_row[i], min(max(r, 1 - eps), 1 + eps) * a_row[i]))
        per_row.append(terms)
    tokens = [x for row in per_row for x in row]
    rows = [sum(row) / len(row) for row in per_row if row]
    return sum(tokens) / len(tokens), sum(rows) / len(rows)


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_policy_loss_matches_loop_ignores_garbage_and_padding(case):
    new, old, adv, mask, lengths, eps, garbage = case
    token_mean, seq_mean = _policy_loop(new.tolist(), old.tolist(), adv.tolist(), lengths, eps)
    for agg, want in (("token-mean", token_mean), ("seq-mean-token-mean", seq_mean)):
        loss, stats = ppo_policy_loss(new, old, adv, mask, clip_eps=eps, aggregation=agg)
        assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
        dirty = [torch.where(mask, x, g) for x, g in zip((new, old, adv), garbage)]
        loss_d, stats_d = ppo_policy_loss(*dirty, mask, clip_eps=eps, aggregation=agg)
        assert torch.equal(loss_d, loss)
        assert all(torch.equal(stats_d[k], stats[k]) for k in stats)
        B = new.shape[0]
        padded = [torch.cat([x, torch.full((B, 3), NAN, dtype=F64)], 1) for x in (new, old, adv)]
        pmask = torch.cat([mask, torch.zeros(B, 3, dtype=torch.bool)], 1)
        loss_p, _ = ppo_policy_loss(*padded, pmask, clip_eps=eps, aggregation=agg)
        assert loss_p.item() == pytest.approx(loss.item(), rel=1e-13, abs=1e-13)


def test_policy_loss_gradient_ignores_nan_at_masked_positions():
    new = t([[-1.0, NAN]], requires_grad=True)
    loss, _ = ppo_policy_loss(new, t([[-1.2, NAN]]), t([[1.0, NAN]]), b([[True, False]]))
    loss.backward()
    assert new.grad[0, 1].item() == 0.0 and math.isfinite(new.grad[0, 0].item())


# -------------------------------------------------------------------------------- value loss
# ε_v = 0.2. Per token: V, V_old, R → V_clip = V_old + clip(V − V_old, ±0.2)
#   0: V 1.0, V_old 0.5, R 2.0 → V_clip 0.7: (1 − 2)² = 1.0,  (0.7 − 2)² = 1.69 → max 1.69 (clipped)
#   1: V 0.0, V_old 0.5, R 0.0 → V_clip 0.3: 0.0,             0.09           → 0.09 (clipped)
#   2: V 2.0, V_old 2.0, R 1.0 → V_clip 2.0: 1.0,             1.0            → 1.0  (tie: not counted)
#   3: V 0.0, V_old 1.0, R 3.0 → V_clip 0.8: 9.0,             4.84           → 9.0  (unclipped)
VALUES, OLD_VALUES, RETURNS = [1.0, 0.0, 2.0, 0.0], [0.5, 0.5, 2.0, 1.0], [2.0, 0.0, 1.0, 3.0]


def test_value_loss_max_by_hand():
    values = t([VALUES], requires_grad=True)
    loss, stats = value_loss(values, t([OLD_VALUES]), t([RETURNS]), b([[True] * 4]), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 1.0 + 9.0) / 4, abs=1e-12)
    assert stats["vf_clipfrac"].item() == 0.5
    # explained variance 1 − Var[R − V]/Var[R] (both ÷n, so the n's cancel)
    res = [r - v for r, v in zip(RETURNS, VALUES)]

    def var(xs):
        return sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)

    assert stats["explained_variance"].item() == pytest.approx(
        1 - var(res) / var(RETURNS), abs=1e-12
    )
    loss.backward()
    # where the clipped error wins, V_clip is constant in V: zero gradient. Otherwise
    # d/dV ½·(V − R)²/n = (V − R)/n (the tie at token 2 has both branches equal to (V − R)/n).
    assert values.grad[0].tolist() == pytest.approx(
        [0.0, 0.0, (2.0 - 1.0) / 4, (0.0 - 3.0) / 4], abs=1e-15
    )
    assert values.grad[0, 0].item() == 0.0 and values.grad[0, 1].item() == 0.0


def test_value_loss_without_clipping_is_half_mse():
    loss, stats = value_loss(
        t([VALUES]), t([OLD_VALUES]), t([RETURNS]), b([[True] * 4]), clip_eps=INF
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0 + 1.0 + 9.0) / 4, abs=1e-12)
    assert stats["vf_clipfrac"].item() == 0.0


def test_explained_variance_by_hand_and_over_two_simulated_ranks(simulate_ranks):
    # Hand values: R = [2, 0, 1, 3], V = [1, 0, 2, 0] → R − V = [1, 0, −1, 3].
    # Var[R] = mean of (0.5², 1.5², 0.5², 1.5²) = 1.25; Var[R − V] = mean of (0.25², 0.75², 1.75², 2.25²) = 2.1875
    mask = b([[True, True], [True, True]])
    values, returns = t([[1.0, 0.0], [2.0, 0.0]]), t([[2.0, 0.0], [1.0, 3.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(
        1 - 2.1875 / 1.25, abs=1e-12
    )
    # Each rank holds one row; with the SUM all-reduce the statistics are those of both rows.
    got = simulate_ranks(
        [
            lambda ar, i=i: explained_variance(
                values[i : i + 1], returns[i : i + 1], mask[i : i + 1], all_reduce=ar
            )
            for i in range(2)
        ]
    )
    assert [g.item() for g in got] == pytest.approx([1 - 2.1875 / 1.25] * 2, abs=1e-12)


def test_value_loss_explained_variance_constant_returns_is_nan():
    _, stats = value_loss(t([[1.0, 2.0]]), t([[1.0, 2.0]]), t([[3.0, 3.0]]), b([[True, True]]))
    assert math.isnan(stats["explained_variance"].item())


def test_value_loss_masking_and_validation():
    v = t([VALUES + [NAN]])
    mask = b([[True] * 4 + [False]])
    loss, _ = value_loss(v, t([OLD_VALUES + [INF]]), t([RETURNS + [-INF]]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 1.0 + 9.0) / 4, abs=1e-12)
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(v, v, v, mask, clip_eps=0.0)


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_value_loss_matches_loop_and_ignores_garbage(case):
    values, old, returns, mask, lengths, eps, garbage = case
    terms = []
    for v_row, o_row, r_row, n in zip(values.tolist(), old.tolist(), returns.tolist(), lengths):
        for i in range(n):
            v_clip = o_row[i] + min(max(v_row[i] - o_row[i], -eps), eps)
            terms.append(0.5 * max((v_row[i] - r_row[i]) ** 2, (v_clip - r_row[i]) ** 2))
    loss, stats = value_loss(values, old, returns, mask, clip_eps=eps)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12, abs=1e-12)
    dirty = [torch.where(mask, x, g) for x, g in zip((values, old, returns), garbage)]
    loss_d, stats_d = value_loss(*dirty, mask, clip_eps=eps)
    assert torch.equal(loss_d, loss)
    assert torch.equal(stats_d["vf_clipfrac"], stats["vf_clipfrac"])


# -------------------------------------------------------------------------------- entropy, PTX


def test_entropy_by_hand():
    # row 0 token 0: uniform over 4 → log 4; token 1: p = (½, ¼, ¼, 0) → 1.5·log 2 (with 0·log 0 = 0)
    # token 2 is padding (NaN logits) and is not read
    logits = t(
        [
            [
                [0.0, 0.0, 0.0, 0.0],
                [math.log(0.5), math.log(0.25), math.log(0.25), -INF],
                [NAN, NAN, NAN, NAN],
            ]
        ],
        requires_grad=True,
    )
    mask = b([[True, True, False]])
    ent = entropy_from_logits(logits, mask)
    assert ent.item() == pytest.approx((math.log(4) + 1.5 * math.log(2)) / 2, abs=1e-12)
    ent.backward()
    assert torch.isfinite(logits.grad[0, :2]).all()
    assert not logits.grad[0, 2].any()
    # uniform logits are a maximum of the entropy: zero gradient there
    assert logits.grad[0, 0].abs().max().item() < 1e-15


def test_entropy_temperature_and_gradient_match_autograd():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64, requires_grad=True)
    mask = torch.arange(5)[None, :] < t([5, 2, 1]).long()[:, None]
    ent = entropy_from_logits(logits, mask, temperature=0.7, chunk_tokens=4)
    ent.backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref_logits / 0.7, -1)
    per_token = -(p * torch.log(p)).sum(-1)
    ref = per_token[mask].mean()
    ref.backward()
    assert ent.item() == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)


def test_entropy_seq_mean_token_mean():
    # row 0: two tokens uniform over 2 (log 2 each) → row mean log 2
    # row 1: uniform over 2 (log 2), then p = (1, 0) (entropy 0) → row mean ½·log 2
    logits = t([[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, -INF]]])
    mask = b([[True, True], [True, True]])
    got = entropy_from_logits(logits, mask, aggregation="seq-mean-token-mean")
    assert got.item() == pytest.approx((math.log(2) + math.log(2) / 2) / 2, abs=1e-15)


def test_ptx_loss_by_hand_and_against_cross_entropy():
    # p = (½, ¼, ¼) at every position; labels 0, 2, then an ignored −100
    logits = t([[[math.log(0.5), math.log(0.25), math.log(0.25)]] * 3])
    labels = torch.tensor([[0, 2, -100]])
    mask = b([[True, True, False]])
    loss = ptx_loss(logits, labels, mask)
    assert loss.item() == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-12)
    # independent implementation: PyTorch's cross-entropy with ignore_index
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 9, generator=g, dtype=F64)
    labels = torch.randint(0, 9, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) < 0.7
    mask[0, 0] = True
    ref = F.cross_entropy(
        logits.reshape(-1, 9), torch.where(mask, labels, -100).reshape(-1), ignore_index=-100
    )
    got = ptx_loss(logits, torch.where(mask, labels, -100), mask, chunk_tokens=5)
    assert got.item() == pytest.approx(ref.item(), abs=1e-12)


def test_ptx_loss_empty_mask_raises():
    with pytest.raises(ValueError, match="no valid"):
        ptx_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), b([[False, False]]))


# ---------------------------------------------------------------------------- Bradley–Terry


def test_bradley_terry_by_hand():
    chosen, rejected = t([2.0, 0.0, -1.0]), t([1.0, 0.5, -1.0])
    gaps = [1.0, -0.5, 0.0]
    loss, stats = bradley_terry_loss(chosen, rejected)
    # −log σ(d) = log(1 + e^{−d})
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-d)) for d in gaps) / 3, abs=1e-12)
    assert stats["accuracy"].item() == pytest.approx(1 / 3, abs=1e-15)  # the tie does not count
    assert stats["score_gap"].item() == pytest.approx(0.5 / 3, abs=1e-15)
    loss_m, stats_m = bradley_terry_loss(chosen, rejected, margin=0.5)
    assert loss_m.item() == pytest.approx(
        sum(math.log1p(math.exp(-(d - 0.5))) for d in gaps) / 3, abs=1e-12
    )
    assert stats_m["accuracy"].item() == stats["accuracy"].item()
    per_pair = t([0.5, 0.0, 1.0])
    loss_v, _ = bradley_terry_loss(chosen, rejected, margin=per_pair)
    want = sum(math.log1p(math.exp(-(d - m))) for d, m in zip(gaps, [0.5, 0.0, 1.0])) / 3
    assert loss_v.item() == pytest.approx(want, abs=1e-12)


def test_bradley_terry_is_minus_log_of_the_preference_probability():
    # P(y_w ≻ y_l) = σ(r_w − r_l) = 1 / (1 + e^{−(r_w − r_l)})
    for rw, rl in ((0.3, -1.2), (-2.0, 1.0), (5.0, 5.0)):
        loss, _ = bradley_terry_loss(t([rw]), t([rl]))
        assert math.exp(-loss.item()) == pytest.approx(1 / (1 + math.exp(-(rw - rl))), rel=1e-12)


def test_bradley_terry_stable_for_huge_gaps_and_gradient():
    loss, _ = bradley_terry_loss(t([-1000.0]), t([0.0]))
    assert loss.item() == pytest.approx(1000.0, rel=1e-12)
    chosen = t([0.3], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, t([-0.2]))
    loss.backward()
    # d/dr_w −log σ(d) = −(1 − σ(d)) = −σ(−d)
    assert chosen.grad.item() == pytest.approx(-1 / (1 + math.exp(0.5)), abs=1e-12)


def test_bradley_terry_shape_validation():
    with pytest.raises(ValueError, match="chosen_scores"):
        bradley_terry_loss(t([1.0, 2.0]), t([1.0]))
