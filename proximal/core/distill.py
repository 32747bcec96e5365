"""On-policy distillation: the student π_s samples, a frozen teacher π_t grades every token
(docs/formulas.md, "On-policy distillation").

Two objectives, both on the student's own samples:

- the **reverse KL as a per-token reward** (Thinking Machines, "On-policy distillation", 2025;
  Agarwal et al. 2024, GKD, with β = 1 and a sampled estimate):
  :func:`reverse_kl_advantages` gives A_t = −(log π_s(y_t) − log π_t(y_t)), a constant (no
  gradient) that the trainer puts through the clipped surrogate like any other advantage;
- the **generalised Jensen–Shannon divergence JSD(β)** over the whole vocabulary at each position
  (GKD, eq. 1): :func:`generalized_jsd` from logits, :func:`linear_generalized_jsd` from the last
  hidden states and the two LM heads, a chunk of tokens at a time, so no (B, T, V) tensor is kept.

Notation: B batch size, T response length, V vocabulary, H hidden size, N valid positions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proximal.core.advantages import returns_to_go
from proximal.core.fused import DEFAULT_CHUNK_ELEMENTS
from proximal.core.stats import check_mask

REDUCTIONS = ("sum", "mean")


def reverse_kl_advantages(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    response_mask: Tensor,
    discount: float = 0.0,
) -> Tensor:
    """The reverse KL to the teacher as a per-token reward, and its (discounted) return:

        r_t = −(log π_s(y_t | s_t) − log π_t(y_t | s_t))        (−k1 of KL(π_s ‖ π_t) at y_t ~ π_s)
        A_t = Σ_{t' ≥ t valid} γ^{k(t, t')} · r_{t'}             (γ = 0: A_t = r_t)

    Thinking Machines' "On-policy distillation" (2025) uses γ = 0: each token is graded alone, the
    dense per-token form; γ > 0 credits a token with the teacher's verdict on what follows it
    (k(t, t') counts valid steps, :func:`~proximal.core.advantages.returns_to_go`). No baseline,
    no whitening: E_{y ~ π_s}[r_t] = −KL(π_s ‖ π_t)(s_t) is the quantity trained on.

    Stop-gradient: both inputs are detached here. The advantages are constants; the gradient
    reaches the student only through the ratio of the clipped surrogate that consumes them
    (:func:`~proximal.core.grpo.grpo_policy_loss`), whose on-policy gradient is then that of
    −E[log π_s · r_t], the policy gradient of the reverse KL.

    Args:
        student_logprobs: log π_s(y_t | s_t) of the sampled tokens — the policy that sampled them
            (π_old), (B, T).
        teacher_logprobs: log π_t(y_t | s_t), (B, T), at the same temperature.
        response_mask: bool (B, T); values at False positions are never read.
        discount: γ ∈ [0, 1].

    Returns:
        (B, T) advantages in the inputs' dtype, 0 at masked positions.
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs shape {tuple(student_logprobs.shape)} != teacher_logprobs shape "
            f"{tuple(teacher_logprobs.shape)}"
        )
    check_mask(student_logprobs, response_mask, "response_mask")
    discount = float(discount)
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    reward = teacher_logprobs.detach() - student_logprobs.detach()  # −(log π_s − log π_t)
    reward = torch.where(response_mask, reward, torch.zeros_like(reward))
    if discount == 0.0:
        return reward
    return returns_to_go(reward, response_mask, gamma=discount).to(reward.dtype)


# ----------------------------------------------------------------------------------------------
# The generalised JSD over the vocabulary
# ----------------------------------------------------------------------------------------------


def _check_beta(beta: float) -> float:
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return beta


def _rows(zs: Tensor, zt: Tensor, beta: float, temperature: float) -> tuple[Tensor, Tensor]:
    """Per row (position) of logits (n, V): JSD(β) and its gradient with respect to the student's
    logits ``zs`` (the teacher's ``zt`` is a constant). Analytic gradients, in the form that is
    exactly 0 when the two distributions are equal (for the loss and the gradient to be exactly 0
    when the teacher is the student):

        β = 0:  KL(t ‖ s),   ∂/∂z_s = (p_s − p_t) / τ
        β = 1:  KL(s ‖ t),   ∂/∂z_s = p_s ⊙ (g − ⟨p_s, g⟩) / τ with g = log p_s − log p_t
        else:   ∂/∂p_s = (1 − β)·log(p_s / m), so ∂/∂z_s = p_s ⊙ (g − ⟨p_s, g⟩) / τ with
                g = (1 − β)(log p_s − log m)

    where log m = log((1 − β) p_s + β p_t) = log p_s + log1p(β·expm1(log p_t − log p_s)) (or the
    same from the teacher's side, whichever exponent is ≤ 0): exactly log p_s when p_t = p_s."""
    ls = torch.log_softmax(zs / temperature, dim=-1)
    lt = torch.log_softmax(zt / temperature, dim=-1)
    ps = ls.exp()
    if beta == 0.0:
        pt = lt.exp()
        return (pt * (lt - ls)).sum(-1), (ps - pt) / temperature
    if beta == 1.0:
        g = ls - lt
        loss = (ps * g).sum(-1)
    else:
        pt = lt.exp()
        d = lt - ls
        lm = torch.where(
            d <= 0,
            ls + torch.log1p(beta * torch.expm1(d.clamp(max=0))),
            lt + torch.log1p((1.0 - beta) * torch.expm1((-d).clamp(max=0))),
        )
        loss = beta * (pt * (lt - lm)).sum(-1) + (1.0 - beta) * (ps * (ls - lm)).sum(-1)
        g = (1.0 - beta) * (ls - lm)
    grad = ps * (g - (ps * g).sum(-1, keepdim=True)) / temperature
    return loss, grad


def _reduce(total: Tensor, n: int, reduction: str) -> Tensor:
    return total if reduction == "sum" else total / max(n, 1)


def _check(beta: float, temperature: float, reduction: str) -> tuple[float, float]:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _check_beta(beta), temperature


def _stats(per_token: Tensor) -> dict:
    return {"jsd_token_mean": per_token.detach().mean() if per_token.numel() else per_token.sum()}


class _LogitsJSD(torch.autograd.Function):
    """``(Σ_n JSD(β), per-row JSD)`` over rows of logits (N, V), a chunk of ``rows`` at a time; the
    gradient of the sum is computed in the forward pass (the per-row values are not
    differentiable)."""

    @staticmethod
    def forward(ctx, zs, zt, beta, temperature, rows):
        cdt = torch.promote_types(zs.dtype, torch.float32)
        per = zs.new_empty(zs.shape[0], dtype=cdt)
        grad = torch.empty_like(zs) if ctx.needs_input_grad[0] else None
        for s in range(0, zs.shape[0], rows):
            loss, g = _rows(zs[s : s + rows].to(cdt), zt[s : s + rows].to(cdt), beta, temperature)
            per[s : s + rows] = loss
            if grad is not None:
                grad[s : s + rows] = g
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(per)
        return per.sum(), per

    @staticmethod
    def backward(ctx, g_total, _g_per):
        (grad,) = ctx.saved_tensors
        return grad * g_total.to(grad.dtype), None, None, None, None


class _LinearJSD(torch.autograd.Function):
    """``(Σ_n JSD(β), per-row JSD)`` from hidden states: a chunk of ``rows`` positions' logits at
    a time, the gradient of the sum with respect to the student's hidden states and head
    accumulated in the forward pass (the teacher's side is a constant)."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, beta, temperature, rows):
        cdt = torch.promote_types(hs.dtype, torch.float32)
        N = hs.shape[0]
        per = hs.new_empty(N, dtype=cdt)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.zeros(hs.shape, dtype=cdt, device=hs.device) if need_h else None
        gw = torch.zeros(ws.shape, dtype=cdt, device=ws.device) if need_w else None
        ws_c, wt_c = ws.to(cdt), wt.to(cdt)
        for s in range(0, N, rows):
            h_c = hs[s : s + rows].to(cdt)
            zs = h_c @ ws_c.T  # (n, V): the one logits chunk held, per model
            zt = ht[s : s + rows].to(cdt) @ wt_c.T
            loss, g = _rows(zs, zt, beta, temperature)
            per[s : s + rows] = loss
            if need_h:
                gh[s : s + rows] = g @ ws_c
            if need_w:
                gw.addmm_(g.T, h_c)
        ctx.save_for_backward(gh, gw)
        ctx.dtypes = (hs.dtype, ws.dtype)
        ctx.mark_non_differentiable(per)
        return per.sum(), per

    @staticmethod
    def backward(ctx, g_total, _g_per):
        gh, gw = ctx.saved_tensors
        out_h = None if gh is None else (gh * g_total.to(gh.dtype)).to(ctx.dtypes[0])
        out_w = None if gw is None else (gw * g_total.to(gw.dtype)).to(ctx.dtypes[1])
        return out_h, out_w, None, None, None, None, None


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    response_mask: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    *,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> tuple[Tensor, dict]:
    """The generalised Jensen–Shannon divergence of GKD (Agarwal et al. 2024, eq. 1) at every
    valid position, over the whole vocabulary, with TRL's convention
    (``GKDTrainer.generalized_jsd_loss``, huggingface/trl):

        p_s = softmax(z_s / τ),  p_t = softmax(z_t / τ),  m = β·p_t + (1 − β)·p_s
        JSD(β) = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)            0 < β < 1
        JSD(0) := KL(p_t ‖ p_s)   (forward KL)                  β = 0
        JSD(1) := KL(p_s ‖ p_t)   (reverse KL)                  β = 1

    The formula itself is 0 at both β = 0 and β = 1 (m is then one of the two distributions and
    its weight is 0), so the two ends are special-cased as TRL does. Temperature divides both
    logits; there is no τ² factor (TRL has none).

    Reduction over the valid tokens: ``"sum"``, or ``"mean"`` = sum / (number of valid tokens),
    which is TRL's ``reduction="batchmean"`` with a label mask. Stop-gradient: the teacher's logits
    are a constant (no gradient flows to them); the student's gradient is analytic
    (:func:`_rows`) and exactly 0 where the teacher equals the student.

    Args:
        student_logits: (B, T, V) (any leading shape matching the mask, then V).
        teacher_logits: same shape, same vocabulary (a different V raises).
        response_mask: bool (B, T); rows where False are never read and get zero gradient.
        beta: β ∈ [0, 1].
        temperature: τ > 0.
        reduction: ``"sum"`` or ``"mean"``.
        chunk_tokens: positions computed at once (None: all).

    Returns:
        ``(loss, {"jsd_token_mean": ...})``: a scalar in float32 (float64 for float64 logits).
    """
    beta, temperature = _check(beta, temperature, reduction)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits shape {tuple(student_logits.shape)} != teacher_logits shape "
            f"{tuple(teacher_logits.shape)} (the teacher must share the student's vocabulary)"
        )
    check_mask(student_logits[..., 0], response_mask, "response_mask")
    zs = student_logits[response_mask]  # (N, V)
    zt = teacher_logits.detach()[response_mask]
    rows = max(1, zs.shape[0] if chunk_tokens is None else int(chunk_tokens))
    total, per = _LogitsJSD.apply(zs, zt, beta, temperature, rows)
    return _reduce(total, zs.shape[0], reduction), _stats(per)


def linear_generalized_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    response_mask: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    *,
    reduction: str = "mean",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[Tensor, dict]:
    """:func:`generalized_jsd` of ``student_hidden @ student_weight.T`` and ``teacher_hidden @
    teacher_weight.T`` (the same equations, β convention, reduction and stop-gradient), computed a
    chunk of positions at a time: at most ``chunk_elements // V`` positions' logits (at least one
    position) exist at once, for each model, and no (B, T, V) tensor or its gradient is kept — the
    gradients with respect to the student's hidden states and head are accumulated chunk by chunk
    in the forward pass. Heads without a bias (a biased head: add it to the weight's caller).

    Args:
        student_hidden: (B, T, H_s); ``hidden[:, t]`` predicts position t (the caller shifts).
        student_weight: (V, H_s), the student's LM head; gets a gradient if it requires one.
        teacher_hidden: (B, T, H_t), a constant.
        teacher_weight: (V, H_t), a constant; the same V as the student's.
        response_mask: bool (B, T).
        beta, temperature, reduction: as :func:`generalized_jsd`.
        chunk_elements: logits elements (positions × V) materialised at once per model.

    Returns:
        ``(loss, stats)`` as :func:`generalized_jsd`.
    """
    beta, temperature = _check(beta, temperature, reduction)
    V = student_weight.shape[0]
    if teacher_weight.shape[0] != V:
        raise ValueError(
            f"teacher vocabulary {teacher_weight.shape[0]} != student vocabulary {V} "
            "(the teacher must share the student's tokenizer)"
        )
    check_mask(student_hidden[..., 0], response_mask, "response_mask")
    check_mask(teacher_hidden[..., 0], response_mask, "response_mask")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be ≥ 1, got {chunk_elements}")
    hs = student_hidden[response_mask]  # (N, H_s)
    ht = teacher_hidden.detach()[response_mask]
    rows = max(1, chunk_elements // V)
    total, per = _LinearJSD.apply(
        hs, student_weight, ht, teacher_weight.detach(), beta, temperature, rows
    )
    return _reduce(total, hs.shape[0], reduction), _stats(per)
