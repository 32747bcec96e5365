"""Shaped token rewards (Ziegler et al. 2019), generalised advantage estimation (Schulman et al. 2015)
and advantage whitening for PPO, and the critic-free baselines of GRPO (group-normalised) and RLOO
(leave-one-out), which give one advantage per response from the scores of the other responses to the
same prompt; the per-token advantages of REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025: token
KL in the reward, returns-to-go, batch whitening) and of the group advantages with the KL as a reward.

Notation: B batch size, T response length; ``response_mask`` is bool (B, T), True = a real
response token (see :mod:`proximal.core.stats`). Batches are right-padded: row b's valid tokens are
columns 0 … n_b − 1, and its last valid token (column n_b − 1) is t = T for that row —
the EOS token when one was generated, otherwise the token at which generation hit the length limit.
For the group baselines, G is the group size: rows g·G … g·G + G − 1 are the G responses to prompt g.
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


def shape_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    beta: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """The augmented token rewards of Ziegler et al. (2019) (docs/formulas.md, "Per-token KL shaping and
    the KL controllers")::

        R_t = −β·KL_t                   for t < T
        R_T = R_ψ(x, y) − β·KL_T         at the last valid token of the row

    with KL_t = :func:`~proximal.core.kl.kl_penalty` (``"k1"`` = log π_θ − log π_ref, the usual one).
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
        raise ValueError(
            f"scores must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}"
        )
    check("beta", float(beta))
    last = last_valid_index(response_mask)  # (B,)
    empty = (last < 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"shape_rewards: rows {empty} have no valid response token to carry the score"
        )
    logprobs = torch.where(response_mask, logprobs, 0.0)
    ref_logprobs = torch.where(response_mask, ref_logprobs, 0.0)
    kl = torch.where(response_mask, kl_penalty(logprobs, ref_logprobs, estimator), 0.0)
    rewards = -beta * kl
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015), the backward recurrence::

        δ_t = R_t + γ·V(s_{t+1}) − V(s_t),        V(s_{T+1}) ≡ 0
        Â_t = δ_t + γλ·Â_{t+1}                      (= Σ_l (γλ)^l δ_{t+l})
        returns_t = Â_t + V(s_t)                     (the value target V_t^targ)

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
        gamma: γ ∈ [0, 1]; the usual default 1.0.
        lam: λ ∈ [0, 1]; the usual default 0.95. λ = 0 gives the TD residual, λ = 1 the
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


