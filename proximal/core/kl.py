"""Per-token KL estimators and the controllers that set the KL coefficient β (Ziegler et al. 2019;
Stiennon et al. 2020; docs/formulas.md, "Per-token KL shaping and the KL controllers").

Notation: B batch size, T response length (see :mod:`proximal.core.stats`).

The estimators follow Schulman's "Approximating KL Divergence" (2020). With samples y_t ~ π_θ and
r = π_ref(y_t | s_t) / π_θ(y_t | s_t), each is an estimate of KL(π_θ ‖ π_ref) at token t:

    k1 = −log r = log π_θ − log π_ref          unbiased, can be negative, high variance (the usual one)
    k2 = ½ (log r)²                              biased, always ≥ 0, low variance
    k3 = (r − 1) − log r                         unbiased, always ≥ 0, low variance

:func:`reference_kl_loss` is GRPO's KL to the reference as a term of the loss (DeepSeekMath eq. 4).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from proximal.core.ranges import check
from proximal.core.stats import check_mask, masked_aggregate, stat_mean

ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the log-probabilities of the sampled tokens.

    Implements the per-token term of Ziegler et al. (2019),
    log π_θ(y_t | x, y_<t) − log π_ref(y_t | x, y_<t) (``"k1"``), which appears as
    r_KL(t) = −β·log(π_θ / π_ref) in the four models' diagram (docs/formulas.md, "The four models")
    and in R_t; ``"k2"`` and ``"k3"`` are the lower-variance alternatives (module docstring).

    Elementwise, so it needs no mask: whatever sits at a padded position stays at that position.
    Callers reduce with a mask (:func:`~proximal.core.advantages.shape_rewards`, ``masked_mean``).
    Nothing is clamped: a huge k3 means the policy really has drifted, and hiding it would mislead.

    Args:
        logprobs: log π_θ(y_t | s_t), (B, T).
        ref_logprobs: log π_ref(y_t | s_t), (B, T).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        (B, T) KL estimate per token.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape "
            f"{tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs  # log π_θ − log π_ref = −log r
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    # k3 = (r − 1) − log r with log r = −log_ratio; expm1 keeps precision when r ≈ 1.
    return torch.expm1(-log_ratio) + log_ratio


def _finite(value: float, name: str) -> float:
    if isinstance(value, Tensor):
        value = value.item()
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _positive(value: float, name: str) -> float:
    value = _finite(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


class FixedKLController:
    """Constant β: ``update`` changes nothing. β = 0 is allowed and switches the penalty off."""

    def __init__(self, beta: float):
        self.beta = _finite(beta, "beta")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")

    def update(self, observed_kl: float, n_steps: int = 1) -> float:
        """Ignore the observation; return β."""
        _finite(observed_kl, "observed_kl")
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = _finite(state["beta"], "state['beta']")


class AdaptiveKLController:
    """The piecewise adaptive rule (Ziegler et al. 2019; Ouyang et al. 2022; docs/formulas.md, "Per-token
    KL shaping and the KL controllers").

    After each training iteration, with d = the observed KL(π_θ ‖ π_ref) and K = ``k_beta``::

        β ← β·(1 + K)   if d > 1.5·d_targ
        β ← β·(1 − K)   if d < d_targ / 1.5
        β ← β           otherwise (boundaries included)

    Which number d is — typically the batch mean of each response's summed per-token KL — is the
    caller's choice; the rule only compares it with ``target``.

    Args:
        init_beta: β₀ > 0 (a multiplicative rule can never leave 0).
        target: d_targ > 0, same units as the observed KL.
        k_beta: K_β ∈ (0, 1); the usual value is 0.1.
    """

    def __init__(self, init_beta: float, target: float, k_beta: float = 0.1):
        self.beta = _positive(init_beta, "init_beta")
        self.target = _positive(target, "target")
        self.k_beta = _positive(k_beta, "k_beta")
        if self.k_beta >= 1:
            raise ValueError(f"k_beta must be in (0, 1), got {self.k_beta}")

    def update(self, observed_kl: float, n_steps: int = 1) -> float:
        """Apply the rule once per call (``n_steps`` is accepted for a uniform interface and
        ignored: the rule is applied once per iteration). Returns the new β."""
        d = _finite(observed_kl, "observed_kl")
        if d > 1.5 * self.target:
            self.beta *= 1 + self.k_beta
        elif d < self.target / 1.5:
            self.beta *= 1 - self.k_beta
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = _positive(state["beta"], "state['beta']")


class ProportionalKLController:
    """Ziegler et al. (2019)'s proportional controller (``lm-human-preferences``' AdaptiveKLController)::

        e = clip(d / d_targ − 1, −0.2, 0.2)
        β ← β·(1 + e·n_steps / horizon)

    where ``n_steps`` is the number of samples (episodes) the update covers. Not the piecewise rule
    above; kept because it is what the original RLHF code ran.

    Args:
        init_beta: β₀ > 0.
        target: d_targ > 0.
        horizon: > 0, in the same unit as ``n_steps`` (Ziegler et al. use 10 000 samples).
    """

    def __init__(self, init_beta: float, target: float, horizon: float):
        self.beta = _positive(init_beta, "init_beta")
        self.target = _positive(target, "target")
        self.horizon = _positive(horizon, "horizon")

    def update(self, observed_kl: float, n_steps: int = 1) -> float:
        """One proportional step covering ``n_steps`` samples; returns the new β."""
        d = _finite(observed_kl, "observed_kl")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(d / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1 + error * n_steps / self.horizon
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = _positive(state["beta"], "state['beta']")


#: The β controllers :func:`make_kl_controller` builds (``kl.controller`` of the PPO config).
KL_CONTROLLERS = ("fixed", "adaptive", "proportional")

KLController = FixedKLController | AdaptiveKLController | ProportionalKLController


def make_kl_controller(
    name: str, *, beta: float, target: float, k_beta: float, horizon: float
) -> KLController:
    """The β controller ``name`` (one of :data:`KL_CONTROLLERS`) starting at β = ``beta``.

    Each takes what its rule uses and ignores the rest: ``fixed`` only β; ``adaptive``
    (:class:`AdaptiveKLController`) the target and ``k_beta``; ``proportional``
    (:class:`ProportionalKLController`) the target and ``horizon``.

    Raises:
        ValueError: for an unknown ``name`` (naming the known ones), or a value the controller
            rejects.
    """
    if name == "fixed":
        return FixedKLController(beta)
    if name == "adaptive":
        return AdaptiveKLController(beta, target, k_beta)
    if name == "proportional":
        return ProportionalKLController(beta, target, horizon)
    raise ValueError(f"unknown KL controller {name!r}; expected one of {KL_CONTROLLERS}")


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
    log(π_ref/π_θ) − 1 per token (DeepSeekMath eq. 4, the term
    :func:`~proximal.core.grpo.grpo_policy_loss` adds to its surrogate), also added by the trainer to
    the objectives that do not carry it (GSPO, CISPO) when ``grpo.kl: loss``.

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
