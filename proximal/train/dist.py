"""Data-parallel helpers: the one place global statistics cross ranks.

Every global quantity in a training loop (advantage whitening, the KL controller's observed KL,
logged metrics) goes through :func:`all_reduce_sum`. Without ``torch.distributed`` initialised (one
process, CPU or one GPU) it returns its input unchanged, so single-process runs pay nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all data-parallel ranks (a copy; the input is not modified)."""
    if not is_distributed():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def global_mean(values: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Mean of ``values`` (optionally weighted) over every element on every rank."""
    values = values.detach().double().flatten()
    w = torch.ones_like(values) if weights is None else weights.detach().double().flatten()
    s = all_reduce_sum(torch.stack([(values * w).sum(), w.sum()]))
    return (s[0] / s[1]).item() if s[1] > 0 else float("nan")
