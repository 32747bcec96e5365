"""The policy-gradient objectives that followed GRPO, on the same core: GSPO and GSPO-token (Zheng et
al. 2025, the sequence-level ratio of Qwen3's training), CISPO (MiniMax-M1, 2025, a clipped
stop-gradient importance weight on REINFORCE) and the advantages of REINFORCE++ and
REINFORCE++-baseline (Hu et al. 2025: token KL in the reward, returns-to-go, batch whitening).
Dual-clip PPO (Ye et al. 2020) is a keyword argument of :func:`~proximal.core.losses.ppo_policy_loss`
and :func:`~proximal.core.grpo.grpo_policy_loss`.

Notation: B batch size (responses; G per prompt where there are groups), T response length, |o_i|
the valid tokens of response i; ``response_mask`` is bool (B, T), True = a real response token (see
:mod:`proximal.core.stats`). Losses are returned for minimisation, with detached stats;
docs/formulas.md writes out every equation and names the function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proximal.core.advantages import gae, group_advantages, last_valid_index, whiten
from proximal.core.kl import kl_penalty
from proximal.core.losses import weight_tokens
from proximal.core.ranges import check
from proximal.core.stats import check_mask, masked_aggregate, stat_mean


def _check_pair(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> None:
    check_mask(logprobs, response_mask, "response_mask")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )


def _token_advantages(
    advantages: Tensor, logprobs: Tensor, allow_tokens: bool, what: str
) -> Tensor:
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
    clip_eps: float,
    clip_eps_high: float | None = None,
    *,
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
        clip_eps: ε ∈ (0, 1), the lower side (s ≥ 1 − ε); the paper: 3e-4.
        clip_eps_high: ε_high > 0, the upper side; None = ``clip_eps``; the paper: 4e-4.
        token_level: GSPO-token instead of GSPO.
        is_weights: w_i ≥ 0, (B,) detached sequence weights (e.g. a rollout correction); None = 1.
        normalizer: G over the whole batch (> 0), see above.

    Returns:
        ``(loss, stats)``. Stats are means over the responses with a valid token (so a trainer
        weighs them by that count): ``pg_loss`` (= loss), ``clipfrac_low`` (Â < 0 and the clip at
        1 − ε zeroed the gradient) and ``clipfrac_high`` (Â > 0 and the clip at 1 + ε_high; for
        GSPO-token, a response's fraction of such tokens), ``ratio_mean`` (of s_i),
        ``approx_kl`` (each response's mean k3 estimate of KL(π_old ‖ π_θ)), ``advantage_mean``;
        extremes over those responses ``ratio_min``, ``ratio_max``, ``advantage_min``,
        ``advantage_max`` (±inf when there is none).
    """
    _check_pair(logprobs, old_logprobs, response_mask)
    per_response = advantages.shape == logprobs.shape[:1]
    seq_adv = advantages if per_response else None  # (B,) as given: no round-off from a token mean
    advantages = _token_advantages(advantages, logprobs, token_level, "gspo_policy_loss")
    check("clip_eps", clip_eps)
    clip_eps_high = clip_eps if clip_eps_high is None else check("clip_eps_high", clip_eps_high)

    n = response_mask.sum(1)  # |o_i|, (B,)
    rows = n > 0  # the responses that count
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0.0)
    log_s = log_ratio.sum(1) / n.clamp_min(1)  # (B,), 0 for an empty row
    weights = _sequence_weights(is_weights, rows, log_s.dtype)
    advantages = torch.where(response_mask, advantages.to(log_s.dtype), 0.0)
    if seq_adv is not None:
        seq_adv = torch.where(rows, seq_adv.to(log_s.dtype), 0.0)
    low, high = 1 - clip_eps, 1 + clip_eps_high
    if token_level:
        # value s_i, gradient s_i·∇log π_θ(o_t): log π_θ − sg[log π_θ] is 0 in value; adding sg[log s_i]
        # last keeps the value exact (verl#2775 orders it the same way)
        lp = torch.where(response_mask, logprobs, 0.0)
        ratio = torch.exp(lp - lp.detach() + log_s.detach()[:, None])  # (B, T)
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, low, high) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        per_seq = torch.where(response_mask, per_token, 0.0).sum(1) / n.clamp_min(1)
        flattened = torch.where(response_mask, clipped < unclipped, False)
        frac = lambda sel: (flattened & sel).sum(1).to(log_s.dtype) / n.clamp_min(1)  # noqa: E731
        clip_low, clip_high = frac(advantages < 0), frac(advantages > 0)
        if seq_adv is None:  # for the stats only
            seq_adv = torch.where(rows, advantages.sum(1) / n.clamp_min(1), 0.0)
    else:
        s = torch.exp(log_s)
        unclipped = s * seq_adv
        clipped = torch.clamp(s, low, high) * seq_adv
        per_seq = -torch.minimum(unclipped, clipped)
        flattened = clipped < unclipped
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
        s = torch.exp(log_s.detach())
        zeros = torch.zeros_like(log_ratio)
        # samples come from π_old, so kl_penalty's "policy" is π_old and its "reference" π_θ
        k3 = kl_penalty(-log_ratio.detach(), zeros, "k3")
        seq_k3 = torch.where(response_mask, k3, 0.0).sum(1) / n.clamp_min(1)
        rows_f = rows.to(s.dtype)
        count = rows_f.sum().clamp_min(1)
        mean = lambda x: (torch.where(rows, x.to(s.dtype), 0.0)).sum() / count  # noqa: E731
        stats = {
            "pg_loss": loss.detach(),
            "clipfrac_low": mean(clip_low),
            "clipfrac_high": mean(clip_high),
            "ratio_mean": mean(s),
            "ratio_min": torch.where(rows, s, math.inf).min(),
            "ratio_max": torch.where(rows, s, -math.inf).max(),
            "approx_kl": mean(seq_k3),
            "advantage_mean": mean(seq_adv),
            "advantage_min": torch.where(rows, seq_adv, math.inf).min(),
            "advantage_max": torch.where(rows, seq_adv, -math.inf).max(),
        }
    return loss, stats


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps_high: float,
    clip_eps_low: float | None = None,
    *,
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
        clip_eps_high: ε_high > 0.
        clip_eps_low: ε_low ∈ (0, 1), or None = no lower clip (the paper's choice).
        is_weights: w ≥ 0, (B, T) detached per-token weights (rollout correction); None = 1.
        normalizer: Σ|o_i| over the whole batch when this call sees a micro-batch or one rank's
            share (:func:`~proximal.core.stats.masked_aggregate`, ``"token-mean"``).

    Returns:
        ``(loss, stats)``. Token means over valid tokens: ``clipfrac_high`` (r > 1 + ε_high: the
        weight capped), ``clipfrac_low`` (r < 1 − ε_low: raised), ``ratio_mean``, ``approx_kl``
        (k3 estimate of KL(π_old ‖ π_θ)), ``advantage_mean``; ``pg_loss`` (= loss); extremes
        ``ratio_min``, ``ratio_max``, ``advantage_min``, ``advantage_max``.
    """
    _check_pair(logprobs, old_logprobs, response_mask)
    advantages = _token_advantages(advantages, logprobs, True, "cispo_policy_loss")
    check("clip_eps_high", clip_eps_high)
    if clip_eps_low is not None:
        check("clip_eps", clip_eps_low)
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0.0)
    advantages = torch.where(response_mask, advantages.to(log_ratio.dtype), 0.0)
    ratio = torch.exp(log_ratio.detach())
    low = None if clip_eps_low is None else 1 - clip_eps_low
    weight = torch.clamp(ratio, low, 1 + clip_eps_high)  # sg[r̂], (B, T)
    lp = torch.where(response_mask, logprobs, 0.0)
    per_token = weight_tokens(-weight * advantages * lp, is_weights, response_mask)
    loss = masked_aggregate(per_token, response_mask, "token-mean", normalizer=normalizer)

    with torch.no_grad():
        zeros = torch.zeros_like(log_ratio)
        lo = torch.zeros_like(ratio, dtype=torch.bool) if low is None else ratio < low
        stats = {
            "pg_loss": loss.detach(),
            "clipfrac_low": stat_mean(lo.to(ratio.dtype), response_mask),
            "clipfrac_high": stat_mean((ratio > 1 + clip_eps_high).to(ratio.dtype), response_mask),
            "ratio_mean": stat_mean(ratio, response_mask),
            "ratio_min": torch.where(response_mask, ratio, math.inf).min(),
            "ratio_max": torch.where(response_mask, ratio, -math.inf).max(),
            "approx_kl": stat_mean(kl_penalty(-log_ratio.detach(), zeros, "k3"), response_mask),
            "advantage_mean": stat_mean(advantages, response_mask),
            "advantage_min": torch.where(response_mask, advantages, math.inf).min(),
            "advantage_max": torch.where(response_mask, advantages, -math.inf).max(),
        }
    return loss, stats


def returns_to_go(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """The discounted return from each valid token on, within its row::

        G_t = Σ_{t' ≥ t valid} γ^{k(t, t')} · R_{t'}

    with k(t, t') the number of valid steps from t to t' (masked positions are not steps: the same
    convention as :func:`~proximal.core.advantages.gae`, which this is with V ≡ 0 and λ = 1).

    Args:
        rewards: R_t, (B, T); values at masked positions never read.
        response_mask: bool (B, T).
        gamma: γ ∈ [0, 1].

    Returns:
        (B, T) in at least the rewards' dtype, 0 at masked positions.
    """
    return gae(rewards, torch.zeros_like(rewards), response_mask, gamma=gamma, lam=1.0)[0]


def reinforce_pp_advantages(
    scores: Tensor,
    kl: Tensor,
    response_mask: Tensor,
    beta: float,
    gamma: float = 1.0,
    baseline: bool = False,
    group_size: int | None = None,
    *,
    valid: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ advantages (Hu et al. 2025, "REINFORCE++"), per token::

        r_{i,t} = −β·kl_{i,t} + [t = last valid token of i]·ŝ_i      (the KL in the reward)
        G_{i,t} = Σ_{t' ≥ t} γ^{t'−t}·r_{i,t'}                       (returns-to-go, :func:`returns_to_go`)
        Â_{i,t} = (G_{i,t} − mean(G)) / (std(G) + ε)                 (over every valid token of the batch)

    with ŝ_i = s_i (REINFORCE++) or, with ``baseline``, s_i − mean of its group's valid scores
    (REINFORCE++-baseline: the group mean subtracted, GRPO's centring without its std, then the
    batch normalisation — :func:`~proximal.core.advantages.group_advantages` with ``scale="none"``,
    then :func:`~proximal.core.advantages.whiten`). The global normalisation replaces a critic and
    keeps a prompt with uniformly high scores from dominating; mean and std are the population
    (÷ n) statistics of :func:`~proximal.core.advantages.whiten`, ε added to the std.

    Args:
        scores: s_i, (B,) total scores; B = n_groups·G with ``baseline`` (rows g·G … g·G + G − 1
            answer prompt g). Values of invalid rows never read.
        kl: per-token KL estimate to the reference, (B, T) (e.g. k1 = log π_old − log π_ref on the
            sampled tokens). Values at masked positions, and every value when β = 0, never read.
        response_mask: bool (B, T); every valid row needs a valid token (where else would its score go?).
        beta: β ≥ 0.
        gamma: γ ∈ [0, 1]; REINFORCE++ uses 1.
        baseline: REINFORCE++-baseline (needs ``group_size``).
        group_size: G for ``baseline``.
        valid: optional bool (B,), rows with a finite score; the others get 0 and are left out of
            the statistics.
        eps: ε ≥ 0 of the whitening.

    Returns:
        (B, T) advantages in at least float32, 0 at masked positions and invalid rows.
    """
    check_mask(kl, response_mask, "response_mask")
    if kl.dim() != 2:
        raise ValueError(f"kl must be (B, T), got shape {tuple(kl.shape)}")
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores must be (B,) = {tuple(kl.shape[:1])}, got {tuple(scores.shape)}")
    check("beta", float(beta))
    check("gamma", gamma)
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    check_mask(scores, valid, "valid")
    mask = response_mask & valid[:, None]
    last = last_valid_index(mask)  # (B,)
    empty = (valid & (last < 0)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"reinforce_pp_advantages: rows {empty} have no valid response token to carry the score"
        )
    if baseline:
        if group_size is None:
            raise ValueError("reinforce_pp_advantages: baseline=True needs group_size")
        scores = group_advantages(scores, group_size, "none", valid=valid)
    dtype = torch.promote_types(torch.promote_types(scores.dtype, kl.dtype), torch.float32)
    # β = 0 never reads kl (the trainer passes zeros, a caller may pass anything)
    rewards = torch.where(mask, -beta * kl.to(dtype), 0.0) if beta > 0 else mask.to(dtype) * 0
    hit = torch.arange(mask.shape[1], device=mask.device)[None, :] == last[:, None]
    rewards = rewards + torch.where(
        hit & mask, torch.where(valid, scores, 0.0).to(dtype)[:, None], 0.0
    )
    return whiten(returns_to_go(rewards, mask, gamma), mask, eps)


def kl_reward_advantages(
    advantages: Tensor, kl: Tensor, response_mask: Tensor, beta: float
) -> Tensor:
    """A per-response advantage with the KL to the reference as a per-token reward (``grpo.kl:
    reward`` for the group advantages)::

        Â_{i,t} = Â_i − β · Σ_{t' ≥ t} kl_{i,t'}

    The group (or leave-one-out) baseline acts on the scores alone, as before; the KL penalty of
    each later token is added as its return-to-go (γ = 1), as OpenRLHF does for its group
    estimators. β = 0 gives Â_i on every valid token.

    Args:
        advantages: Â_i, (B,).
        kl: per-token KL, (B, T) (k1 = log π_old − log π_ref); values at masked positions never read.
        response_mask: bool (B, T).
        beta: β ≥ 0.

    Returns:
        (B, T), 0 at masked positions.
    """
    check_mask(kl, response_mask, "response_mask")
    if advantages.shape != kl.shape[:1]:
        raise ValueError(
            f"advantages must be (B,) = {tuple(kl.shape[:1])}, got {tuple(advantages.shape)}"
        )
    check("beta", float(beta))
    dtype = torch.promote_types(advantages.dtype, kl.dtype)
    kl_return = returns_to_go(torch.where(response_mask, kl.to(dtype), 0.0), response_mask)
    return torch.where(response_mask, advantages.to(dtype)[:, None] - beta * kl_return, 0.0)


def reference_kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    beta: float,
    aggregation: str,
    *,
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO's KL term to the reference as a separate loss, β·agg(k3) with k3 = π_ref/π_θ −
    log(π_ref/π_θ) − 1 per token (DeepSeekMath eq. 4, the same as in
    :func:`~proximal.core.grpo.grpo_policy_loss`), for the objectives that do not carry it (GSPO,
    CISPO) when ``grpo.kl: loss``.

    Args:
        logprobs: log π_θ (with grad), (B, T).
        ref_logprobs: log π_ref, (B, T).
        response_mask: bool (B, T).
        beta: β ≥ 0.
        aggregation, max_length, normalizer: as in :func:`~proximal.core.stats.masked_aggregate`
            (the objective's own aggregation).

    Returns:
        ``(kl_loss, kl_ref)``: the loss term (0 with β = 0, still a graph node) and the detached
        token mean of k3 (for logging).
    """
    check_mask(logprobs, response_mask, "response_mask")
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    check("beta", float(beta))
    k3 = kl_penalty(
        torch.where(response_mask, logprobs, 0.0),
        torch.where(response_mask, ref_logprobs, 0.0),
        "k3",
    )
    loss = beta * masked_aggregate(
        k3, response_mask, aggregation, max_length=max_length, normalizer=normalizer
    )
    return loss, stat_mean(k3.detach(), response_mask)
