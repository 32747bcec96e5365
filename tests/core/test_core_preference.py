"""DPO (sigmoid, robust, IPO), SimPO, sequence log-probabilities and the exact token KL, by hand in float64.

Expected values are written out with ``math`` from the papers' equations, never with the functions
under test: softplus(−h) = −log σ(h), and σ(−h) for DPO's gradient (Rafailov et al. 2023, §4).
"""

import math

import pytest
import torch

from proximal.core import DPO_LOSS_TYPES, dpo_loss, sequence_logprobs, simpo_loss, token_kl

F64 = torch.float64
TOL = 1e-9


def t(x, grad=False):
    return torch.tensor(x, dtype=F64, requires_grad=grad)


def softplus(x: float) -> float:  # −log σ(−x)
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Three pairs: (log π_θ(y_w), log π_θ(y_l), log π_ref(y_w), log π_ref(y_l)).
PAIRS = [(-3.0, -5.0, -4.0, -4.5), (-10.0, -6.0, -9.0, -7.0), (-2.0, -2.5, -2.0, -2.5)]
#        gap/β = (1) − (−0.5) = 1.5   (−1) − (1) = −2          0 − 0 = 0 (a tie: π_θ = π_ref)
GAPS = [(pw - rw) - (pl - rl) for pw, pl, rw, rl in PAIRS]


def _inputs(grad=False):
    cols = list(zip(*PAIRS))
    return t(cols[0], grad), t(cols[1], grad), t(cols[2]), t(cols[3])


def _hand_dpo(loss_type: str, beta: float, eps: float = 0.0) -> list[float]:
    out = []
    for g in GAPS:
        h = beta * g
        if loss_type == "sigmoid":
            out.append((1 - eps) * softplus(-h) + eps * softplus(h))
        elif loss_type == "robust":
            out.append(((1 - eps) * softplus(-h) - eps * softplus(h)) / (1 - 2 * eps))
        else:
            out.append((g - 1 / (2 * beta)) ** 2)
    return out


def test_gaps_are_as_written():
    assert GAPS == [1.5, -2.0, 0.0]


@pytest.mark.parametrize(
    "loss_type,eps",
    [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.0), ("robust", 0.2), ("ipo", 0.0)],
)
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_loss_every_type_by_hand(loss_type, eps, beta):
    loss, _ = dpo_loss(*_inputs(), beta=beta, loss_type=loss_type, label_smoothing=eps)
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(sum(_hand_dpo(loss_type, beta, eps)) / 3, abs=TOL)