def whiten(
    x: Tensor,
    mask: Tensor,
    eps: float = 1e-8,
    keep_mean: bool = False,
    *,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Advantage normalisation over all valid positions (docs/formulas.md, "Generalised advantage
    estimation")::

        x ← (x − μ) / (σ + ε_norm)

    μ and σ are the masked mean and the biased (population, ÷n) standard deviation — see
    :func:`~proximal.core.stats.masked_var`. As the formula writes it, ε is added to σ, not to σ²
    (TRL and torchtune use rsqrt(σ² + ε); the two agree to about ε/(2σ²) relative — 5e-9 at
    σ = 1 — and differ only for nearly constant inputs).

    Args:
        x: (B, T), e.g. advantages.
        mask: bool (B, T).
        eps: ε_norm ≥ 0; the usual 1e-8.
        keep_mean: False (the usual choice) gives zero mean; True adds μ back, scaling only the spread
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


# ----------------------------------------------------------------------------------------------
# Critic-free baselines: GRPO's group-normalised and RLOO's leave-one-out advantages
# ----------------------------------------------------------------------------------------------

#: ``scale`` of :func:`group_advantages`: what the centred score is divided by.
GROUP_SCALES = ("group", "batch", "none")


def _groups(
    scores: Tensor, group_size: int, valid: Tensor | None, what: str
) -> tuple[Tensor, Tensor]:
    """``scores`` and ``valid`` as (n_groups, G), in at least float32; ValueError for a bad layout."""
    if scores.dim() != 1:
        raise ValueError(f"{what}: scores must be (B,), got shape {tuple(scores.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{what}: group_size must be a positive int, got {group_size!r}")
    if scores.numel() == 0 or scores.numel() % group_size:
        raise ValueError(
            f"{what}: {scores.numel()} scores do not split into groups of {group_size}"
        )
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    check_mask(scores, valid, "valid")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    return scores.to(dtype).view(-1, group_size), valid.view(-1, group_size)


def uniform_groups(scores: Tensor, group_size: int, *, valid: Tensor | None = None) -> Tensor:
    """Which groups carry no learning signal: fewer than two distinct valid scores, (n_groups,) bool.

    A group whose valid scores are all equal (or that has fewer than two valid rows) has zero
    advantage in every mode of :func:`group_advantages` and :func:`rloo_advantages`; DAPO's
    dynamic sampling (Yu et al. 2025, §3.2) drops such groups from the update. Equality is exact:
    rule rewards are exact numbers, and a tolerance would hide real (tiny) differences.

    Args:
        scores: (B,) with B = n_groups·G; rows g·G … g·G + G − 1 answer one prompt.
        group_size: G.
        valid: optional bool (B,): rows whose score counts (False = a non-finite score, left out).
    """
    s, m = _groups(scores, group_size, valid, "uniform_groups")
    hi = torch.where(m, s, -torch.inf).max(1).values
    lo = torch.where(m, s, torch.inf).min(1).values
    return (m.sum(1) < 2) | (hi == lo)


def group_advantages(
    scores: Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-4,
    *,
    valid: Tensor | None = None,
) -> Tensor:
    """GRPO's group-relative advantage of each response (Shao et al. 2024, DeepSeekMath, §4.1.2,
    outcome supervision): with r_1 … r_G the scores of the G responses to one prompt,

        Â_i = (r_i − mean(r)) / (std(r) + ε)             scale="group"  (the paper)
        Â_i = (r_i − mean(r)) / (std_batch + ε)          scale="batch"  (std over the whole batch)
        Â_i =  r_i − mean(r)                             scale="none"   (Dr. GRPO, Liu et al. 2025, §3.1)

    Every token of response i gets Â_i. mean and std are over the group's valid rows; std is the
    **sample** standard deviation (÷ (n − 1)), as ``torch.std`` gives it in TRL, verl and OpenRLHF,
    whose numbers users compare with (the project's whitening uses ÷ n, see :func:`whiten`). ε is
    added to std, as TRL does; ε = 1e-4 keeps a group of nearly equal scores from exploding.

    "batch" keeps the group mean as the baseline and divides by the standard deviation of every
    valid score of the batch (TRL's ``scale_rewards="batch"``): groups whose scores hardly differ
    then get small advantages instead of being blown up to unit scale.

    A group whose valid scores are all equal (:func:`uniform_groups`) gets exactly 0 in every mode
    — not round-off, not NaN — and so does every invalid row.

    Args:
        scores: (B,) total scores, B = n_groups·G; rows g·G … g·G + G − 1 answer prompt g.
        group_size: G ≥ 1.
        scale: one of :data:`GROUP_SCALES`.
        eps: ε ≥ 0.
        valid: optional bool (B,); False rows (non-finite scores) are left out of every statistic
            and get advantage 0. Values there are never read.

    Returns:
        (B,) advantages in at least float32.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {GROUP_SCALES}")
    check("group_eps", eps)
    s, m = _groups(scores, group_size, valid, "group_advantages")
    s = torch.where(m, s, 0.0)
    n = m.sum(1, keepdim=True)  # (n_groups, 1)
    mean = s.sum(1, keepdim=True) / n.clamp_min(1)
    centred = torch.where(m, s - mean, 0.0)  # (n_groups, G)
    if scale == "none":
        adv = centred
    else:
        if scale == "group":
            sq, count = (centred * centred).sum(1, keepdim=True), n
        else:  # the batch's own mean and sample std, over every valid row
            flat, n_all = s[m], m.sum()
            dev = flat - flat.sum() / n_all.clamp_min(1)
            sq, count = (dev * dev).sum(), n_all
        std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), 0.0)
        adv = centred / (std + eps)
    keep = m & ~uniform_groups(scores, group_size, valid=valid)[:, None]
    return torch.where(keep, adv, 0.0).reshape(-1)


def rloo_advantages(scores: Tensor, group_size: int, *, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, RLOO): each response's
    baseline is the mean score of the **other** responses to its prompt,

        Â_i = r_i − 1/(n − 1) · Σ_{j ≠ i} r_j  = n/(n − 1) · (r_i − mean(r))

    with n the group's valid rows. The baseline does not depend on r_i, so the policy gradient stays
    unbiased (GRPO's own mean does depend on it). Uniform groups, groups with fewer than two valid
    rows and invalid rows get exactly 0.

    Args:
        scores: (B,), B = n_groups·G, grouped as in :func:`group_advantages`.
        group_size: G ≥ 2.
        valid: optional bool (B,), as in :func:`group_advantages`.

    Returns:
        (B,) advantages in at least float32.
    """
    if isinstance(group_size, int) and group_size < 2:
        raise ValueError(
            f"rloo_advantages: group_size must be ≥ 2 (a leave-one-out baseline needs another "
            f"response), got {group_size}"
        )
    s, m = _groups(scores, group_size, valid, "rloo_advantages")
    s = torch.where(m, s, 0.0)
    n = m.sum(1, keepdim=True)
    others = (s.sum(1, keepdim=True) - s) / (n - 1).clamp_min(1)  # mean of the other valid rows
    keep = m & ~uniform_groups(scores, group_size, valid=valid)[:, None]
    return torch.where(keep, s - others, 0.0).reshape(-1)


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
