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

from collections.abc import Callable

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], Tensor]

#: Loss aggregations, in the names verl uses; see :func:`masked_aggregate`.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _acc_dtype(x: Tensor) -> torch.dtype:
    """Accumulate at least in float32: a bf16 sum over 10⁵ tokens keeps about two digits."""
    return torch.promote_types(x.dtype, torch.float32)


def check_mask(x: Tensor, mask: Tensor, name: str = "mask") -> None:
    """Raise ``ValueError`` unless ``mask`` is a bool tensor of exactly ``x``'s shape."""
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor (True = real token), got dtype {mask.dtype}"
        )
    if mask.shape != x.shape:
        raise ValueError(
            f"{name} shape {tuple(mask.shape)} does not match tensor shape {tuple(x.shape)}"
        )


def _count(n: Tensor, what: str) -> None:
    if (n <= 0).any():
        raise ValueError(
            f"{what}: the mask has no valid (True) position, so the statistic is undefined"
        )


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


def masked_mean(
    x: Tensor, mask: Tensor, dim: int | None = None, *, all_reduce: AllReduce | None = None
) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True: μ = Σ_{mask} x / n.

    This is the empirical mean μ(Â) over all valid token positions of advantage whitening and the
    token average Ê_t of the clipped surrogate and the value loss (docs/formulas.md).

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


def stat_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean for a logged statistic: like :func:`masked_mean`, but 0 for an empty mask.

    A loss evaluated on one micro-batch or one rank's share may see no valid token (its part of the
    loss is then 0); its statistics are weighted by their token count (0) when combined, so any
    finite value will do and raising would stop a correct run.
    """
    check_mask(x, mask)
    n = mask.sum()
    return masked_sum(x, mask) / n.clamp_min(1).to(_acc_dtype(x))


def masked_mean_var(
    x: Tensor, mask: Tensor, *, all_reduce: AllReduce | None = None
) -> tuple[Tensor, Tensor]:
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

    We divide by n, not n − 1: whitening's σ(Â) is the empirical standard deviation over all valid
    token positions (docs/formulas.md, "Generalised advantage estimation"), it is defined for a
    single valid token, and it makes a whitened batch have variance exactly 1 (up to ε). For the
    token counts of a rollout batch the two differ by a factor n/(n−1) ≈ 1.

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


def aggregation_units(mask: Tensor, aggregation: str = "token-mean") -> Tensor:
    """How many units ``aggregation`` averages over in ``mask`` (B, T): valid tokens for
    ``"token-mean"``, responses with at least one valid token for the two sequence means.

    This is the denominator of :func:`masked_aggregate`. A trainer that splits a batch into
    micro-batches (and ranks) sums this count over the whole batch and passes the total as
    ``normalizer``, so that the accumulated gradient is that of the whole batch's loss — whatever
    the aggregation, including one added later (an unknown name raises here, it is never guessed).

    Returns:
        Scalar float32 tensor (a count).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(
            f"mask must be a bool (B, T) tensor, got {mask.dtype} of shape {tuple(mask.shape)}"
        )
    if aggregation == "token-mean":
        return mask.sum().to(torch.float32)
    return mask.any(1).sum().to(torch.float32)


def masked_aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str = "token-mean",
    *,
    max_length: int | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar, over valid tokens only.

    Aggregations (verl's names; algorithms differ on this, so it is an explicit argument). With n_b
    the valid tokens of row b and R the rows with n_b > 0:

    - ``"token-mean"``: Σ_{b,t valid} ℓ_{b,t} / Σ_b n_b — every valid token of the batch weighs the
      same (long responses weigh more). The Ê_t of PPO (Schulman et al. 2017) and of DAPO (Yu et
      al. 2025).
    - ``"seq-mean-token-mean"``: Σ_{b ∈ R} (Σ_t ℓ_{b,t} / n_b) / |R| — every response weighs the
      same, whatever its length (GRPO, Shao et al. 2024, eq. 3).
    - ``"seq-mean-token-sum-norm"``: Σ_{b ∈ R} (Σ_t ℓ_{b,t} / L) / |R| with L = ``max_length``, a
      constant — each token weighs 1/(L·|R|) whatever the length of its response (Dr. GRPO, Liu et
      al. 2025, which removes GRPO's length bias).

    Every aggregation is ``unit_sum / units``: the numerator sums over tokens (token-mean) or over
    per-row terms (the two others), the denominator is :func:`aggregation_units`. ``normalizer``
    replaces the denominator with a count the caller summed over a larger batch (micro-batches,
    data-parallel ranks): then the result is this slice's share of the whole batch's loss, and a
    slice with no valid token contributes exactly 0 instead of raising.

    Args:
        per_token: (B, T).
        mask: bool (B, T).
        aggregation: one of :data:`AGGREGATIONS`.
        max_length: L, required by ``"seq-mean-token-sum-norm"`` (the generation budget, T_max).
        normalizer: the denominator to use instead of this batch's own unit count (> 0).

    Raises:
        ValueError: unknown ``aggregation``, a missing ``max_length``, or — without ``normalizer``
            — no valid token in the whole batch.
    """
    units = aggregation_units(mask, aggregation)  # validates the name and the mask
    check_mask(per_token, mask)
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be (B, T), got shape {tuple(per_token.shape)}")
    if aggregation == "seq-mean-token-sum-norm" and not (max_length is not None and max_length > 0):
        raise ValueError(
            f"aggregation 'seq-mean-token-sum-norm' needs max_length > 0, got {max_length}"
        )
    if normalizer is None:
        _count(units, "masked_aggregate")
        denominator = units
    else:
        denominator = torch.as_tensor(normalizer, dtype=torch.float32, device=per_token.device)
        if not bool(denominator > 0):
            raise ValueError(f"masked_aggregate: normalizer must be > 0, got {float(denominator)}")
    if aggregation == "token-mean":
        return masked_sum(per_token, mask) / denominator
    row_sum = masked_sum(per_token, mask, dim=1)  # (B,)
    if aggregation == "seq-mean-token-sum-norm":
        return row_sum.sum() / max_length / denominator
    row_n = mask.sum(1)  # (B,)
    row_mean = torch.where(row_n > 0, row_sum / row_n.clamp_min(1), 0.0)
    return row_mean.sum() / denominator
