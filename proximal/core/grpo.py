"""The critic-free policy loss of GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025) and DAPO (Yu et
al. 2025); RLOO (Ahmadian et al. 2024) uses it with leave-one-out advantages. And what comes before
it in a step: each response's advantage and DAPO's filters of the rows to train on
(:func:`grpo_advantages`).

Notation: B batch size (responses; G per prompt), T response length; ``response_mask`` is bool
(B, T), True = a real response token (see :mod:`proximal.core.stats`). The loss is returned for
minimisation, with detached stats.

What differs from PPO's :func:`~proximal.core.losses.ppo_policy_loss`: the advantage is one number
per response (from :func:`~proximal.core.advantages.group_advantages` or
:func:`~proximal.core.advantages.rloo_advantages`, no critic, no GAE); the clip interval may be
asymmetric (DAPO's clip-higher); and the KL to the reference is a term of the loss, estimated with
k3 per token, instead of a penalty folded into the reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proximal.core.advantages import group_advantages, rloo_advantages, uniform_groups
from proximal.core.kl import reference_kl_loss
from proximal.core.ranges import check
from proximal.core.stats import check_mask
from proximal.core.surrogate import clipped_surrogate_loss


def grpo_advantages(
    scores: Tensor,
    valid: Tensor,
    ended: Tensor,
    group_size: int,
    *,
    scale: str | None,
    eps: float,
    skip_uniform_groups: bool,
    mask_truncated: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One advantage per response from its group's scores, and the responses the update trains on.

    The advantage is :func:`~proximal.core.advantages.group_advantages` with ``scale`` (one of
    ``GROUP_SCALES``: GRPO's ``"group"``, ``"batch"``, Dr. GRPO's ``"none"``), or with ``scale`` None
    RLOO's :func:`~proximal.core.advantages.rloo_advantages`; its statistics are over each group's
    valid rows. The rows to train on are the valid rows, less two filters of DAPO (Yu et al. 2025):

    - ``skip_uniform_groups`` (dynamic sampling, §3.2, without its over-sampling to refill the
      batch): every row of a group whose valid scores are all equal
      (:func:`~proximal.core.advantages.uniform_groups`). Their advantage is 0 already; left in,
      they would only dilute the loss's normaliser and carry the KL term.
    - ``mask_truncated`` (overlong filtering, §3.4): every response that ran out of tokens without
      a stop (``ended`` False). It still counts in its group's mean and std — the score it got is
      real, only its credit assignment is doubtful — so the advantages do not depend on this flag.

    Args:
        scores: (B,) total scores, B = n_groups·G; rows g·G … g·G + G − 1 answer prompt g. Values
            of invalid rows are never read.
        valid: bool (B,), rows with a finite score.
        ended: bool (B,), rows whose response stopped (EOS or a stop) before the length limit.
        group_size: G.
        scale: as above.
        eps: ε added to the std by the two scaled modes.
        skip_uniform_groups, mask_truncated: the filters above.

    Returns:
        ``(advantages, train, uniform)``: (B,) advantages in at least float32 (0 on invalid rows and
        uniform groups), (B,) bool rows to train on (a subset of ``valid``), (n_groups,) bool
        uniform groups.
    """
    if ended.shape != scores.shape or ended.dtype != torch.bool:
        raise ValueError(
            f"ended must be bool of the scores' shape {tuple(scores.shape)}, got {ended.dtype} "
            f"of shape {tuple(ended.shape)}"
        )
    uniform = uniform_groups(scores, group_size, valid=valid)
    if scale is None:
        advantages = rloo_advantages(scores, group_size, valid=valid)
    else:
        advantages = group_advantages(scores, group_size, scale, eps, valid=valid)
    train = valid
    if skip_uniform_groups:
        train = train & ~uniform.repeat_interleave(group_size)
    if mask_truncated:
        train = train & ended
    return advantages, train, uniform


