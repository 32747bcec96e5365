"""On-policy distillation's objectives: the reverse-KL per-token advantage and the generalised JSD
(hand values in float64, the β = 0 / β = 1 ends, chunked against unchunked, teacher = student)."""

import math

import pytest
import torch
from f64 import F64, b, close, t  # tests/core/f64.py

from proximal.core import generalized_jsd, linear_generalized_jsd, reverse_kl_advantages

L = math.log


# ----------------------------------------------------------------------------------------------
# reverse_kl_advantages
# ----------------------------------------------------------------------------------------------


def test_reverse_kl_advantage_hand_values_per_token():
    # row 0: π_s = 0.5, 0.2, π_t = 0.25, 0.6 → A = log π_t − log π_s = −log 2, log 3; row 1's
    # second token is masked (its NaN is never read)
    s = t([[L(0.5), L(0.2)], [L(0.1), math.nan]])
    te = t([[L(0.25), L(0.6)], [L(0.4), 7.0]])
    got = reverse_kl_advantages(s, te, b([[True, True], [True, False]]))
    close(got, [[-L(2.0), L(3.0)], [L(4.0), 0.0]])


def test_reverse_kl_advantage_discounted_sums_the_future_rewards():
    # r = (1, 2, ·, 4) with position 2 masked: A_3 = 4, A_1 = 2 + γ·4, A_0 = 1 + γ·2 + γ²·4
    s = t([[0.0, 0.0, 0.0, 0.0]])
    te = t([[1.0, 2.0, 9.0, 4.0]])
    got = reverse_kl_advantages(s, te, b([[True, True, False, True]]), discount=0.5)
    close(got, [[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 0.0, 4.0]])


def test_reverse_kl_advantage_is_a_constant_and_zero_when_teacher_is_student():
    s = t([[-1.5, -0.25]], requires_grad=True)
    got = reverse_kl_advantages(s, s, b([[True, True]]))
    assert not got.requires_grad
    assert torch.equal(got, torch.zeros_like(got))


def test_reverse_kl_advantage_rejects_a_discount_out_of_range():
    with pytest.raises(ValueError, match="discount must be in"):
        reverse_kl_advantages(t([[0.0]]), t([[0.0]]), b([[True]]), discount=1.5)


# ----------------------------------------------------------------------------------------------
# generalized_jsd: hand values
# ----------------------------------------------------------------------------------------------

# p_s = (1/2, 1/2) and p_t = (1/4, 3/4), from logits (log-probabilities are logits)
PS, PT = (0.5, 0.5), (0.25, 0.75)


def _kl(p, q):
    return sum(a * L(a / c) for a, c in zip(p, q, strict=True))


def _one(beta, temperature=1.0, reduction="mean"):
    zs = t([[[L(PS[0]), L(PS[1])]]])
    zt = t([[[L(PT[0]), L(PT[1])]]])
    return generalized_jsd(zs, zt, b([[True]]), beta, temperature, reduction=reduction)[0]


def test_jsd_half_hand_value():
    # m = β·p_t + (1 − β)·p_s = (3/8, 5/8)
    want = 0.5 * (0.25 * L(0.25 / 0.375) + 0.75 * L(0.75 / 0.625)) + 0.5 * (
        0.5 * L(0.5 / 0.375) + 0.5 * L(0.5 / 0.625)
    )
    close(_one(0.5), want)


def test_jsd_beta_weights_the_mixture_toward_the_teacher():
    # β = 0.9: m = 0.9·p_t + 0.1·p_s = (0.275, 0.725)
    m = (0.275, 0.725)
    want = 0.9 * _kl(PT, m) + 0.1 * _kl(PS, m)
    close(_one(0.9), want)


def test_jsd_ends_are_the_forward_and_the_reverse_kl():
    close(_one(0.0), _kl(PT, PS))  # KL(teacher ‖ student)
    close(_one(1.0), _kl(PS, PT))  # KL(student ‖ teacher)
    # the formula itself tends to 0 at both ends: its value just inside is far below the KL
    assert _one(1e-9).item() < 1e-8 and _one(1 - 1e-9).item() < 1e-8


def test_jsd_temperature_divides_both_logits_without_a_tau_squared_factor():
    # logits z_s = (0, 2), z_t = (0, −2) at τ = 2 are softmax((0, 1)) and softmax((0, −1))
    ps = (1 / (1 + math.e), math.e / (1 + math.e))
    pt = (math.e / (1 + math.e), 1 / (1 + math.e))
    zs, zt = t([[[0.0, 2.0]]]), t([[[0.0, -2.0]]])
    got, _ = generalized_jsd(zs, zt, b([[True]]), 1.0, 2.0)
    close(got, _kl(ps, pt))


