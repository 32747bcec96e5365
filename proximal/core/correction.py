"""Rollout correction: the gap between the policy that sampled the tokens and the trainer's π_old.

The rollout engine samples each token from μ — the policy's weights, but computed by the engine:
another precision (``rollout.precision``), other kernels, another batch layout, or a serving
engine altogether. The trainer recomputes the same tokens' log-probabilities as log π_old. In exact
arithmetic μ = π_old; in practice they differ, and the policy gradient computed as if the tokens
came from π_old is then off-policy (Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"; Liu, Li et al. 2025, "When speed kills stability"). Per token the
correction ratio is

    ρ_t = π_old(y_t | s_t) / μ(y_t | s_t) = exp(log π_old − log μ)

and the modes below turn it into a detached per-token weight w_t on the policy-gradient term of the
PPO/GRPO loss (``is_weights`` of :func:`~proximal.core.losses.ppo_policy_loss` and
:func:`~proximal.core.grpo.grpo_policy_loss`; never on the KL term). docs/rollout-correction.md says
when each applies.

- ``tis`` — truncated importance sampling (Yao et al. 2025; verl ``rollout_is: token``):
  w_t = min(ρ_t, C).
- ``token_mask`` — IcePop (Ring-1T, Ling team 2025): w_t = ρ_t·1[lo ≤ ρ_t ≤ hi]; a token whose
  ratio leaves the band leaves the policy loss, the others are reweighted.
- ``seq_mask`` — geometric-mean rejection (verl's Geo-RS, ``rollout_rs: seq_mean_k1``):
  w_{i,t} = 1[lo ≤ ρ̄_i ≤ hi] with ρ̄_i = exp(1/|o_i| Σ_t log ρ_{i,t}), the whole response in or out.
- ``bypass`` — π_old := μ (verl ``bypass_mode``): no weights; the PPO ratio π_θ/μ carries the
  correction and π_old's forward pass is skipped. ``none`` — no weights.

The band (lo, hi) bounds ρ itself. verl's k1 threshold ``'lo_hi'`` (``token_k1``, ``seq_mean_k1``)
bounds −log ρ instead (``rollout_corr_helper.compute_rollout_rejection_mask``), so it keeps
ρ ∈ [1/hi, 1/lo]: verl's ``'lo_hi'`` is the band (1/hi, 1/lo) here, and the band (lo, hi) is verl's
``'1/hi_1/lo'``. The two agree only for a band symmetric in log ρ (lo·hi = 1).

Notation: B rows, T response length; ``response_mask`` bool (B, T), True = a real token; values
at masked positions are never read. Log-probabilities in, float64 works; weights come back in the
log-probabilities' dtype, 0 at masked positions, detached.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proximal.core.ranges import check
from proximal.core.stats import check_mask

#: ``rollout.correction`` values; see the module docstring.
CORRECTIONS = ("none", "tis", "token_mask", "seq_mask", "bypass")
#: The correction band when none is configured: IcePop's token band, verl's Geo-RS sequence band
#: (``RolloutCorrectionConfig.decoupled_geo_rs``: "0.999_1.001", which on −log ρ̄ keeps
#: ρ̄ ∈ [1/1.001, 1/0.999]: this band to 1e-6 at each edge).
DEFAULT_TOKEN_BAND = (0.5, 2.0)
DEFAULT_SEQUENCE_BAND = (0.999, 1.001)
#: TIS's cap C when none is configured: verl's ``rollout_is_threshold``.
DEFAULT_CAP = 2.0


def log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log ρ_t = log π_old(y_t|s_t) − log μ(y_t|s_t), (B, T); 0 at masked positions.

    Args:
        old_logprobs: log π_old, (B, T).
        behaviour_logprobs: log μ, the engine's, (B, T).
        response_mask: bool (B, T).
    """
    check_mask(old_logprobs, response_mask, "response_mask")
    if behaviour_logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"behaviour_logprobs shape {tuple(behaviour_logprobs.shape)} != old_logprobs shape "
            f"{tuple(old_logprobs.shape)}"
        )
    dtype = torch.promote_types(old_logprobs.dtype, behaviour_logprobs.dtype)
    old, mu = old_logprobs.detach().to(dtype), behaviour_logprobs.detach().to(dtype)
    return torch.where(response_mask, old - mu, 0.0)


def check_band(band: tuple[float, float]) -> tuple[float, float]:
    """``band`` = (lo, hi) if 0 < lo ≤ 1 ≤ hi < ∞ (a ratio of 1, μ = π_old, is always inside);
    ValueError otherwise."""
    if len(band) != 2:
        raise ValueError(f"a correction band is two numbers [lo, hi], got {list(band)}")
    lo, hi = (float(x) for x in band)
    check("correction_band_low", lo)
    check("correction_band_high", hi)
    return lo, hi


