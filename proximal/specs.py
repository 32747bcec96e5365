"""The one way user code named in a config is imported: ``import_spec(spec, what)``.

Reward functions (``model.reward_functions``), tools (``tools.functions[i]``), environments
(``env.factory``) and gold scores are named ``module:name`` in a config file, or given as
callables from Python. :func:`import_spec` imports the one and takes the other as it is, and its
messages name the field being read — ``tools.functions[2] 'no_such:calc': cannot import (...)`` —
so a mistake in one field is never reported as another's.

The working directory goes on ``sys.path`` first (as ``python -m`` does), so a module beside the
config imports. Layer 1: above :mod:`proximal.config` (``ConfigError``, ``PythonObject``), below
everything that loads user code (``rollout/reward_functions.py``, ``agents/``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from proximal.config import ConfigError, PythonObject


def import_spec(spec: str | Callable, what: str) -> Callable:
    """``spec`` imported when it is ``module:name``, taken as it is when it is a callable (or a
    :class:`~proximal.config.PythonObject` holding one).

    Args:
        spec: ``"module:name"`` or a callable.
        what: what is being imported, as messages name it: ``"reward function"``,
            ``"tools.functions[2]"``, ``"env.factory"``.

    Raises:
        ConfigError: ``<what> '<spec>': expected 'module:function'`` / ``cannot import (<why>)`` /
            ``not callable``.
    """
    if isinstance(spec, PythonObject):  # a callable a config holds from Python
        spec = spec.value
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(
            f"{what} {spec!r}: expected 'module:function' or a callable, got {type(spec).__name__}"
        )
    if ":" not in spec:
        raise ConfigError(f"{what} {spec!r}: expected 'module:function'")
    module, name = spec.split(":", 1)
    # like `python -m`: modules beside the config
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r}: cannot import ({e})") from e
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: not callable")
    return fn