def test_dpo_sigmoid_hand_numbers():
    # β = 0.5: h = 0.75, −1, 0 → softplus(−h) = 0.386871..., 1.313262..., ln 2
    loss, _ = dpo_loss(*_inputs(), beta=0.5)
    expected = (math.log1p(math.exp(-0.75)) + math.log1p(math.exp(1.0)) + math.log(2)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx((0.38687101 + 1.31326169 + 0.69314718) / 3, abs=1e-8)


def test_robust_with_no_noise_is_dpo_and_is_unbiased_under_noise():
    plain, _ = dpo_loss(*_inputs(), beta=0.3, loss_type="sigmoid")
    robust0, _ = dpo_loss(*_inputs(), beta=0.3, loss_type="robust", label_smoothing=0.0)
    assert robust0.item() == pytest.approx(plain.item(), abs=TOL)
    # Chowdhury et al.: with labels flipped at rate ε, E[robust loss] is the clean DPO loss. The
    # expectation over one pair's flip: (1 − ε)·ℓ̂(y_w, y_l) + ε·ℓ̂(y_l, y_w) = ℓ(y_w, y_l).
    eps, beta = 0.2, 0.3
    pw, pl, rw, rl = (t([v]) for v in PAIRS[0])
    kept, _ = dpo_loss(pw, pl, rw, rl, beta=beta, loss_type="robust", label_smoothing=eps)
    flipped, _ = dpo_loss(pl, pw, rl, rw, beta=beta, loss_type="robust", label_smoothing=eps)
    assert (1 - eps) * kept.item() + eps * flipped.item() == pytest.approx(
        softplus(-beta * GAPS[0]), abs=TOL
    )


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_equal_chosen_and_rejected(loss_type):
    """y_w and y_l with the same log-probabilities under both models: h = 0."""
    v = t([-4.0, -1.5])
    beta = 0.25
    loss, stats = dpo_loss(v, v.clone(), v - 1, v - 1, beta=beta, loss_type=loss_type)
    expected = (1 / (2 * beta)) ** 2 if loss_type == "ipo" else math.log(2)  # 4.0 or ln 2
    assert loss.item() == pytest.approx(expected, abs=TOL)
    assert (
        stats["reward_margin"].item() == 0.0 and stats["accuracy"].item() == 0.0
    )  # ties are wrong
    assert stats["reward_chosen"].item() == pytest.approx(beta * 1.0, abs=TOL)


def test_simpo_equal_chosen_and_rejected_is_the_margin_alone():
    v = t([-1.2, -0.4])
    beta, ratio = 2.5, 0.6
    loss, _ = simpo_loss(v, v.clone(), beta=beta, gamma_beta_ratio=ratio)
    assert loss.item() == pytest.approx(softplus(ratio * beta), abs=TOL)  # −log σ(−γ), γ = 1.5


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_beta_to_zero_gives_ln2_and_no_gradient(loss_type):
    beta = 1e-12
    pw, pl, rw, rl = _inputs(grad=True)
    loss, _ = dpo_loss(pw, pl, rw, rl, beta=beta, loss_type=loss_type, label_smoothing=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=TOL)
    loss.backward()
    assert pw.grad.abs().max().item() < 1e-12 and pl.grad.abs().max().item() < 1e-12


def test_ipo_beta_to_zero_diverges_as_its_target():
    # (g − 1/(2β))² · β² → 1/4 as β → 0, whatever the gap g
    for beta in (1e-3, 1e-6):
        loss, _ = dpo_loss(*_inputs(), beta=beta, loss_type="ipo")
        assert loss.item() == pytest.approx(
            sum((g - 1 / (2 * beta)) ** 2 for g in GAPS) / 3, rel=TOL
        )
    assert loss.item() * 1e-12 == pytest.approx(0.25, abs=1e-5)


def test_simpo_beta_to_zero_gives_ln2():
    loss, _ = simpo_loss(t([-0.5, -3.0]), t([-2.0, -0.1]), beta=1e-12, gamma_beta_ratio=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=TOL)


def test_dpo_gradient_is_the_papers():
    """∂loss/∂log π_θ(y_w) = −β·σ(−h)/N, ∂loss/∂log π_θ(y_l) = +β·σ(−h)/N (Rafailov et al. §4)."""
    beta = 0.7
    pw, pl, rw, rl = _inputs(grad=True)
    loss, _ = dpo_loss(pw, pl, rw, rl, beta=beta)
    loss.backward()
    weights = [beta * sigmoid(-beta * g) / 3 for g in GAPS]
    assert pw.grad.tolist() == pytest.approx([-w for w in weights], abs=TOL)
    assert pl.grad.tolist() == pytest.approx(weights, abs=TOL)
    # the tie (h = 0) pulls with σ(0) = ½; the wrongly ordered pair (h < 0) pulls hardest
    assert weights[2] == pytest.approx(beta / 6, abs=1e-15) and weights[1] > weights[2] > weights[0]


def test_dpo_gradient_vanishes_as_h_grows():
    beta = 0.1
    for gap, bound in ((50.0, 0.1 * math.exp(-5) * 1.01), (500.0, 1e-22)):
        pw = t([0.0], grad=True)
        loss, _ = dpo_loss(pw, t([-gap]), t([0.0]), t([0.0]), beta=beta)
        loss.backward()
        assert pw.grad.item() == pytest.approx(-beta * sigmoid(-beta * gap), rel=TOL)
        assert abs(pw.grad.item()) < bound


def test_robust_ipo_and_simpo_gradients_by_hand():
    eps, beta = 0.2, 0.4
    pw, pl, rw, rl = _inputs(grad=True)
    loss, _ = dpo_loss(pw, pl, rw, rl, beta=beta, loss_type="robust", label_smoothing=eps)
    loss.backward()
    # d/dh of [(1 − ε)·softplus(−h) − ε·softplus(h)]/(1 − 2ε) = −[(1 − ε)·σ(−h) + ε·σ(h)]/(1 − 2ε)
    want = [
        -beta * ((1 - eps) * sigmoid(-beta * g) + eps * sigmoid(beta * g)) / (1 - 2 * eps) / 3
        for g in GAPS
    ]
    assert pw.grad.tolist() == pytest.approx(want, abs=TOL)
    assert pl.grad.tolist() == pytest.approx([-w for w in want], abs=TOL)

    pw, pl, rw, rl = _inputs(grad=True)
    loss, _ = dpo_loss(pw, pl, rw, rl, beta=beta, loss_type="ipo")
    loss.backward()
    want = [2 * (g - 1 / (2 * beta)) / 3 for g in GAPS]
    assert pw.grad.tolist() == pytest.approx(want, abs=TOL)
    assert pl.grad.tolist() == pytest.approx([-w for w in want], abs=TOL)

    cw, cl = t([-0.5, -2.0], grad=True), t([-1.5, -1.0], grad=True)
    beta, ratio = 2.0, 0.5
    loss, _ = simpo_loss(cw, cl, beta=beta, gamma_beta_ratio=ratio)
    loss.backward()
    z = [beta * (-0.5 + 1.5) - 1.0, beta * (-2.0 + 1.0) - 1.0]  # 1, −3
    assert loss.item() == pytest.approx((softplus(-z[0]) + softplus(-z[1])) / 2, abs=TOL)
    assert cw.grad.tolist() == pytest.approx([-beta * sigmoid(-v) / 2 for v in z], abs=TOL)
    assert cl.grad.tolist() == pytest.approx([beta * sigmoid(-v) / 2 for v in z], abs=TOL)


def test_stats_by_hand():
    beta = 0.5
    _, s = dpo_loss(*_inputs(), beta=beta)
    chosen = [beta * (pw - rw) for pw, _, rw, _ in PAIRS]  # 0.5, −0.5, 0
    rejected = [beta * (pl - rl) for _, pl, _, rl in PAIRS]  # −0.25, 0.5, 0
    assert s["reward_chosen"].item() == pytest.approx(sum(chosen) / 3, abs=TOL)
    assert s["reward_rejected"].item() == pytest.approx(sum(rejected) / 3, abs=TOL)
    assert s["reward_margin"].item() == pytest.approx(beta * sum(GAPS) / 3, abs=TOL)
    assert s["accuracy"].item() == pytest.approx(1 / 3, abs=1e-15)  # one right, one wrong, one tie
    assert s["logp_chosen"].item() == pytest.approx(-15 / 3, abs=TOL)
    assert s["logp_rejected"].item() == pytest.approx(-13.5 / 3, abs=TOL)
    assert not any(v.requires_grad for v in s.values())

    _, s = simpo_loss(t([-0.5, -2.0]), t([-1.5, -1.0]), beta=3.0, gamma_beta_ratio=0.5)
    assert s["reward_chosen"].item() == pytest.approx(3.0 * -1.25, abs=TOL)
    assert s["reward_rejected"].item() == pytest.approx(3.0 * -1.25, abs=TOL)
    assert s["accuracy"].item() == 0.5 and s["reward_margin"].item() == pytest.approx(0.0, abs=TOL)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_slices_with_a_normalizer_add_up_to_the_batch(loss_type):
    """Micro-batches / ranks: Σ over slices of the loss with normalizer = N is the full-batch mean, and
    so are the gradients."""
    pw, pl, rw, rl = _inputs(grad=True)
    full, _ = dpo_loss(pw, pl, rw, rl, beta=0.3, loss_type=loss_type)
    full.backward()
    g_full = pw.grad.clone()
    pw.grad = None
    parts = [
        dpo_loss(pw[sl], pl[sl], rw[sl], rl[sl], beta=0.3, loss_type=loss_type, normalizer=3)[0]
        for sl in (slice(0, 1), slice(1, 3))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=TOL)
    (parts[0] + parts[1]).backward()
    assert pw.grad.tolist() == pytest.approx(g_full.tolist(), abs=TOL)

    c, r = t([-0.5, -2.0, -0.7], grad=True), t([-1.5, -1.0, -0.2])
    full, _ = simpo_loss(c, r)
    split = simpo_loss(c[:2], r[:2], normalizer=3)[0] + simpo_loss(c[2:], r[2:], normalizer=3)[0]
    assert split.item() == pytest.approx(full.item(), abs=TOL)


def test_bad_arguments_raise():
    pw, pl, rw, rl = _inputs()
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'"):
        dpo_loss(pw, pl, rw, rl, loss_type="hinge")
    with pytest.raises(ValueError, match=r"dpo_beta = 0.0 must lie in \(0, ∞\)"):
        dpo_loss(pw, pl, rw, rl, beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing = 0.5 must lie in \[0, 0.5\)"):
        dpo_loss(pw, pl, rw, rl, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="the ipo loss has no label-noise variant"):
        dpo_loss(pw, pl, rw, rl, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        dpo_loss(pw, pl[:2], rw, rl)
    with pytest.raises(ValueError, match="empty batch"):
        simpo_loss(t([]), t([]))
    with pytest.raises(ValueError, match=r"gamma_beta_ratio = -0.1 must lie in \[0, ∞\)"):
        simpo_loss(pw, pl, gamma_beta_ratio=-0.1)
    with pytest.raises(ValueError, match=r"simpo_beta = -1.0 must lie"):
        simpo_loss(pw, pl, beta=-1.0)


# ------------------------------------------------------------------------------- sequence log-probs


def _two_token_logits(logps: list[float]) -> torch.Tensor:
    """(1, T, 2) logits whose token 0 has exactly the given log-probabilities: a = ℓ − log(1 − e^ℓ)."""
    return t([[[lp - math.log(-math.expm1(lp)), 0.0] for lp in logps]])


def test_sequence_logprobs_by_hand():
    # V = 3: p = (½, ¼, ¼) everywhere. Row 0: prompt, then tokens 0, 1 (response); row 1: one response
    # token then padding.
    row = [math.log(0.5), math.log(0.25), math.log(0.25)]
    logits = t([[row] * 3, [row] * 3])
    labels = torch.tensor([[2, 0, 1], [1, 0, 0]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    total = sequence_logprobs(logits, labels, mask)
    assert total.tolist() == pytest.approx(
        [math.log(0.5) + math.log(0.25), math.log(0.25)], abs=1e-15
    )
    avg = sequence_logprobs(logits, labels, mask, average=True)
    assert avg.tolist() == pytest.approx(
        [(math.log(0.5) + math.log(0.25)) / 2, math.log(0.25)], abs=1e-15
    )


def test_sequence_logprobs_ignore_garbage_and_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=F64)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.tensor(
        [
            [False, True, True, True, False],
            [True, True, False, False, False],
            [False, False, False, True, True],
        ]
    )
    expected = [
        sum(
            float(torch.log_softmax(logits[b, j], -1)[labels[b, j]]) for j in range(5) if mask[b, j]
        )
        for b in range(3)
    ]
    dirty_logits = torch.where(
        mask[..., None], logits, torch.full_like(logits, math.nan)
    ).requires_grad_(True)
    dirty_labels = torch.where(mask, labels, -100)
    got = sequence_logprobs(dirty_logits, dirty_labels, mask)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    got.sum().backward()
    assert torch.isfinite(dirty_logits.grad).all()
    assert (dirty_logits.grad[~mask] == 0).all()
    # Right-padding with more columns (garbage, masked) changes nothing.
    pad = torch.full((3, 4, 7), math.inf, dtype=F64)
    padded = sequence_logprobs(
        torch.cat([logits, pad], 1),
        torch.cat([labels, torch.zeros(3, 4, dtype=torch.long)], 1),
        torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], 1),
        average=True,
    )
    assert padded.tolist() == pytest.approx(
        [e / int(m.sum()) for e, m in zip(expected, mask)], abs=1e-12
    )


def test_sequence_logprobs_average_of_an_empty_row_raises():
    logits = torch.zeros(2, 3, 4, dtype=F64)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    with pytest.raises(ValueError, match="no valid"):
        sequence_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), mask, average=True)