def mismatch_stats(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    band: tuple[float, float] = DEFAULT_TOKEN_BAND,
    quantile: float = 0.99,
) -> dict[str, Tensor]:
    """How far μ is from π_old on the sampled tokens, over the N valid tokens (float64 scalars)::

        mismatch_k1 = 1/N Σ −log ρ_t                 (k1 estimate of KL(μ ‖ π_old): the tokens came from μ)
        mismatch_k3 = 1/N Σ (ρ_t − 1 − log ρ_t)       (k3: ≥ 0 token by token)
        ratio_max, ratio_min = max_t ρ_t, min_t ρ_t
        ratio_p99 = the ``quantile`` of {ρ_t} (linear interpolation between order statistics)
        outside_band_frac = 1/N Σ 1[ρ_t ∉ [lo, hi]]

    verl's ``rollout_corr/kl`` and ``k3_kl`` are the first two. An empty mask gives NaN everywhere.

    Args:
        old_logprobs: log π_old, (B, T).
        behaviour_logprobs: log μ, (B, T).
        response_mask: bool (B, T).
        band: [lo, hi] of the outside-band fraction (:func:`check_band`).
        quantile: q ∈ (0, 1) of ``ratio_p99``.
    """
    lo, hi = check_band(band)
    lr = log_ratio(old_logprobs, behaviour_logprobs, response_mask).double()[response_mask]
    if lr.numel() == 0:
        nan = torch.tensor(math.nan, dtype=torch.float64)
        return dict.fromkeys(
            (
                "mismatch_k1",
                "mismatch_k3",
                "ratio_max",
                "ratio_min",
                "ratio_p99",
                "outside_band_frac",
            ),
            nan,
        )
    ratio = torch.exp(lr)
    outside = (ratio < lo) | (ratio > hi)
    return {
        "mismatch_k1": (-lr).mean(),
        "mismatch_k3": (torch.expm1(lr) - lr).mean(),
        "ratio_max": ratio.max(),
        "ratio_min": ratio.min(),
        "ratio_p99": torch.quantile(ratio, quantile),
        "outside_band_frac": outside.double().mean(),
    }


def tis_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    cap: float = DEFAULT_CAP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (Yao et al. 2025), per token::

        w_t = min(ρ_t, C) = exp(min(log ρ_t, log C))

    The truncation bounds the variance a rare token with μ ≪ π_old would add; tokens with ρ_t < 1
    are down-weighted as importance sampling says. Computed in log space, so no overflow.

    Returns:
        ``(w, stats)``: w (B, T), detached, 0 at masked positions; stats ``truncated_frac``
        (fraction of valid tokens with ρ_t > C) and ``weight_mean`` (mean w over valid tokens).
    """
    check("correction_cap", cap)
    lr = log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    w = torch.where(response_mask, torch.exp(torch.clamp(lr, max=math.log(cap))), 0.0)
    return w, _weight_stats(w, response_mask, truncated_frac=(lr > math.log(cap)))


def token_mask_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    band: tuple[float, float] = DEFAULT_TOKEN_BAND,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop's masked importance weight (Ring-1T, 2025), per token::

        w_t = ρ_t · 1[lo ≤ ρ_t ≤ hi]

    A token whose engine and trainer probabilities disagree by more than the band leaves the policy
    loss (its gradient is 0; it still counts in the loss's normaliser, as in IcePop's 1/Σ|o_i|);
    inside the band it carries its importance weight.

    Returns:
        ``(w, stats)``: w (B, T), detached, 0 at masked positions; stats ``masked_frac``
        (fraction of valid tokens outside the band) and ``weight_mean``.
    """
    lo, hi = check_band(band)
    lr = log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    inside = (lr >= math.log(lo)) & (lr <= math.log(hi))
    # exp of a log-ratio inside the band only: an outside one (possibly huge) is never exponentiated
    w = torch.where(response_mask & inside, torch.exp(torch.where(inside, lr, 0.0)), 0.0)
    return w, _weight_stats(w, response_mask, masked_frac=~inside)


