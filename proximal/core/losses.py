"""Losses of PPO-based RLHF (Schulman et al. 2017; Ouyang et al. 2022; Bradley & Terry 1952), each a
pure function returning what it minimises.

Notation: B batch size, T response length, V vocabulary size; ``response_mask`` is bool (B, T),
True = a real response token (see :mod:`proximal.core.stats`). Every loss is a quantity to
*minimise*: the papers' objectives are maximised, so ``ppo_policy_loss`` returns −L^CLIP and
``ptx_loss`` returns −L^PTX. Stats are detached tensors for logging.

The actor and critic objectives are combined by the trainer (``proximal/trainers/ppo.py``), not
here: actor loss = −(L^CLIP + c2·S + γ_PTX·L^PTX), critic loss = c1·L^VF. The clipped surrogate
itself, shared with GRPO, is :mod:`proximal.core.surrogate`; the preference losses (DPO, SimPO) are
:mod:`proximal.core.preference`, GRPO's :mod:`proximal.core.grpo`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from proximal.core.logprobs import DEFAULT_CHUNK_TOKENS, logprobs_from_logits, token_entropy
from proximal.core.ranges import RANGES
from proximal.core.stats import AllReduce, check_mask, masked_aggregate, masked_mean_var, stat_mean
from proximal.core.surrogate import clipped_surrogate_loss


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: str = "token-mean",
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The negated clipped surrogate of Schulman et al. (2017) (docs/formulas.md, "The clipped surrogate")::

        r_t = exp(log π_θ(y_t|s_t) − log π_old(y_t|s_t))
        L^CLIP = Ê_t[ min(r_t·Â_t, clip(r_t, 1 − ε, 1 + ε)·Â_t) ]
        loss = −L^CLIP

    :func:`~proximal.core.surrogate.clipped_surrogate_loss` with ε_low = ε_high = ε. Where the
    clipped term is the smaller one (Â > 0 with r > 1 + ε, or Â < 0 with r < 1 − ε) the token's
    gradient is exactly zero; elsewhere it is −r_t·Â_t·∇ log π_θ / n.

    With ``dual_clip`` = c (dual-clip PPO, Ye et al. 2020; verl's ``clip_ratio_c``) a token with
    Â_t < 0 has loss min(−min(r_t·Â_t, clip(r_t)·Â_t), −c·Â_t): bounded by c·|Â_t| however large r_t
    grows (and its gradient then 0); tokens with Â_t ≥ 0 are unchanged. With ``is_weights`` w_t each
    token's term is multiplied by w_t (a detached importance weight, e.g. rollout correction's
    truncated π_old/μ): ℓ_t = −w_t·min(r_t·Â_t, clip(r_t)·Â_t), dual-clipped first.

    Args:
        logprobs: log π_θ(y_t | s_t) under the current parameters (with grad), (B, T).
        old_logprobs: log π_old(y_t | s_t) recorded at rollout time, (B, T).
        advantages: Â_t (whitened or not, detached), (B, T).
        response_mask: bool (B, T).
        clip_eps: ε ∈ (0, 1); usually 0.1–0.2.
        aggregation: ``"token-mean"`` (PPO's Ê_t over all valid tokens),
            ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"`` (see
            :func:`~proximal.core.stats.masked_aggregate`, which also explains ``max_length``).
        normalizer: the aggregation's unit count summed over the whole batch when this call sees
            only a micro-batch or one rank's share (:func:`~proximal.core.stats.masked_aggregate`).
        dual_clip: c > 1, the bound for Â < 0; None = off (Schulman et al.'s L^CLIP).
        is_weights: w ≥ 0, (B, T), detached per-token weights; None = all 1.

    Returns:
        ``(loss, stats)``; stats (:func:`~proximal.core.surrogate.surrogate_stats`, token means over
        valid tokens whatever the aggregation): ``clipfrac`` (fraction of tokens whose gradient
        clipping zeroed; ``clipfrac_low`` + ``clipfrac_high``, those with Â < 0 and Â > 0),
        ``clipfrac_dual`` (fraction whose loss the dual bound c·|Â| replaced; 0 when ``dual_clip`` is
        None), ``approx_kl`` (k3) and ``approx_kl_k1`` (estimates of KL(π_old ‖ π_θ) from the
        sampled tokens), ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``advantage_mean``,
        ``advantage_min``, ``advantage_max``, ``pg_loss`` (= loss).
    """
    return clipped_surrogate_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        clip_eps_low=clip_eps,
        clip_eps_high=clip_eps,
        aggregation=aggregation,
        max_length=max_length,
        normalizer=normalizer,
        dual_clip=dual_clip,
        is_weights=is_weights,
    )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_eps: float = 0.2,
    aggregation: str = "token-mean",
    *,
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped value loss (docs/formulas.md, "The value loss, PTX and the joint objective")::

        V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
        L^VF = ½·Ê_t[ max((V − V^targ)², (V_clip − V^targ)²) ]

    Args:
        values: V_φ(s_t) under the current critic parameters (with grad), (B, T).
        old_values: V_φold(s_t) recorded at rollout time, (B, T).
        returns: V_t^targ = Â_t + V_φold(s_t) (the second output of :func:`~proximal.core.gae`,
            before any whitening of Â), (B, T).
        response_mask: bool (B, T).
        clip_eps: ε_v > 0; ``math.inf`` turns clipping off (plain ½·MSE).
        aggregation, max_length, normalizer: as in :func:`ppo_policy_loss`.

    Returns:
        ``(loss, stats)``; stats: ``vf_clipfrac`` (fraction of valid tokens where clipping is active,
        |V − V_old| > ε_v, and the clipped error is the larger, i.e. the max picked it; inside the
        interval V_clip equals V up to one rounding of V_old + (V − V_old), and counting that
        coin-flip would make the statistic noise), ``explained_variance`` = 1 − Var[R − V] / Var[R]
        over valid tokens (NaN when the returns are constant).
    """
    for name, t in (("old_values", old_values), ("returns", returns)):
        if t.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != values shape {tuple(values.shape)}")
    check_mask(values, response_mask, "response_mask")
    if clip_eps not in RANGES["value_clip_eps"][0]:  # also rejects NaN
        raise ValueError(f"clip_eps must be > 0 (math.inf disables clipping), got {clip_eps}")
    values = torch.where(response_mask, values, 0.0)
    old_values = torch.where(response_mask, old_values, 0.0)
    returns = torch.where(response_mask, returns, 0.0)
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    err = (values - returns) ** 2
    err_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_aggregate(
        torch.maximum(err, err_clipped),
        response_mask,
        aggregation,
        max_length=max_length,
        normalizer=normalizer,
    )

    with torch.no_grad():
        stats = {
            "vf_clipfrac": stat_mean(
                ((err_clipped > err) & ((values - old_values).abs() > clip_eps)).to(err.dtype),
                response_mask,
            ),
            "explained_variance": (
                explained_variance(values.detach(), returns.detach(), response_mask)
                if response_mask.any()
                else torch.tensor(math.nan)
            ),
        }
    return loss, stats


def explained_variance(
    values: Tensor, returns: Tensor, response_mask: Tensor, *, all_reduce: AllReduce | None = None
) -> Tensor:
    """How much of the return the critic predicts: 1 − Var[R − V] / Var[R] over valid tokens.

    1 is a perfect critic, 0 one no better than the mean return, negative worse than that; NaN when
    the returns are constant (the ratio is undefined).

    Args:
        values: V(s_t), (B, T).
        returns: R_t, e.g. the GAE targets V_t^targ, (B, T).
        response_mask: bool (B, T).
        all_reduce: as in :func:`~proximal.core.stats.masked_mean`, for the global batch.

    Returns:
        Scalar tensor.
    """
    _, var_returns = masked_mean_var(returns, response_mask, all_reduce=all_reduce)
    _, var_residual = masked_mean_var(returns - values, response_mask, all_reduce=all_reduce)
    return (
        1 - var_residual / var_returns
        if var_returns > 0
        else torch.full_like(var_returns, math.nan)
    )


def entropy_from_logits(
    logits: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    *,
    aggregation: str = "token-mean",
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Mean policy entropy S[π_θ](s_t) = −Σ_a π_θ(a|s_t) log π_θ(a|s_t) over valid tokens (the
    entropy bonus of Schulman et al. 2017, weighted by c2 in the trainer). Computed a chunk of the
    sequence at a time with a recomputing backward (:func:`~proximal.core.logprobs.token_entropy`),
    so it is affordable to log every step.

    Args:
        logits: (B, T, V); ``logits[:, t]`` is π_θ(· | s_t) for response position t (caller shifts).
        response_mask: bool (B, T).
        temperature: τ > 0; the entropy is that of softmax(logits / τ), the sampling distribution.
        aggregation, max_length, normalizer: as in :func:`ppo_policy_loss`.
        chunk_tokens: see :func:`~proximal.core.logprobs.logprobs_from_logits`.

    Returns:
        Scalar entropy in nats (differentiable).
    """
    per_token = token_entropy(logits, temperature, mask=response_mask, chunk_tokens=chunk_tokens)
    return masked_aggregate(
        per_token, response_mask, aggregation, max_length=max_length, normalizer=normalizer
    )


