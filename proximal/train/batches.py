"""Micro-batch accumulation and sharded evaluation, the same for every method that passes over a
fixed data set (SFT, reward model, DPO, SimPO), and per-row values of a whole data set computed in
shards (DPO's precomputed reference log-probabilities).

A trainer's per-micro-batch function runs forward and backward on a few rows and returns sums —
its share of the loss (already normalised by the whole batch's count, so gradients accumulate to
the batch's), and statistics weighted by their counts. :func:`accumulate` and :func:`evaluate` add
those sums over micro-batches and over ranks, so every number a trainer logs is global.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from proximal import dist

Sums = dict[str, float]


def plan_steps(
    n_rows: int,
    *,
    steps: int | None,
    epochs: int,
    batch_size: int,
    warmup_steps: int,
    train_file: str,
) -> int:
    """The run's optimiser steps: ``steps``, or ``epochs`` passes of full batches over ``n_rows``.
    ConfigError if a pass has no full batch or the warm-up is as long as the run."""
    from proximal.config import ConfigError

    per_epoch = n_rows // batch_size
    if per_epoch == 0:
        raise ConfigError(
            f"train.batch_size = {batch_size} is larger than the {n_rows} usable rows of "
            f"data.train_file = {train_file}; lower the batch size or add data"
        )
    total = steps if steps is not None else epochs * per_epoch
    if warmup_steps >= total:
        raise ConfigError(
            f"optim.warmup_steps = {warmup_steps} must be less than the {total} training steps"
        )
    return total


def _reduce(totals: dict[str, torch.Tensor | float], device: torch.device | str) -> Sums:
    keys = sorted(totals)
    if not keys:
        return {}
    vec = torch.stack(
        [torch.as_tensor(totals[k], dtype=torch.float64).reshape(()).to(device) for k in keys]
    )
    vec = dist.all_reduce_sum(vec)
    return {k: float(v) for k, v in zip(keys, vec.tolist())}


def _add(totals: dict, out: dict) -> None:
    for k, v in out.items():
        v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
        totals[k] = totals.get(k, 0.0) + v


def accumulate(
    rows: list,
    micro_batch_size: int,
    step: Callable[[list], dict],
    device: torch.device | str = "cpu",
) -> Sums:
    """``step(micro_rows)`` on each micro-batch of this rank's ``rows``; the sums of its outputs over
    micro-batches and ranks."""
    totals: dict = {}
    for i in range(0, len(rows), micro_batch_size):
        _add(totals, step(rows[i : i + micro_batch_size]))
    return _reduce(totals, device)


@torch.no_grad()
def evaluate(
    n: int,
    micro_batch_size: int,
    fn: Callable[[list[int]], dict],
    device: torch.device | str = "cpu",
) -> Sums:
    """``fn(indices)`` over a disjoint share of ``range(n)`` per rank; the sums over all rows.

    Every rank runs the same number of calls (a sharded model needs all of them in each forward):
    a rank whose share is used up calls ``fn([0])`` and its result is discarded.
    """
    from proximal.data.sampler import shard_for_eval

    totals: dict = {}
    for idx in shard_for_eval(n, micro_batch_size, dist.rank(), dist.world_size()):
        out = fn(idx or [0])
        if idx:
            _add(totals, out)
        else:
            _add(totals, {k: 0.0 for k in out})
    return _reduce(totals, device)


@torch.no_grad()
def evaluate_rows(
    n: int,
    micro_batch_size: int,
    fn: Callable[[list[int]], torch.Tensor],
    width: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``fn(indices)`` → a (len(indices), ``width``) tensor of values per row, over a disjoint share of
    ``range(n)`` per rank; the (n, ``width``) float64 table of every row, on every rank, on the CPU.

    The calls are those of :func:`evaluate` (every rank the same number; a used-up rank's ``fn([0])``
    is discarded); the shares are disjoint, so one sum over ranks assembles the table.
    """
    from proximal.data.sampler import shard_for_eval

    table = torch.zeros(n, width, dtype=torch.float64, device=device)
    for idx in shard_for_eval(n, micro_batch_size, dist.rank(), dist.world_size()):
        out = fn(idx or [0])
        if idx:
            table[idx] = (
                out.detach().to(device=device, dtype=torch.float64).reshape(len(idx), width)
            )
    return dist.all_reduce_sum(table).cpu()