def sequence_mask_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    band: tuple[float, float] = DEFAULT_SEQUENCE_BAND,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric-mean rejection of whole responses (verl's Geo-RS, ``seq_mean_k1``)::

        ρ̄_i = exp(1/|o_i| Σ_t log ρ_{i,t})        (the per-token geometric mean of response i)
        w_{i,t} = 1[lo ≤ ρ̄_i ≤ hi]

    The band bounds ρ̄_i; verl's threshold ``'lo_hi'`` bounds −log ρ̄_i, so it is the band
    (1/hi, 1/lo) here (module docstring). Length-normalised, so a long response is not rejected
    for being long (the product Π_t ρ_t drifts with length); a response with no valid token gets
    weight 0.

    Returns:
        ``(w, stats)``: w (B, T), detached, 0 at masked positions; stats ``masked_seq_frac``
        (fraction of responses with a valid token that were rejected) and ``weight_mean``.
    """
    lo, hi = check_band(band)
    lr = log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    n = response_mask.sum(1)
    mean_lr = lr.sum(1) / n.clamp_min(1).to(lr.dtype)  # (B,)
    keep = (mean_lr >= math.log(lo)) & (mean_lr <= math.log(hi)) & (n > 0)
    w = torch.where(response_mask & keep[:, None], 1.0, 0.0).to(lr.dtype)
    rows = n > 0
    rejected = (~keep & rows).double().sum() / rows.sum().clamp_min(1).double()
    stats = _weight_stats(w, response_mask)
    stats["masked_seq_frac"] = rejected
    return w, stats


def correction_weights(
    mode: str,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    *,
    cap: float = DEFAULT_CAP,
    band: tuple[float, float] | None = None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The detached (B, T) weights ``mode`` puts on the policy-gradient term, or None for ``none``
    and ``bypass`` (no weights); ``band`` None = the mode's default (:data:`DEFAULT_TOKEN_BAND`,
    :data:`DEFAULT_SEQUENCE_BAND`). Returns ``(weights, stats)`` as the functions above."""
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: expected one of {', '.join(CORRECTIONS)}")
    if mode == "tis":
        return tis_weights(old_logprobs, behaviour_logprobs, response_mask, cap)
    if mode == "token_mask":
        return token_mask_weights(
            old_logprobs, behaviour_logprobs, response_mask, band or DEFAULT_TOKEN_BAND
        )
    if mode == "seq_mask":
        return sequence_mask_weights(
            old_logprobs, behaviour_logprobs, response_mask, band or DEFAULT_SEQUENCE_BAND
        )
    return None, {}


def sequence_correction_weights(
    mode: str,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    *,
    cap: float = DEFAULT_CAP,
    band: tuple[float, float] | None = None,
) -> Tensor | None:
    """The same corrections for a sequence-level objective (GSPO, whose ratio is the geometric mean
    of the token ratios), one weight per response from the geometric-mean ratio
    ρ̄_i = exp(1/|o_i| Σ_t log ρ_{i,t}), (B,), detached, 0 for a row without a valid token::

        tis:         w_i = min(ρ̄_i, C)
        token_mask:  w_i = ρ̄_i · 1[lo ≤ ρ̄_i ≤ hi]     (band default: the token band [0.5, 2])
        seq_mask:    w_i = 1[lo ≤ ρ̄_i ≤ hi]           (band default: [0.999, 1.001])

    None for ``none`` and ``bypass``."""
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r}: expected one of {', '.join(CORRECTIONS)}")
    if mode in ("none", "bypass"):
        return None
    lr = log_ratio(old_logprobs, behaviour_logprobs, response_mask)
    n = response_mask.sum(1)
    mean_lr = lr.sum(1) / n.clamp_min(1).to(lr.dtype)  # (B,)
    rows = n > 0
    if mode == "tis":
        check("correction_cap", cap)
        return torch.where(rows, torch.exp(torch.clamp(mean_lr, max=math.log(cap))), 0.0)
    lo, hi = check_band(
        band or (DEFAULT_TOKEN_BAND if mode == "token_mask" else DEFAULT_SEQUENCE_BAND)
    )
    inside = (mean_lr >= math.log(lo)) & (mean_lr <= math.log(hi)) & rows
    value = torch.exp(torch.where(inside, mean_lr, 0.0)) if mode == "token_mask" else 1.0
    return torch.where(inside, value, 0.0).to(lr.dtype)


def _weight_stats(w: Tensor, response_mask: Tensor, **fractions: Tensor) -> dict[str, Tensor]:
    """``weight_mean`` and each bool (B, T) of ``fractions`` as its mean over valid tokens
    (float64; 0 for an empty mask)."""
    n = response_mask.sum().clamp_min(1).double()
    stats = {"weight_mean": torch.where(response_mask, w.double(), 0.0).sum() / n}
    for name, flags in fractions.items():
        stats[name] = (flags & response_mask).double().sum() / n
    return stats
