"""The valid range of every hyperparameter the math takes, stated once.

The functions of :mod:`proximal.core` check their arguments with :func:`check`; the configs check
their fields with :func:`problem` when they are validated, before any model loads. Both read the
same table, so a range added here is enforced in both places and cannot be forgotten in one.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Interval(NamedTuple):
    """A real interval; ``low_open`` / ``high_open`` exclude the end points."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: float) -> bool:
        if not isinstance(x, (int, float)) or math.isnan(x):
            return False
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return above and below

    def __str__(self) -> str:
        lo = "(" if self.low_open else "["
        hi = ")" if self.high_open else "]"
        fmt = lambda v: "∞" if v == math.inf else f"{v:g}"  # noqa: E731
        return f"{lo}{fmt(self.low)}, {fmt(self.high)}{hi}"


INF = math.inf

#: name → (interval, what it is). Names are the keyword arguments of the core functions.
RANGES: dict[str, tuple[Interval, str]] = {
    "clip_eps": (Interval(0, 1, True, True), "PPO/GRPO clip ε"),
    "clip_eps_high": (Interval(0, INF, True, True), "upper clip ε_high (DAPO's clip-higher)"),
    "dual_clip": (Interval(1, INF, True, True), "dual-clip bound c (Ye et al. 2020)"),
    "value_clip_eps": (Interval(0, INF, True, False), "value clip ε_v (∞ turns clipping off)"),
    "gamma": (Interval(0, 1), "discount γ"),
    "lam": (Interval(0, 1), "GAE λ"),
    "beta": (Interval(0, INF, False, True), "KL coefficient β"),
    "kl_target": (Interval(0, INF, True, True), "target KL d_targ"),
    "k_beta": (Interval(0, 1, True, True), "adaptive-controller step K_β"),
    "horizon": (Interval(0, INF, True, True), "proportional-controller horizon"),
    "temperature": (Interval(0, INF, True, True), "sampling temperature τ"),
    "whiten_eps": (Interval(0, INF, False, True), "whitening ε_norm"),
    "dpo_beta": (Interval(0, INF, True, True), "DPO β"),
    "label_smoothing": (Interval(0, 0.5, False, True), "label-noise rate ε"),
    "simpo_beta": (Interval(0, INF, True, True), "SimPO β"),
    "gamma_beta_ratio": (Interval(0, INF, False, True), "SimPO γ/β"),
    "group_eps": (Interval(0, INF, False, True), "group-advantage ε"),
    "correction_cap": (Interval(1, INF, False, True), "rollout correction cap C (TIS)"),
    "correction_band_low": (Interval(0, 1, True, False), "lower end of a rollout correction band"),
    "correction_band_high": (
        Interval(1, INF, False, True),
        "upper end of a rollout correction band",
    ),
}


def problem(name: str, value: float, field: str | None = None) -> str | None:
    """A one-line message if ``value`` is outside ``name``'s range (naming ``field``), else None."""
    interval, what = RANGES[name]
    if value in interval:
        return None
    return f"{field or name} = {value!r} must lie in {interval} ({what})"


def check(name: str, value: float) -> float:
    """``value`` if it is in ``name``'s range; ValueError otherwise."""
    msg = problem(name, value)
    if msg is not None:
        raise ValueError(msg)
    return value
