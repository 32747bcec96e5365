"""CISPO (MiniMax-M1, 2025): REINFORCE with the clipped importance ratio of
:mod:`proximal.core.surrogate` as a stop-gradient weight, so that no token's gradient is dropped.

Notation: B batch size, T response length; ``response_mask`` is bool (B, T), True = a real response
token (see :mod:`proximal.core.stats`). The loss is returned for minimisation, with detached stats;
docs/formulas.md writes out every equation and names the function.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proximal.core.ranges import check
from proximal.core.stats import masked_aggregate
from proximal.core.surrogate import (
    check_logprob_pair,
    clipped_ratio,
    sampled_kl,
    surrogate_stats,
    token_advantages,
    weight_tokens,
)


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The negated CISPO objective (MiniMax-M1, 2025, eq. 4–5)::

        r_{i,t} = exp(log π_θ(o_{i,t}) − log π_old(o_{i,t}))
        r̂_{i,t} = clip(r_{i,t}, 1 − ε_low, 1 + ε_high)            (no lower clip when ε_low is None)
        loss = −1/Σ_i |o_i| · Σ_{i,t} w_{i,t} · sg[r̂_{i,t}] · Â_{i,t} · log π_θ(o_{i,t})

    REINFORCE with a clipped, stop-gradient importance weight: the gradient of every token is
    −w·r̂·Â·∇log π_θ / Σ|o_i| — the clip bounds the weight but, unlike PPO's and GRPO's surrogate
    (where a token whose clipped branch wins gets exactly zero gradient), never drops a token, so
    rare tokens whose ratio moves far (the "fork" tokens of long reasoning) keep contributing. The
    loss value itself is not a surrogate of the return (it scales with log π); its gradient is what
    matters. On-policy (r = 1) it is the token-mean REINFORCE gradient.

    MiniMax-M1 sets no lower bound and tunes ε_high; any ε_high > 0 and ε_low ∈ (0, 1) work here.

    Args:
        logprobs: log π_θ (with grad), (B, T).
        old_logprobs: log π_old, (B, T).
        advantages: Â, (B,) one per response (broadcast) or (B, T); detached.
        response_mask: bool (B, T).
        clip_eps_low: ε_low ∈ (0, 1) (``grpo.clip_eps``), or None = no lower clip (the paper's
            choice).
        clip_eps_high: ε_high > 0; None = ``clip_eps_low`` (``grpo.clip_eps_high``'s default), which
            must then be given.
        is_weights: w ≥ 0, (B, T) detached per-token weights (rollout correction); None = 1.
        normalizer: Σ|o_i| over the whole batch when this call sees a micro-batch or one rank's
            share (:func:`~proximal.core.stats.masked_aggregate`, ``"token-mean"``).

    Returns:
        ``(loss, stats)``: :func:`~proximal.core.surrogate.surrogate_stats` over the valid tokens:
        ``clipfrac_high`` (r > 1 + ε_high: the weight capped), ``clipfrac_low`` (r < 1 − ε_low:
        raised), ``ratio_*``, ``approx_kl`` / ``approx_kl_k1`` (k3 / k1 estimates of
        KL(π_old ‖ π_θ)), ``advantage_*``, ``pg_loss`` (= loss).
    """
    check_logprob_pair(logprobs, old_logprobs, response_mask)
    advantages = token_advantages(advantages, logprobs, True, "cispo_policy_loss")
    if clip_eps_high is None:
        if clip_eps_low is None:
            raise ValueError("cispo_policy_loss: clip_eps_high is needed when clip_eps_low is None")
        clip_eps_high = clip_eps_low
    check("clip_eps_high", clip_eps_high)
    if clip_eps_low is not None:
        check("clip_eps", clip_eps_low)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0.0)
    advantages = torch.where(response_mask, advantages.to(log_ratio.dtype), 0.0)
    # r and sg[r̂], (B, T)
    ratio, weight = clipped_ratio(
        log_ratio.detach(), clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
    )
    lp = torch.where(response_mask, logprobs, 0.0)
    per_token = weight_tokens(-weight * advantages * lp, is_weights, response_mask)
    loss = masked_aggregate(per_token, response_mask, "token-mean", normalizer=normalizer)

    k1, k3 = sampled_kl(log_ratio)
    no_low = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, surrogate_stats(
        response_mask,
        pg_loss=loss,
        ratio=ratio,
        advantages=advantages,
        clipped_low=no_low if clip_eps_low is None else ratio < 1 - clip_eps_low,
        clipped_high=ratio > 1 + clip_eps_high,
        kl_k1=k1,
        kl_k3=k3,
    )
