"""Offline preference optimisation: DPO (and its IPO and robust variants) and SimPO, as pure losses.

Notation: B pairs (x, y_w, y_l), y_w the chosen and y_l the rejected response. Every input is one
number per pair, shape (B,): a sequence log-probability from
:func:`~proximal.core.logprobs.sequence_logprobs` — summed over the response tokens (DPO's
``sigmoid`` and ``robust``) or averaged over them (``ipo``, SimPO). The caller picks which; the loss
cannot tell.

DPO (Rafailov et al. 2023) needs no reward model and no sampling: the policy's log-ratio to a frozen
reference π_ref *is* a reward, r̂(x, y) = β·log(π_θ(y | x) / π_ref(y | x)) (eq. 5, up to a term that
depends on x only and cancels in a pair), fitted to the preferences with the Bradley–Terry model of
reward-model training. With

    h = β·[(log π_θ(y_w) − log π_ref(y_w)) − (log π_θ(y_l) − log π_ref(y_l))] = r̂(x, y_w) − r̂(x, y_l)

the losses are, per pair (ε = ``label_smoothing``):

- ``sigmoid`` (DPO, eq. 7): −log σ(h); with ε > 0, conservative DPO (Mitchell 2023):
  −(1 − ε)·log σ(h) − ε·log σ(−h), the expected loss when each label is flipped with probability ε;
- ``robust`` (Chowdhury et al. 2024, rDPO): [−(1 − ε)·log σ(h) + ε·log σ(−h)] / (1 − 2ε), an
  *unbiased* estimate of the clean-label loss under ε label noise;
- ``ipo`` (Azar et al. 2023, eq. 17, with τ = β): (h_IPO − 1/(2β))² where h_IPO is the bracket
  above **without** β, on **per-token-average** log-probabilities (as TRL does). The squared loss
  regresses the log-ratio gap to a fixed target 1/(2β); with sums that target would mean a smaller
  per-token gap for longer responses, so the average makes one β mean the same for every length.
  ε must be 0.

SimPO (Meng et al. 2024) drops the reference: the reward is the length-normalised log-likelihood
r(x, y) = (β/|y|)·log π_θ(y | x) (eq. 4), with a target margin γ (eq. 6):

    loss = −log σ(β·(avg log π_θ(y_w) − avg log π_θ(y_l)) − γ),   γ = (γ/β)·β

parameterised by β and the ratio γ/β, as the official code (``gamma_beta_ratio``) is.

Every loss is the mean over the pairs — or, with ``normalizer`` (the pairs of the whole batch ÷ the
data-parallel ranks), this slice's share of the global-batch mean (:func:`~proximal.core.pair_mean`).
Stats are detached means over *this call's* pairs; a caller accumulating over slices weights them by
the slice's pair count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from proximal.core.losses import pair_mean
from proximal.core.ranges import check

#: ``loss_type`` of :func:`dpo_loss`.
DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")


def _check_pairs(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(tensors.values()))
    if first.dim() != 1 or any(t.shape != first.shape for t in tensors.values()):
        raise ValueError(f"every input must be one value per pair, shape (B,); got {shapes}")
    if first.numel() == 0:
        raise ValueError("empty batch of pairs")


def _reward_stats(
    chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor, rejected_logps: Tensor
) -> dict[str, Tensor]:
    margin = chosen_rewards - rejected_rewards
    return {
        "reward_chosen": chosen_rewards.mean(),
        "reward_rejected": rejected_rewards.mean(),
        "reward_margin": margin.mean(),
        # strictly: a tie (e.g. every pair at step 0 of DPO, where π_θ = π_ref) counts as wrong
        "accuracy": (margin > 0).to(margin.dtype).mean(),
        "logp_chosen": chosen_logps.mean(),
        "logp_rejected": rejected_logps.mean(),
    }


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    *,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss of the module docstring, for minimisation.

    The gradient of ``sigmoid`` (ε = 0) on a pair's log-probabilities is the paper's (§4): ∂loss/∂log
    π_θ(y_w) = −β·σ(−h)/N and ∂loss/∂log π_θ(y_l) = +β·σ(−h)/N, with N the pairs (or
    ``normalizer``): pairs the implicit reward already orders by a wide margin (h ≫ 0) stop pulling.

    Args:
        policy_chosen: log π_θ(y_w | x), with grad, (B,).
        policy_rejected: log π_θ(y_l | x), (B,).
        ref_chosen: log π_ref(y_w | x), detached (frozen or precomputed), (B,).
        ref_rejected: log π_ref(y_l | x), (B,).
        beta: β > 0, the strength of the implicit KL constraint (≈ 0.1 for DPO; IPO's τ).
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: ε ∈ [0, 0.5), the assumed rate of flipped labels (``sigmoid``: conservative
            DPO; ``robust``: the unbiased estimator); must be 0 for ``ipo``.
        normalizer: the number of pairs of the whole batch ÷ the ranks, when this call sees a slice.

    Returns:
        ``(loss, stats)``; stats (means over this call's pairs): ``reward_chosen`` = β·(log π_θ(y_w) −
        log π_ref(y_w)), ``reward_rejected``, ``reward_margin`` (their difference), ``accuracy`` (share
        with margin > 0 strictly), ``logp_chosen`` and ``logp_rejected`` (the policy's inputs).
    """
    _check_pairs(
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    check("dpo_beta", beta)
    check("label_smoothing", label_smoothing)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if loss_type == "ipo" and label_smoothing != 0:
        raise ValueError(
            f"label_smoothing = {label_smoothing}: the ipo loss has no label-noise variant; use 0"
        )
    chosen_ratio = policy_chosen - ref_chosen  # log π_θ(y_w)/π_ref(y_w), (B,)
    rejected_ratio = policy_rejected - ref_rejected  # (B,)
    gap = chosen_ratio - rejected_ratio  # h / β
    eps = label_smoothing
    if loss_type == "ipo":
        per_pair = (gap - 1 / (2 * beta)) ** 2
    elif loss_type == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * gap) - eps * F.logsigmoid(-beta * gap)
    else:  # robust
        per_pair = (-(1 - eps) * F.logsigmoid(beta * gap) + eps * F.logsigmoid(-beta * gap)) / (
            1 - 2 * eps
        )
    loss = pair_mean(per_pair, normalizer)
    with torch.no_grad():
        stats = _reward_stats(
            beta * chosen_ratio.detach(),
            beta * rejected_ratio.detach(),
            policy_chosen.detach(),
            policy_rejected.detach(),
        )
    return loss, stats


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float = 2.0,
    gamma_beta_ratio: float = 0.5,
    *,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO's loss (Meng et al. 2024, eq. 6), for minimisation::

        loss = −log σ(β·avg log π_θ(y_w | x) − β·avg log π_θ(y_l | x) − γ),   γ = gamma_beta_ratio·β

    with avg log π(y | x) = (1/|y|)·Σ_t log π(y_t | x, y_<t). No reference model: the length
    normalisation keeps the reward from favouring long responses, and the margin γ asks the chosen
    response to win by at least γ. The loss depends on the responses only through the two averages.

    Args:
        chosen_avg_logps: avg log π_θ(y_w | x), with grad, (B,) (``sequence_logprobs(average=True)``).
        rejected_avg_logps: avg log π_θ(y_l | x), (B,).
        beta: β > 0, the reward scale (the paper's best settings: 2–10).
        gamma_beta_ratio: γ/β ≥ 0 (the paper: 0.3–0.8, 0.5 by default).
        normalizer: as in :func:`dpo_loss`.

    Returns:
        ``(loss, stats)``; stats as :func:`dpo_loss`'s, with the rewards β·avg log π_θ(y) (eq. 4) and
        ``logp_chosen``/``logp_rejected`` the per-token averages.
    """
    _check_pairs(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    check("simpo_beta", beta)
    check("gamma_beta_ratio", gamma_beta_ratio)
    gamma = gamma_beta_ratio * beta
    per_pair = -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma)
    loss = pair_mean(per_pair, normalizer)
    with torch.no_grad():
        c, r = chosen_avg_logps.detach(), rejected_avg_logps.detach()
        stats = _reward_stats(beta * c, beta * r, c, r)
    return loss, stats
