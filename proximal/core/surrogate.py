"""The clipped importance ratio every policy-gradient objective here is built from, and the one set of
statistics they all report: PPO's clipped surrogate (Schulman et al. 2017), shared by PPO
(:func:`~proximal.core.losses.ppo_policy_loss`) and GRPO / DAPO / Dr. GRPO / RLOO
(:func:`~proximal.core.grpo.grpo_policy_loss`); GSPO (:mod:`proximal.core.gspo`) clips a sequence
ratio with it and CISPO (:mod:`proximal.core.cispo`) uses the clipped ratio as a stop-gradient weight.

The parts, each used by every objective that needs it:

- :func:`clipped_ratio` — r = exp(log-ratio) and clip(r, 1 − ε_low, 1 + ε_high): the one ratio/clip;
- :func:`pessimistic_surrogate` — −min(r·Â, clip(r)·Â) per unit and where the clipped branch won;
- :func:`apply_dual_clip`, :func:`weight_tokens` — dual-clip PPO's bound and the importance weights;
- :func:`surrogate_stats` — the statistics, with the same names for every objective;
- :func:`clipped_surrogate_loss` — the token-level surrogate, aggregated: PPO's and GRPO's loss.

Notation: B batch size, T response length; ``response_mask`` is bool (B, T), True = a real response
token (see :mod:`proximal.core.stats`). Losses are returned for minimisation, with detached stats;
docs/formulas.md writes out every equation and names the function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proximal.core.kl import kl_penalty
from proximal.core.ranges import check
from proximal.core.stats import check_mask, masked_aggregate, stat_mean

#: The keys of :func:`surrogate_stats`, the statistics every policy objective returns.
SURROGATE_STATS = (
    "pg_loss",
    "clipfrac",
    "clipfrac_low",
    "clipfrac_high",
    "clipfrac_dual",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "approx_kl",
    "approx_kl_k1",
    "advantage_mean",
    "advantage_min",
    "advantage_max",
)


def check_logprob_pair(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> None:
    """Raise ``ValueError`` unless ``logprobs`` is (B, T) with ``old_logprobs`` and ``response_mask``
    of its shape."""
    check_mask(logprobs, response_mask, "response_mask")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )


def token_advantages(advantages: Tensor, logprobs: Tensor, allow_tokens: bool, what: str) -> Tensor:
    """(B,) → broadcast to (B, T); (B, T) as is when ``allow_tokens``; ValueError otherwise."""
    if advantages.shape == logprobs.shape[:1]:
        return advantages[:, None].expand_as(logprobs)
    if allow_tokens and advantages.shape == logprobs.shape:
        return advantages
    want = "(B,) or (B, T)" if allow_tokens else "(B,)"
    raise ValueError(
        f"{what}: advantages must be {want} for logprobs of shape {tuple(logprobs.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def clipped_ratio(
    log_ratio: Tensor, *, clip_eps_low: float | None, clip_eps_high: float
) -> tuple[Tensor, Tensor]:
    """The importance ratio and its clip::

        r = exp(log_ratio),   r̂ = clip(r, 1 − ε_low, 1 + ε_high)

    ``log_ratio`` is log π_θ − log π_old per token (PPO, GRPO; detached for CISPO's stop-gradient
    weight) or GSPO's mean per response; the caller decides what it is and what carries gradient.

    Args:
        log_ratio: any shape.
        clip_eps_low: ε_low ∈ (0, 1), or None = no lower clip (CISPO's default). Not checked here.
        clip_eps_high: ε_high > 0. Not checked here.

    Returns:
        ``(r, r̂)``, each of ``log_ratio``'s shape.
    """
    ratio = torch.exp(log_ratio)
    low = None if clip_eps_low is None else 1 - clip_eps_low
    return ratio, torch.clamp(ratio, low, 1 + clip_eps_high)


def pessimistic_surrogate(
    ratio: Tensor, clipped: Tensor, advantages: Tensor
) -> tuple[Tensor, Tensor]:
    """The clipped surrogate's term per unit (token or response), negated for minimisation::

        ℓ = −min(r·Â, r̂·Â)

    Where the clipped branch is the smaller (Â > 0 with r > 1 + ε_high, or Â < 0 with r < 1 − ε_low)
    the unit's gradient is exactly zero.

    Args:
        ratio: r, (any shape), with grad.
        clipped: r̂ = clip(r), the same shape (from :func:`clipped_ratio`).
        advantages: Â, the same shape, detached.

    Returns:
        ``(ℓ, flattened)``: the terms and a bool tensor of where the clipped branch won (zero gradient).
    """
    unclipped = ratio * advantages
    clipped = clipped * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def apply_dual_clip(
    surrogate: Tensor, advantages: Tensor, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Dual-clip PPO's bound (Ye et al. 2020, eq. 5; verl's ``clip_ratio_c``) on a token loss::

        ℓ_t = min(ℓ_t, −c·Â_t)   where Â_t < 0;   ℓ_t unchanged where Â_t ≥ 0

    with ℓ_t = −min(r_t·Â_t, clip(r_t)·Â_t) the clipped surrogate's token loss. For Â_t < 0 the
    clipped surrogate grows without bound in r_t (a token π_θ made far likelier than π_old did);
    the bound caps it at c·|Â_t| and zeroes its gradient there. Active exactly where Â_t < 0 and
    ℓ_t > c·|Â_t|, i.e. (for c > 1 + ε) where r_t > c.

    Args:
        surrogate: ℓ_t, (B, T) (or any shape).
        advantages: Â_t, the same shape, detached.
        dual_clip: c > 1; None = off (``surrogate`` returned as is).

    Returns:
        ``(ℓ', active)``: the bounded token losses and a bool tensor of where the bound replaced ℓ_t
        (all False when off).
    """
    if dual_clip is None:
        return surrogate, torch.zeros_like(surrogate, dtype=torch.bool)
    check("dual_clip", dual_clip)
    bound = -dual_clip * advantages
    active = (advantages < 0) & (surrogate > bound)
    return torch.where(active, bound, surrogate), active.detach()


def weight_tokens(per_token: Tensor, is_weights: Tensor | None, response_mask: Tensor) -> Tensor:
    """``per_token``·w (importance weights, detached), or ``per_token`` when ``is_weights`` is None.

    Args:
        per_token: (B, T) token losses.
        is_weights: w, (B, T), ≥ 0 at valid tokens (values elsewhere never read); detached here.
        response_mask: bool (B, T).

    Returns:
        (B, T); 0·garbage cannot reach masked positions (they are replaced by 1 before multiplying).
    """
    if is_weights is None:
        return per_token
    if is_weights.shape != per_token.shape:
        raise ValueError(
            f"is_weights shape {tuple(is_weights.shape)} != token shape {tuple(per_token.shape)}"
        )
    w = torch.where(response_mask, is_weights.detach(), 1.0).to(per_token.dtype)
    if bool((w < 0).any()) or bool(w.isnan().any()):
        raise ValueError("is_weights must be >= 0 (and not NaN) at valid tokens")
    return per_token * w


def sampled_kl(log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """k1 and k3 estimates of KL(π_old ‖ π_θ) per token from log r = log π_θ − log π_old (detached).

    The samples come from π_old, so :func:`~proximal.core.kl.kl_penalty`'s "policy" is π_old and its
    "reference" π_θ: k1 = −log r, k3 = r − 1 − log r.
    """
    log_ratio = log_ratio.detach()
    zeros = torch.zeros_like(log_ratio)
    return kl_penalty(-log_ratio, zeros, "k1"), kl_penalty(-log_ratio, zeros, "k3")


def surrogate_stats(
    units: Tensor,
    *,
    pg_loss: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    clipped_low: Tensor,
    clipped_high: Tensor,
    kl_k1: Tensor,
    kl_k3: Tensor,
    dual: Tensor | None = None,
) -> dict[str, Tensor]:
    """The statistics of a policy objective, under the same names for every objective.

    A unit is a token (PPO, GRPO, CISPO) or a response (GSPO, whose ratio is one per response);
    every per-unit argument has ``units``' shape and is read only where it is True.

    Args:
        units: bool, (B, T) valid tokens or (B,) responses with a valid token.
        pg_loss: the policy-gradient loss (detached here).
        ratio: the importance ratio per unit.
        advantages: Â per unit.
        clipped_low, clipped_high: per unit, where the clip at 1 − ε_low (Â < 0) and at 1 + ε_high
            (Â > 0) acted (bool), or the fraction of a response's tokens where it did; never both
            at one unit.
        kl_k1, kl_k3: estimates of KL(π_old ‖ π_θ) per unit (:func:`sampled_kl`).
        dual: bool per unit, where dual-clip's bound replaced the loss; None = nowhere.

    Returns:
        Detached, ``SURROGATE_STATS``: ``pg_loss``; means over the units of ``clipfrac``
        (= ``clipfrac_low`` + ``clipfrac_high``), ``clipfrac_low``, ``clipfrac_high``,
        ``clipfrac_dual``, ``ratio_mean``, ``approx_kl`` (k3), ``approx_kl_k1``, ``advantage_mean``
        (0 for no unit); extremes ``ratio_min``, ``ratio_max``, ``advantage_min``,
        ``advantage_max`` (±inf for no unit).
    """
    with torch.no_grad():
        ratio = ratio.detach()
        low, high = clipped_low.to(ratio.dtype), clipped_high.to(ratio.dtype)
        dual = torch.zeros_like(units) if dual is None else dual
        return {
            "pg_loss": pg_loss.detach(),
            "clipfrac": stat_mean(low + high, units),
            "clipfrac_low": stat_mean(low, units),
            "clipfrac_high": stat_mean(high, units),
            "clipfrac_dual": stat_mean(dual.to(ratio.dtype), units),
            "ratio_mean": stat_mean(ratio, units),
            "ratio_min": torch.where(units, ratio, math.inf).min(),
            "ratio_max": torch.where(units, ratio, -math.inf).max(),
            "approx_kl": stat_mean(kl_k3, units),
            "approx_kl_k1": stat_mean(kl_k1, units),
            "advantage_mean": stat_mean(advantages, units),
            "advantage_min": torch.where(units, advantages, math.inf).min(),
            "advantage_max": torch.where(units, advantages, -math.inf).max(),
        }


def clipped_surrogate_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    aggregation: str,
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The negated clipped surrogate per token, aggregated (docs/formulas.md, "The clipped surrogate")::

        r_t = exp(log π_θ(y_t|s_t) − log π_old(y_t|s_t))
        ℓ_t = −w_t · min(r_t·Â_t, clip(r_t, 1 − ε_low, 1 + ε_high)·Â_t)     (dual-clipped first)
        loss = agg_t(ℓ_t)

    PPO's L^CLIP with ε_low = ε_high; GRPO's surrogate with DAPO's clip-higher ε_high > ε_low.

    Args:
        logprobs: log π_θ(y_t | s_t) under the current parameters (with grad), (B, T).
        old_logprobs: log π_old(y_t | s_t), (B, T).
        advantages: Â_t, (B, T), detached; used in the dtype given.
        response_mask: bool (B, T).
        clip_eps_low: ε_low ∈ (0, 1) (checked as ``clip_eps``).
        clip_eps_high: ε_high > 0.
        aggregation, max_length, normalizer: see :func:`~proximal.core.stats.masked_aggregate`.
        dual_clip: c > 1, dual-clip PPO's bound for Â < 0 (:func:`apply_dual_clip`); None = off.
        is_weights: w ≥ 0, (B, T), detached per-token weights; None = all 1.

    Returns:
        ``(loss, stats)``: :func:`surrogate_stats` over the valid tokens, ``pg_loss`` = loss.
    """
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
    check_mask(logprobs, response_mask, "response_mask")
    check("clip_eps", clip_eps_low)
    check("clip_eps_high", clip_eps_high)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0.0)
    advantages = torch.where(response_mask, advantages, 0.0)
    ratio, clipped = clipped_ratio(
        log_ratio, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high
    )
    surrogate, flattened = pessimistic_surrogate(ratio, clipped, advantages)
    surrogate, dual_active = apply_dual_clip(surrogate, advantages, dual_clip)
    loss = masked_aggregate(
        weight_tokens(surrogate, is_weights, response_mask),
        response_mask,
        aggregation,
        max_length=max_length,
        normalizer=normalizer,
    )
    kl_k1, kl_k3 = sampled_kl(log_ratio)
    return loss, surrogate_stats(
        response_mask,
        pg_loss=loss,
        ratio=ratio,
        advantages=advantages,
        clipped_low=flattened & (advantages < 0),
        clipped_high=flattened & (advantages > 0),
        kl_k1=kl_k1,
        kl_k3=kl_k3,
        dual=dual_active,
    )
