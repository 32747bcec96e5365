"""Shaped token rewards (seed §3), generalised advantage estimation and whitening (seed §4).

Notation: B batch size, T response length; ``response_mask`` is bool (B, T), True = a real
response token (see :mod:`proximal.core.stats`). Batches are right-padded: row b's valid tokens are
columns 0 … n_b − 1, and its last valid token (column n_b − 1) is the seed's t = T for that row —
the EOS token when one was generated, otherwise the token at which generation hit the length limit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proximal.core.kl import kl_penalty
from proximal.core.ranges import check
from proximal.core.stats import AllReduce, check_mask, masked_mean_var


def last_valid_index(response_mask: Tensor) -> Tensor:
    """Column of each row's last True in ``response_mask`` (B, T) → (B,) long; −1 for an empty row."""
    T = response_mask.shape[-1]
    cols = torch.arange(T, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask, cols, -1).max(dim=-1).values


def shape_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor,
                  beta: float, estimator: str = "k1") -> tuple[Tensor, Tensor]:
    """The seed's §3 augmented token rewards::

        R_t = −β·KL_t                   for t < T
        R_T = R_ψ(x, y) − β·KL_T         at the last valid token of the row

    with KL_t = :func:`~proximal.core.kl.kl_penalty` (``"k1"`` = log π_θ − log π_ref, the seed's).
    The score goes on the last *valid* token — the EOS slot, never the pad slot after it.

    Args:
        scores: R_ψ(x, y), (B,) — one scalar per response.
        logprobs: log π_θ(y_t | s_t) of the policy that sampled, (B, T).
        ref_logprobs: log π_ref(y_t | s_t), (B, T).
        response_mask: bool (B, T); every row needs at least one valid token (where else would its
            score go?).
        beta: β ≥ 0, the KL coefficient (e.g. a controller's ``.beta``).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``(rewards, kl)``, both (B, T), zero at masked positions; ``kl`` is the per-token estimate
        (before multiplying by β), for logging and for the KL controller.
    """
    check_mask(logprobs, response_mask, "response_mask")
    check_mask(ref_logprobs, response_mask, "response_mask")
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"scores must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    check("beta", float(beta))
    last = last_valid_index(response_mask)  # (B,)
    empty = (last < 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"shape_rewards: rows {empty} have no valid response token to carry the score")
    logprobs = torch.where(response_mask, logprobs, 0.0)
    ref_logprobs = torch.where(response_mask, ref_logprobs, 0.0)
    kl = torch.where(response_mask, kl_penalty(logprobs, ref_logprobs, estimator), 0.0)
    rewards = -beta * kl
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl


def gae(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, the seed's §4 backward recurrence::

        δ_t = R_t + γ·V(s_{t+1}) − V(s_t),        V(s_{T+1}) ≡ 0
        Â_t = δ_t + γλ·Â_{t+1}                      (= Σ_l (γλ)^l δ_{t+l})
        returns_t = Â_t + V(s_t)                     (§6's V_t^targ)

    The mask is applied inside the recursion: a masked position is not a step of the episode. Its
    reward and value are never read, and the "next value" and "next advantage" are carried across it
    unchanged. For a right-padded row this means V(s_{T+1}) ≡ 0 and Â_{T+1} = 0 after the row's last
    valid token, so rows of different lengths share one batch; a mask with holes (e.g. tool output
    inside a response) skips the holes.

    ``values`` and ``rewards`` should be detached: advantages are constants in the policy loss.

    Args:
        rewards: R_t, (B, T) (e.g. from :func:`shape_rewards`).
        values: V_φ(s_t) from the critic at rollout time, (B, T).
        response_mask: bool (B, T).
        gamma: γ ∈ [0, 1]; the seed's default 1.0.
        lam: λ ∈ [0, 1]; the seed's default 0.95. λ = 0 gives the TD residual, λ = 1 the
            Monte-Carlo return minus the baseline.

    Returns:
        ``(advantages, returns)``, both (B, T), zero at masked positions.
    """
    check_mask(rewards, response_mask, "response_mask")
    check_mask(values, response_mask, "response_mask")
    check("gamma", gamma)
    check("lam", lam)
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards = torch.where(response_mask, rewards.to(dtype), 0.0)
    values = torch.where(response_mask, values.to(dtype), 0.0)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])  # V(s_{t+1}) of the next valid step, (B,)
    next_adv = values.new_zeros(values.shape[0])  # Â_{t+1} of the next valid step, (B,)
    for t in reversed(range(values.shape[1])):
        valid = response_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(response_mask, advantages + values, 0.0)
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, keep_mean: bool = False, *,
           all_reduce: AllReduce | None = None) -> Tensor:
    """The seed's §4 advantage normalisation over all valid positions::

        x ← (x − μ) / (σ + ε_norm)

    μ and σ are the masked mean and the biased (population, ÷n) standard deviation — see
    :func:`~proximal.core.stats.masked_var`. As in the seed, ε is added to σ, not to σ²
    (TRL and torchtune use rsqrt(σ² + ε); the two agree to about ε/(2σ²) relative — 5e-9 at
    σ = 1 — and differ only for nearly constant inputs).

    Args:
        x: (B, T), e.g. advantages.
        mask: bool (B, T).
        eps: ε_norm ≥ 0; the seed's 1e-8.
        keep_mean: False (the seed's) gives zero mean; True adds μ back, scaling only the spread
            (a variant used to whiten rewards).
        all_reduce: sums over data-parallel ranks so μ and σ are those of the global batch (see
            :mod:`proximal.core.stats`).

    Returns:
        (B, T) in at least float32, zero at masked positions.

    Raises:
        ValueError: if the (global) mask selects nothing.
    """
    check_mask(x, mask)
    check("whiten_eps", eps)
    mean, var = masked_mean_var(x, mask, all_reduce=all_reduce)
    std = var.sqrt()
    x = torch.where(mask, x.to(mean.dtype), 0.0)
    out = (x - mean) / (std + eps)
    if keep_mean:
        out = out + mean
    return torch.where(mask, out, 0.0)
