"""What the core tests share: float64 tensors from literals, bool masks, and an absolute comparison.

Expected values in these tests are derived by hand in float64, so they compare at ~1e-12."""

from __future__ import annotations

import math

import torch

NAN, INF = math.nan, math.inf
F64 = torch.float64


def t(x, **kw) -> torch.Tensor:
    """A float64 tensor (``requires_grad=True`` etc. pass through)."""
    return torch.tensor(x, dtype=F64, **kw)


def b(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.bool)


def close(got, want, tol: float = 1e-12) -> None:
    """``got`` equals ``want`` (a literal, made float64) to an absolute ``tol``."""
    torch.testing.assert_close(got, t(want), rtol=0, atol=tol)
