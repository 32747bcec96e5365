"""The field's standard reward functions, under TRL's names and in TRL's signature, so that a TRL
user's ``reward_funcs`` list carries over (``model.reward_functions:
[proximal.rewards:accuracy_reward, proximal.rewards:think_format_reward]``); docs/rewards.md.

=================================  ============================================  ===================
name                               what it scores                                follows
=================================  ============================================  ===================
``accuracy_reward``                the answer against ``solution``, by           TRL, math-verify
                                   math-verify (1, 0; None: the solution does
                                   not parse)
``think_format_reward``            ``<think>…</think>`` then the answer (1, 0)   TRL
``get_soft_overlong_punishment``   a factory: length over L_max − L_cache        DAPO eq. 13, TRL
                                   (0 down to −1)
``reasoning_gym``                  a reasoning-gym row, by its generator's       reasoning-gym
                                   ``score_answer`` (0…1)
``get_reasoning_gym_reward``       a factory: the same, another answer rule      reasoning-gym
``exact_match``                    the stripped completion against               —
                                   ``solution`` or ``answer`` (1, 0)
=================================  ============================================  ===================

``accuracy_reward`` needs math-verify and the reasoning-gym ones reasoning-gym: the ``reasoning``
extra, ``pip install 'proximal-rlhf[reasoning]'``. Each is imported when first asked for, so the
others work without them, and a missing package is one line naming the install command (an
ImportError, which a config's spec reports as its ConfigError). A factory's arguments come from
``model.reward_function_kwargs`` in a config.
"""

from __future__ import annotations

from typing import Any

from proximal.rewards.rules import (
    exact_match,
    get_soft_overlong_punishment,
    think_format_reward,
)

__all__ = [
    "accuracy_reward",
    "exact_match",
    "get_reasoning_gym_reward",
    "get_soft_overlong_punishment",
    "reasoning_gym",
    "think_format_reward",
]

#: The functions that need an optional package: name → (module of proximal.rewards, package).
_OPTIONAL = {
    "accuracy_reward": ("accuracy", "math-verify"),
    "reasoning_gym": ("gym", "reasoning-gym"),
    "get_reasoning_gym_reward": ("gym", "reasoning-gym"),
}
INSTALL = "pip install 'proximal-rlhf[reasoning]'"


def __getattr__(name: str) -> Any:
    """The functions of :data:`_OPTIONAL`, their module imported on first use (PEP 562)."""
    if name not in _OPTIONAL:
        raise AttributeError(f"module 'proximal.rewards' has no attribute {name!r}")
    module, package = _OPTIONAL[name]
    try:
        if module == "accuracy":
            from proximal.rewards import accuracy as loaded  # lazy: math-verify is optional
        else:
            from proximal.rewards import gym as loaded  # lazy: reasoning-gym is optional
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "proximal":
            raise
        raise ImportError(
            f"proximal.rewards.{name} needs {package} (module {e.name!r} is not installed): {INSTALL}"
        ) from None
    return getattr(loaded, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
