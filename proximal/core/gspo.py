"""GSPO and GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", the sequence-level
ratio of Qwen3's training): the clipped surrogate of :mod:`proximal.core.surrogate` on one
length-normalised ratio per response instead of one per token.

Notation: B batch size (responses; G per prompt), T response length, |o_i| the valid tokens of
response i; ``response_mask`` is bool (B, T), True = a real response token (see
:mod:`proximal.core.stats`). The loss is returned for minimisation, with detached stats;
docs/formulas.md writes out every equation and names the function.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proximal.core.ranges import check
from proximal.core.surrogate import (
    check_logprob_pair,
    clipped_ratio,
    pessimistic_surrogate,
    sampled_kl,
    surrogate_stats,
    token_advantages,
)


def _sequence_weights(is_weights: Tensor | None, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """GSPO's (B,) importance weights, detached, 1 where None; ≥ 0 at the rows that count."""
    if is_weights is None:
        return torch.ones(rows.shape, dtype=dtype, device=rows.device)
    if is_weights.shape != rows.shape:
        raise ValueError(
            f"is_weights must be (B,) = {tuple(rows.shape)} (one weight per sequence), "
            f"got {tuple(is_weights.shape)}"
        )
    w = torch.where(rows, is_weights.detach(), 1.0).to(dtype)
    if bool((w < 0).any()) or bool(w.isnan().any()):
        raise ValueError("is_weights must be >= 0 (and not NaN) at sequences with valid tokens")
    return w


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float | None = None,
    token_level: bool = False,
    is_weights: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The negated GSPO objective (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5–7)::

        s_i = exp( 1/|o_i| · Σ_t (log π_θ(o_{i,t}) − log π_old(o_{i,t})) )       (the length-normalised
                                                                               sequence ratio, eq. 7)
        loss = −1/G · Σ_i w_i · min(s_i·Â_i, clip(s_i, 1 − ε, 1 + ε_high)·Â_i)

    One ratio per response: a sequence is clipped (and contributes no gradient) as a whole, and
    its gradient, where unclipped, is −w_i·Â_i·s_i·1/|o_i|·Σ_t ∇log π_θ(o_{i,t}) — every token of a
    response weighted alike. s_i depends only on the sum of the response's log-ratio, not on how it
    is spread over the tokens. The paper clips with ε = 3e-4, ε_high = 4e-4: a mean log-ratio per
    token, far tighter than a token ratio's 0.2.

    ``token_level=True`` is GSPO-token (eq. 13–14), for per-token advantages::

        s_{i,t} = sg[s_i] · π_θ(o_{i,t}) / sg[π_θ(o_{i,t})]        (value s_i; gradient s_i·∇log π_θ(o_{i,t}))
        loss = −1/G · Σ_i w_i · 1/|o_i| · Σ_t min(s_{i,t}·Â_{i,t}, clip(s_{i,t}, 1 − ε, 1 + ε_high)·Â_{i,t})

    With Â_{i,t} = Â_i it equals GSPO in value and gradient.

    G is the number of responses with at least one valid token (a response without one weighs
    nothing), or ``normalizer``: that count over the whole mini-batch when this call sees a
    micro-batch or one rank's share — the shares then add up to the whole batch's loss
    (:func:`~proximal.core.stats.aggregation_units` with ``"seq-mean-token-mean"`` gives it).

    Args:
        logprobs: log π_θ(o_t | s_t) under the current parameters (with grad), (B, T).
        old_logprobs: log π_old, recorded when the responses were sampled, (B, T).
        advantages: Â, (B,) one per response (GSPO); GSPO-token also takes (B, T). Detached.
        response_mask: bool (B, T).
        clip_eps_low: ε ∈ (0, 1), the lower side (s ≥ 1 − ε; ``grpo.clip_eps``); the paper: 3e-4.
        clip_eps_high: ε_high > 0, the upper side; None = ``clip_eps_low``; the paper: 4e-4.
        token_level: GSPO-token instead of GSPO.
        is_weights: w_i ≥ 0, (B,) detached sequence weights (e.g. a rollout correction); None = 1.
        normalizer: G over the whole batch (> 0), see above.

    Returns:
        ``(loss, stats)``: :func:`~proximal.core.surrogate.surrogate_stats` over the responses with
        a valid token (so a trainer weighs them by that count): ``pg_loss`` (= loss),
        ``clipfrac_low`` (Â < 0 and the clip at 1 − ε zeroed the gradient) and ``clipfrac_high``
        (Â > 0 and the clip at 1 + ε_high; for GSPO-token, a response's fraction of such tokens),
        ``ratio_*`` (of s_i), ``approx_kl`` / ``approx_kl_k1`` (each response's mean k3 / k1
        estimate of KL(π_old ‖ π_θ)), ``advantage_*`` (Â_i; ±inf extremes when there is none).
    """
    check_logprob_pair(logprobs, old_logprobs, response_mask)
    per_response = advantages.shape == logprobs.shape[:1]
    seq_adv = advantages if per_response else None  # (B,) as given: no round-off from a token mean
    advantages = token_advantages(advantages, logprobs, token_level, "gspo_policy_loss")
    check("clip_eps", clip_eps_low)
    clip_eps_high = clip_eps_low if clip_eps_high is None else check("clip_eps_high", clip_eps_high)

    n = response_mask.sum(1)  # |o_i|, (B,)
    rows = n > 0  # the responses that count
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0.0)
    log_s = log_ratio.sum(1) / n.clamp_min(1)  # (B,), 0 for an empty row
    weights = _sequence_weights(is_weights, rows, log_s.dtype)
    advantages = torch.where(response_mask, advantages.to(log_s.dtype), 0.0)
    if seq_adv is not None:
        seq_adv = torch.where(rows, seq_adv.to(log_s.dtype), 0.0)
    eps = {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high}
    if token_level:
        # value s_i, gradient s_i·∇log π_θ(o_t): log π_θ − sg[log π_θ] is 0 in value; adding sg[log s_i]
        # last keeps the value exact (verl#2775 orders it the same way)
        lp = torch.where(response_mask, logprobs, 0.0)
        ratio, clipped = clipped_ratio(lp - lp.detach() + log_s.detach()[:, None], **eps)  # (B, T)
        per_token, flattened = pessimistic_surrogate(ratio, clipped, advantages)
        per_seq = torch.where(response_mask, per_token, 0.0).sum(1) / n.clamp_min(1)
        flattened = torch.where(response_mask, flattened, False)
        frac = lambda sel: (flattened & sel).sum(1).to(log_s.dtype) / n.clamp_min(1)  # noqa: E731
        clip_low, clip_high = frac(advantages < 0), frac(advantages > 0)
        if seq_adv is None:  # for the stats only
            seq_adv = torch.where(rows, advantages.sum(1) / n.clamp_min(1), 0.0)
    else:
        s, clipped = clipped_ratio(log_s, **eps)
        per_seq, flattened = pessimistic_surrogate(s, clipped, seq_adv)
        clip_low, clip_high = flattened & (seq_adv < 0), flattened & (seq_adv > 0)
    per_seq = torch.where(rows, weights * per_seq, 0.0)
    if normalizer is None:
        if not bool(rows.any()):
            raise ValueError("gspo_policy_loss: no response has a valid token")
        loss = per_seq.sum() / rows.sum()
    else:
        denominator = torch.as_tensor(normalizer, dtype=torch.float32, device=per_seq.device)
        if not bool(denominator > 0):
            raise ValueError(f"gspo_policy_loss: normalizer must be > 0, got {float(denominator)}")
        loss = per_seq.sum() / denominator

    with torch.no_grad():
        row_mean = lambda x: torch.where(response_mask, x, 0.0).sum(1) / n.clamp_min(1)  # noqa: E731
        k1, k3 = sampled_kl(log_ratio)
        stats = surrogate_stats(
            rows,
            pg_loss=loss,
            ratio=torch.exp(log_s.detach()),
            advantages=seq_adv,
            clipped_low=clip_low,
            clipped_high=clip_high,
            kl_k1=row_mean(k1),
            kl_k3=row_mean(k3),
        )
    return loss, stats