def token_nll(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor,
    *,
    normalizer: float | Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Mean negative log-likelihood of the masked tokens (temperature 1: the model's likelihood)::

        loss = −(1/n) Σ_{(b,t) ∈ mask} log softmax(logits[b, t])[labels[b, t]]

    with n the number of True positions, or ``normalizer`` when given (the token count of the whole
    batch, for a micro-batch or one rank's share; a slice with no valid token then gives 0).

    The caller aligns: ``logits[:, t]`` must predict ``labels[:, t]`` (for a causal LM pass
    ``out.logits[:, :-1]`` with ``input_ids[:, 1:]`` and the matching mask). Nothing is shifted here.

    Args:
        logits: (B, L, V).
        labels: (B, L) token ids; values where ``mask`` is False (e.g. -100) are never read.
        mask: bool (B, L), True = a token whose likelihood counts.
        normalizer: see above (> 0).
        chunk_tokens: see :func:`~proximal.core.logprobs.logprobs_from_logits`.

    Returns:
        Scalar NLL in nats per token.
    """
    logprobs = logprobs_from_logits(logits, labels, mask=mask, chunk_tokens=chunk_tokens)
    return nll_from_logprobs(logprobs, mask, normalizer=normalizer)


def nll_from_logprobs(
    logprobs: Tensor, mask: Tensor, *, normalizer: float | Tensor | None = None
) -> Tensor:
    """The mean NLL of :func:`token_nll` — and so of :func:`sft_loss` and :func:`ptx_loss` —
    from log-probabilities already computed, −(1/n) Σ_{(b,t) ∈ mask} logprobs[b, t]: for the
    log-probabilities of the fused path (:func:`proximal.core.fused.linear_logprobs`), which never
    forms the logits these take.

    Args:
        logprobs: (B, L) log π(labels | ·), values where ``mask`` is False never read.
        mask: bool (B, L).
        normalizer: as in :func:`token_nll`.

    Returns:
        Scalar NLL in nats per token.
    """
    return -masked_aggregate(logprobs, mask, "token-mean", normalizer=normalizer)


def sft_loss(
    logits: Tensor,
    labels: Tensor,
    response_mask: Tensor,
    *,
    normalizer: float | Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Supervised fine-tuning's objective: the mean NLL of the **response** tokens (and their EOS)
    given the prompt and the response prefix, −(1/n) Σ_t log π_θ(y_t | x, y_<t) — maximum likelihood
    on the demonstrations (Ouyang et al. 2022, §3.5). The prompt is given, never learned: its
    positions are False in ``response_mask``. Same alignment and arguments as :func:`token_nll`.
    """
    return token_nll(
        logits, labels, response_mask, normalizer=normalizer, chunk_tokens=chunk_tokens
    )


def ptx_loss(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor,
    *,
    normalizer: float | Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Negative log-likelihood of pre-training text: −L^PTX, with InstructGPT's (Ouyang et al. 2022)
    L^PTX(θ) = E_{x ~ D_pretrain}[log π_θ(x)], as a mean over valid tokens. Same alignment and
    arguments as :func:`token_nll`.
    """
    return token_nll(logits, labels, mask, normalizer=normalizer, chunk_tokens=chunk_tokens)


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    margin: float | Tensor = 0.0,
    *,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the Bradley–Terry preference model (Bradley & Terry 1952; Christiano
    et al. 2017; Ouyang et al. 2022)::

        P(y_w ≻ y_l | x) = σ(R_ψ(x, y_w) − R_ψ(x, y_l))
        loss = −mean log σ(r_w − r_l − m)

    with an optional margin m (Llama 2's preference-strength margin; 0 gives the plain Bradley–Terry model).
    ``F.logsigmoid`` keeps it finite for any score gap.

    Args:
        chosen_scores: r_w = R_ψ(x, y_w), (B,).
        rejected_scores: r_l = R_ψ(x, y_l), (B,).
        margin: m, a float or a (B,) tensor.
        normalizer: the number of pairs of the whole batch when this call sees a micro-batch or one
            rank's share; the loss is then Σ over these pairs / ``normalizer``.

    Returns:
        ``(loss, stats)``; stats: ``accuracy`` = fraction of pairs with r_w > r_l strictly (a tie
        counts as wrong, so a constant model scores 0, not 0.5; the margin is not used here) and
        ``score_gap`` = mean of r_w − r_l.
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(
            f"chosen_scores and rejected_scores must both be (B,), got "
            f"{tuple(chosen_scores.shape)} and {tuple(rejected_scores.shape)}"
        )
    if chosen_scores.numel() == 0:
        raise ValueError("bradley_terry_loss: empty batch")
    gap = chosen_scores - rejected_scores
    loss = pair_mean(-F.logsigmoid(gap - margin), normalizer)
    with torch.no_grad():
        stats = {
            "accuracy": (gap > 0).to(gap.dtype).mean(),
            "score_gap": gap.mean(),
        }
    return loss, stats


def pair_mean(per_pair: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Mean of a per-pair (or per-sequence) loss, (B,) → scalar: Σ / B, or Σ / ``normalizer`` when the
    caller holds a micro-batch or one rank's share of a larger batch of ``normalizer`` pairs."""
    if normalizer is None:
        if per_pair.numel() == 0:
            raise ValueError("pair_mean: empty batch")
        return per_pair.mean()
    if not float(normalizer) > 0:
        raise ValueError(f"pair_mean: normalizer must be > 0, got {float(normalizer)}")
    return per_pair.sum() / normalizer