def test_simpo_depends_on_length_only_through_the_averages():
    """A 2-token and a 4-token chosen response with the same average log-probability (−2) give the
    same SimPO loss; DPO's summed log-probabilities (−4 vs −8) would not."""
    short, long = _two_token_logits([-1.0, -3.0]), _two_token_logits([-2.0, -2.0, -2.0, -2.0])
    avg_short = sequence_logprobs(
        short, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), True
    )
    avg_long = sequence_logprobs(
        long, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), True
    )
    assert avg_short.item() == pytest.approx(-2.0, abs=1e-12) and avg_long.item() == pytest.approx(
        -2.0, abs=1e-12
    )
    rejected = t([-2.5])
    a, _ = simpo_loss(avg_short, rejected, beta=2.0, gamma_beta_ratio=0.5)
    b, _ = simpo_loss(avg_long, rejected, beta=2.0, gamma_beta_ratio=0.5)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)
    assert a.item() == pytest.approx(
        softplus(-(2.0 * 0.5 - 1.0)), abs=1e-12
    )  # z = β·0.5 − γ = 0: ln 2


# ------------------------------------------------------------------------------- exact token KL


def test_token_kl_by_hand():
    # p = (½, ½, 0), q = (¼, ½, ¼): KL = ½ ln(½/¼) + ½ ln(½/½) = ½ ln 2; the token p bans (−inf)
    # contributes 0, not NaN.
    logits = t([[[0.0, 0.0, -math.inf], [1.0, 2.0, 3.0]]])
    ref = t([[[math.log(0.25), math.log(0.5), math.log(0.25)], [1.0, 2.0, 3.0]]])
    kl = token_kl(logits, ref)
    assert kl[0, 0].item() == pytest.approx(0.5 * math.log(2), abs=1e-15)
    assert kl[0, 1].item() == pytest.approx(0.0, abs=1e-15)  # the same distribution


def test_token_kl_matches_torch_and_ignores_masked_garbage():
    g = torch.Generator().manual_seed(1)
    a, b = (
        torch.randn(2, 6, 9, generator=g, dtype=F64),
        torch.randn(2, 6, 9, generator=g, dtype=F64),
    )
    mask = torch.tensor(
        [[True, True, False, True, False, False], [False, True, True, True, True, True]]
    )
    want = (torch.softmax(a, -1) * (torch.log_softmax(a, -1) - torch.log_softmax(b, -1))).sum(-1)
    a_dirty = torch.where(mask[..., None], a, math.nan)
    got = token_kl(a_dirty, b, mask=mask, chunk_tokens=3)
    torch.testing.assert_close(got, torch.where(mask, want, 0.0), rtol=0, atol=1e-12)
    assert (got >= 0).all()
    assert token_kl(a, a).abs().max().item() < 1e-12