def grpo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 0.04,
    aggregation: str = "seq-mean-token-mean",
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
    kl_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The negated GRPO objective (DeepSeekMath eq. 3), per token i, t::

        ρ_{i,t} = exp(log π_θ(o_{i,t} | q, o_{i,<t}) − log π_old(o_{i,t} | q, o_{i,<t}))
        ℓ_{i,t} = −min(ρ_{i,t}·Â_i, clip(ρ_{i,t}, 1 − ε, 1 + ε_high)·Â_i) + β·k3_{i,t}
        k3_{i,t} = π_ref/π_θ − log(π_ref/π_θ) − 1 = exp(ref − logπ) − (ref − logπ) − 1     (DeepSeekMath eq. 4)

    that is, the clipped surrogate (:func:`~proximal.core.surrogate.clipped_surrogate_loss`) plus
    the KL term to the reference (:func:`~proximal.core.kl.reference_kl_loss`), each reduced by
    ``aggregation`` (:func:`~proximal.core.stats.masked_aggregate`):

    - ``"seq-mean-token-mean"``: 1/G Σ_i 1/|o_i| Σ_t ℓ_{i,t} — the paper's eq. 3. A token's weight is
      1/|o_i|: short correct answers are pushed up harder, long wrong ones pushed down more gently
      (the length bias Dr. GRPO, §3.1, points out);
    - ``"seq-mean-token-sum-norm"``: 1/G Σ_i Σ_t ℓ_{i,t} / L with L = ``max_length`` — Dr.
      GRPO's fix: every token weighs 1/(G·L) whatever its response's length;
    - ``"token-mean"``: Σ_{i,t} ℓ_{i,t} / Σ_i |o_i| — DAPO's token-level loss (§3.3).

    The k3 term is an unbiased estimate of KL(π_θ ‖ π_ref) from tokens sampled by π_θ, ≥ 0, with
    gradient β·(1 − π_ref/π_θ)·∇log π_θ. ε_high > ε (DAPO's clip-higher, 0.28 with ε = 0.2) lets
    low-probability tokens with Â > 0 grow further before the clip, against entropy collapse.

    Where the clipped term is the smaller (Â > 0 and ρ > 1 + ε_high, or Â < 0 and ρ < 1 − ε) the
    surrogate's gradient is exactly 0. On-policy (π_θ = π_old, the first update of a batch with
    μ = 1) ρ = 1 and the surrogate's gradient is the REINFORCE-with-baseline gradient −Â_i·∇log π_θ,
    weighted by the aggregation.

    ``dual_clip`` and ``is_weights`` act on the surrogate part only, as in
    :func:`~proximal.core.losses.ppo_policy_loss`: ℓ_{i,t} = −w_{i,t}·min(ρ·Â, clip(ρ)·Â) (for
    Â < 0 first bounded by c·|Â|) + β·k3_{i,t} — the KL term is neither bounded nor reweighted.

    Args:
        logprobs: log π_θ(o_t | s_t) under the current parameters (with grad), (B, T).
        old_logprobs: log π_old, recorded when the responses were sampled, (B, T).
        ref_logprobs: log π_ref, (B, T); may be None when ``beta`` = 0 (no reference is needed).
        advantages: Â, (B,) one per response (broadcast over its tokens) or (B, T); detached.
        response_mask: bool (B, T).
        clip_eps_low: ε ∈ (0, 1), the lower side of the interval (``grpo.clip_eps``).
        clip_eps_high: ε_high > 0, the upper side; None = ``clip_eps_low`` (symmetric, the paper's).
        beta: β ≥ 0, the KL coefficient (DeepSeekMath: 0.04; DAPO and Dr. GRPO: 0).
        aggregation: see above.
        max_length: L, needed by ``"seq-mean-token-sum-norm"`` (the generation budget T_max).
        normalizer: the aggregation's unit count over the whole batch when this call sees a
            micro-batch or one rank's share (:func:`~proximal.core.stats.masked_aggregate`).
        dual_clip: c > 1, dual-clip PPO's bound for Â < 0 (Ye et al. 2020); None = off.
        is_weights: w ≥ 0, (B, T), detached per-token weights on the surrogate; None = all 1.
        kl_logprobs: log π_θ for the k3 term (with grad), (B, T), where it differs from the
            surrogate's ``logprobs``: under a replayed top-k/top-p filter the ratio is on the
            truncated support and the KL on the full softmax (the KL compares policies, not
            sampling procedures); None = ``logprobs``.

    Returns:
        ``(loss, stats)``: :func:`~proximal.core.surrogate.surrogate_stats` over the valid tokens
        (``pg_loss`` the clipped surrogate part, ``clipfrac_low`` Â < 0 clipped at 1 − ε,
        ``clipfrac_high`` Â > 0 clipped at 1 + ε_high, ``approx_kl`` k3 of KL(π_old ‖ π_θ), …), and
        ``kl_loss`` (the β·k3 part, aggregated like the loss: loss = pg_loss + kl_loss) and
        ``kl_ref`` (the token mean of k3 to the reference; 0 without one).
    """
    check_mask(logprobs, response_mask, "response_mask")
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    if advantages.shape == logprobs.shape[:1]:
        advantages = advantages[:, None].expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be (B,) or (B, T) = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    check("beta", float(beta))
    if beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"grpo_policy_loss: beta = {beta} needs ref_logprobs (pass beta=0 to train without a reference)"
        )

    pg_loss, stats = clipped_surrogate_loss(
        logprobs,
        old_logprobs,
        # in the log-ratio's dtype, as GSPO and CISPO take them
        advantages.to(torch.promote_types(logprobs.dtype, old_logprobs.dtype)),
        response_mask,
        clip_eps_low=clip_eps_low,  # both checked there
        clip_eps_high=clip_eps_low if clip_eps_high is None else clip_eps_high,
        aggregation=aggregation,
        max_length=max_length,
        normalizer=normalizer,
        dual_clip=dual_clip,
        is_weights=is_weights,
    )
    kl_loss, kl_ref = torch.zeros_like(pg_loss), stats["pg_loss"].new_zeros(())
    if ref_logprobs is not None:
        kl, kl_ref = reference_kl_loss(
            logprobs if kl_logprobs is None else kl_logprobs,
            ref_logprobs,
            response_mask,
            float(beta),
            aggregation,
            max_length=max_length,
            normalizer=normalizer,
        )
        if beta > 0:  # β = 0 leaves the reference out of the graph (0·inf would be NaN)
            kl_loss = kl
    loss = pg_loss + kl_loss
    return loss, {**stats, "kl_loss": kl_loss.detach(), "kl_ref": kl_ref}
