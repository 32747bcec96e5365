"""Masked reductions: sums, means, variances and loss aggregation over valid tokens only.

Notation used in every docstring of ``proximal.core``:

    B  batch size (rows: one prompt + response each)
    T  response length (columns: response token positions, right-padded)
    V  vocabulary size

Mask convention (one for the whole package): ``response_mask`` / ``mask`` is a **bool** tensor,
``True`` = a real response token. Values at ``False`` positions are never read: they are replaced
with ``torch.where`` before any arithmetic, so NaN/inf garbage there cannot leak into a result or a
gradient (multiplying by a 0/1 mask would turn ``NaN * 0`` into NaN).

Distributed readiness: :func:`masked_mean`, :func:`masked_var` (and ``whiten`` built on them) take
``all_reduce``, a callable that returns the elementwise **sum** of a tensor over data-parallel ranks,
for example::

    def all_reduce(t):
        torch.distributed.all_reduce(t)   # in place, SUM
        return t

They pass only small tensors of sufficient statistics (``[Σx, n]``, then ``[Σ(x-μ)²]``) through it,
so the statistics become global while the meaning stays the same. A rank may hold zero valid tokens
as long as the global count is positive.

A mask with no valid token raises ``ValueError`` instead of dividing by ``n + 1e-8``: an empty batch
is a bug upstream, and a silent zero would hide it. The check reads the count on the host (one
device sync per call).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], Tensor]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def _acc_dtype(x: Tensor) -> torch.dtype:
    """Accumulate at least in float32: a bf16 sum over 10⁵ tokens keeps about two digits."""
    return torch.promote_types(x.dtype, torch.float32)


def check_mask(x: Tensor, mask: Tensor, name: str = "mask") -> None:
    """Raise ``ValueError`` unless ``mask`` is a bool tensor of exactly ``x``'s shape."""
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = real token), got dtype {mask.dtype}")
    if mask.shape != x.shape:
        raise ValueError(f"{name} shape {tuple(mask.shape)} does not match tensor shape {tuple(x.shape)}")


def _count(n: Tensor, what: str) -> None:
    if (n <= 0).any():
        raise ValueError(f"{what}: the mask has no valid (True) position, so the statistic is undefined")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ of ``x`` over positions where ``mask`` is True.

    Args:
        x: any shape, e.g. (B, T).
        mask: bool, same shape as ``x``.
        dim: reduce only this dimension (e.g. ``dim=1`` gives one sum per row, shape (B,));
            ``None`` reduces everything to a scalar.

    Returns:
        Sum in at least float32. An all-False mask gives 0 (a sum is defined on an empty set).
    """
    check_mask(x, mask)
    x = torch.where(mask, x.to(_acc_dtype(x)), 0.0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, *,
                all_reduce: AllReduce | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True: μ = Σ_{mask} x / n.

    This is the seed's empirical mean μ(Â) "across all valid token positions" (§4) and the token
    average Ê_t of §5–§6.

    Args:
        x: any shape, e.g. (B, T).
        mask: bool, same shape as ``x``.
        dim: reduce only this dimension (shape of the result: ``x`` without ``dim``); ``None``
            reduces everything to a scalar.
        all_reduce: sums a tensor over data-parallel ranks; when given, ``[Σx, n]`` goes through it
            once so μ is the global mean. Only with ``dim=None``.

    Raises:
        ValueError: if the (global) mask selects nothing — for ``dim`` given, if any slice is empty.
    """
    check_mask(x, mask)
    if dim is not None and all_reduce is not None:
        raise ValueError("masked_mean: all_reduce is only supported with dim=None (a global mean)")
    acc = _acc_dtype(x)
    x = torch.where(mask, x.to(acc), 0.0)
    if dim is not None:
        n = mask.sum(dim)
        _count(n, "masked_mean")
        return x.sum(dim) / n
    stat = torch.stack([x.sum(), mask.sum().to(acc)])  # [Σx, n]
    if all_reduce is not None:
        stat = all_reduce(stat)
    _count(stat[1], "masked_mean")
    return stat[0] / stat[1]


def masked_mean_var(x: Tensor, mask: Tensor, *,
                    all_reduce: AllReduce | None = None) -> tuple[Tensor, Tensor]:
    """``(μ, σ²)`` over valid positions in two small reductions; see :func:`masked_var`."""
    check_mask(x, mask)
    acc = _acc_dtype(x)
    x = torch.where(mask, x.to(acc), 0.0)
    stat = torch.stack([x.sum(), mask.sum().to(acc)])  # [Σx, n]
    if all_reduce is not None:
        stat = all_reduce(stat)
    _count(stat[1], "masked_mean_var")
    mean, n = stat[0] / stat[1], stat[1]
    centred = torch.where(mask, x - mean, 0.0)
    m2 = (centred * centred).sum().reshape(1)  # [Σ(x−μ)²]
    if all_reduce is not None:
        m2 = all_reduce(m2)
    return mean, m2[0] / n


def masked_var(x: Tensor, mask: Tensor, *, all_reduce: AllReduce | None = None) -> Tensor:
    """Biased (population) variance of ``x`` over valid positions: σ² = Σ_{mask} (x − μ)² / n.

    We divide by n, not n − 1: the seed's σ(Â) is "the empirical standard deviation computed
    across all valid token positions", it is defined for a single valid token, and it makes a
    whitened batch have variance exactly 1 (up to ε). For the token counts of a rollout batch the
    two differ by a factor n/(n−1) ≈ 1.

    Two passes (mean first, then centred squares) rather than E[x²] − E[x]²: the one-pass form loses
    every significant digit in float32 when |μ| ≫ σ.

    Args:
        x: any shape, e.g. (B, T).
        mask: bool, same shape as ``x``.
        all_reduce: sums a tensor over data-parallel ranks; when given, ``[Σx, n]`` and then
            ``[Σ(x−μ)²]`` go through it, so μ and σ² are global.

    Raises:
        ValueError: if the (global) mask selects nothing.
    """
    return masked_mean_var(x, mask, all_reduce=all_reduce)[1]


def masked_aggregate(per_token: Tensor, mask: Tensor, aggregation: str = "token-mean") -> Tensor:
    """Reduce a per-token loss to a scalar, over valid tokens only.

    Aggregations (verl's names; algorithms differ on this, so it is an explicit argument):

    - ``"token-mean"``: Σ_{b,t valid} ℓ_{b,t} / Σ_b n_b — every valid token of the batch weighs the
      same (long responses weigh more). This is the seed's Ê_t.
    - ``"seq-mean-token-mean"``: mean over rows with n_b > 0 of (Σ_t ℓ_{b,t} / n_b) — every response
      weighs the same, whatever its length. Rows with no valid token are left out of the row mean.

    Args:
        per_token: (B, T).
        mask: bool (B, T).
        aggregation: one of ``"token-mean"``, ``"seq-mean-token-mean"``.

    Raises:
        ValueError: unknown ``aggregation``, or no valid token in the whole batch.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    check_mask(per_token, mask)
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be (B, T), got shape {tuple(per_token.shape)}")
    if aggregation == "token-mean":
        return masked_mean(per_token, mask)
    row_sum = masked_sum(per_token, mask, dim=1)  # (B,)
    row_n = mask.sum(1)  # (B,)
    has_tokens = row_n > 0
    n_rows = has_tokens.sum()
    _count(n_rows, "masked_aggregate")
    row_mean = torch.where(has_tokens, row_sum / row_n.clamp_min(1), 0.0)
    return row_mean.sum() / n_rows