def test_jsd_sum_and_mean_over_valid_tokens_and_masked_rows_never_read():
    # two valid tokens (the hand pair, then equal distributions: 0) and a masked NaN row
    zs = t([[[L(0.5), L(0.5)], [0.0, 1.0], [math.nan, math.nan]]], requires_grad=True)
    zt = t([[[L(0.25), L(0.75)], [0.0, 1.0], [math.nan, 3.0]]])
    mask = b([[True, True, False]])
    one = _kl(PS, PT)
    got_sum, _ = generalized_jsd(zs, zt, mask, 1.0, reduction="sum")
    got_mean, stats = generalized_jsd(zs, zt, mask, 1.0, reduction="mean")
    close(got_sum, one)
    close(got_mean, one / 2)  # ÷ 2 valid tokens: TRL's batchmean with labels
    close(stats["jsd_token_mean"], one / 2)
    got_mean.backward()
    assert torch.equal(zs.grad[0, 2], torch.zeros(2, dtype=F64))
    assert torch.isfinite(zs.grad).all()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_gradient_equals_autograd_of_the_plain_formula(beta):
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(2, 3, 7, generator=g, dtype=F64, requires_grad=True)
    zt = torch.randn(2, 3, 7, generator=g, dtype=F64)
    mask = b([[True, False, True], [True, True, False]])
    tau = 0.7
    loss, _ = generalized_jsd(zs, zt, mask, beta, tau, reduction="sum")
    (got,) = torch.autograd.grad(loss, zs)
    # the same quantity written out with torch's autograd, the mixture by logsumexp (TRL's form)
    ref = zs.detach().clone().requires_grad_(True)
    ls, lt = torch.log_softmax(ref / tau, -1), torch.log_softmax(zt / tau, -1)
    if beta == 0.0:
        per = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        per = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([ls + L(1 - beta), lt + L(beta)]), 0)
        per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    want_loss = per[mask].sum()
    (want,) = torch.autograd.grad(want_loss, ref)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_equal_to_student_gives_exactly_zero_loss_and_gradient(beta):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 4, 11, generator=g)
    zs = z.clone().requires_grad_(True)
    loss, _ = generalized_jsd(zs, z.clone(), torch.ones(2, 4, dtype=torch.bool), beta, 0.9)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(zs.grad, torch.zeros_like(zs))
    # and from hidden states
    h = torch.randn(2, 4, 5, generator=g)
    w = torch.randn(11, 5, generator=g)
    hs, ws = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _ = linear_generalized_jsd(hs, ws, h, w, torch.ones(2, 4, dtype=torch.bool), beta, 0.9)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hs.grad, torch.zeros_like(hs))
    assert torch.equal(ws.grad, torch.zeros_like(ws))


def test_jsd_rejects_a_different_vocabulary_and_beta_out_of_range():
    z = torch.zeros(1, 1, 4)
    m = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="share the student's vocabulary"):
        generalized_jsd(z, torch.zeros(1, 1, 5), m)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(z, z, m, beta=1.5)
    with pytest.raises(ValueError, match="share the student's tokenizer"):
        linear_generalized_jsd(
            torch.zeros(1, 1, 2), torch.zeros(4, 2), z[..., :2], torch.zeros(5, 2), m
        )


# ----------------------------------------------------------------------------------------------
# chunked (from hidden states) against unchunked (from logits)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_from_hidden_states_equals_the_logits_path_at_a_real_vocabulary(beta):
    V, H = 151_936, 8
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(1, 5, H, generator=g)
    ht = torch.randn(1, 5, H, generator=g)
    ws = torch.randn(V, H, generator=g) * 0.5
    wt = torch.randn(V, H, generator=g) * 0.5
    mask = b([[True, True, False, True, True]])
    a_h, a_w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    # 2 positions per chunk (2·V elements): three chunks over the four valid positions
    got, _ = linear_generalized_jsd(a_h, a_w, ht, wt, mask, beta, 1.3, chunk_elements=2 * V)
    got.backward()
    b_h, b_w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    want, _ = generalized_jsd(b_h @ b_w.T, ht @ wt.T, mask, beta, 1.3)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_h.grad, b_h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a_w.grad, b_w.grad, rtol=1e-4, atol=1e-7)
