"""Micro-batch accumulation and sharded evaluation, the same for every method: the optimiser steps
of SFT, the reward model, DPO and SimPO over a fixed data set and the updates of PPO and GRPO over a
rollout batch; and per-row values of a whole data set computed in shards (DPO's precomputed
reference log-probabilities).

A trainer's per-micro-batch function runs forward and backward on a few rows and returns named
sums — its share of the loss (already normalised by the whole batch's count, so gradients accumulate
to the batch's), and statistics weighted by their counts — and, where a statistic is an extreme,
named maxima or minima. :func:`accumulate` and :func:`evaluate` reduce those over micro-batches and
over ranks, so every number a trainer logs is global.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.data.sampler import shard_for_eval

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


def _reduce(
    totals: dict[str, torch.Tensor | float],
    device: torch.device | str,
    maxima: Collection[str] = (),
    minima: Collection[str] = (),
) -> Sums:
    """Sum ``totals`` over ranks in one collective, and take the maxima and minima over ranks in a
    second one, only when there are any (a minimum as the maximum of its negation). An extreme no
    micro-batch reported is −inf for a maximum, +inf for a minimum, so every rank sends the same keys."""
    sums = sorted(k for k in totals if k not in maxima and k not in minima)
    out: Sums = {}
    if sums:
        vec = torch.stack([_f64(totals[k], device) for k in sums])
        out.update(zip(sums, dist.all_reduce_sum(vec).tolist()))
    highs, lows = sorted(maxima), sorted(minima)
    if highs or lows:
        vec = torch.stack(
            [_f64(totals.get(k, -math.inf), device) for k in highs]
            + [-_f64(totals.get(k, math.inf), device) for k in lows]
        )
        got = dist.all_reduce_max(vec).tolist()
        out.update(zip(highs, got[: len(highs)]))
        out.update((k, -v) for k, v in zip(lows, got[len(highs) :]))
    return out


def _f64(value: torch.Tensor | float, device: torch.device | str) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64).reshape(()).to(device)


def _add(
    totals: dict, out: dict, maxima: Collection[str] = (), minima: Collection[str] = ()
) -> None:
    for k, v in out.items():
        v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
        if k in maxima or k in minima:
            v = torch.as_tensor(v, dtype=torch.float64)
            if k in totals:
                v = (torch.maximum if k in maxima else torch.minimum)(totals[k], v)
            totals[k] = v
        else:
            totals[k] = totals.get(k, 0.0) + v


def accumulate(
    rows: list,
    micro_batch_size: int,
    step: Callable[[list], dict],
    device: torch.device | str = "cpu",
    *,
    maxima: Collection[str] = (),
    minima: Collection[str] = (),
) -> Sums:
    """``step(micro_rows)`` on each micro-batch of this rank's ``rows``; the sums of its outputs over
    micro-batches and ranks — except the keys named in ``maxima`` and ``minima``, whose largest and
    smallest value over micro-batches and ranks is returned (a statistic's extremes, such as the
    largest probability ratio; a micro-batch with nothing to report returns −inf for a maximum, +inf
    for a minimum).

    One all-reduce of the sums, and one more for the extremes when there are any. ``rows`` may be
    anything sliceable: rows to cut micro-batches from, or (``micro_batch_size`` = 1) micro-batches
    already cut, each then handed to ``step`` as a list of one."""
    totals: dict = {}
    for i in range(0, len(rows), micro_batch_size):
        _add(totals, step(rows[i : i + micro_batch_size]), maxima, minima)
    return _reduce(totals, device, maxima, minima)


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
    table = torch.zeros(n, width, dtype=torch.float64, device=device)
    for idx in shard_for_eval(n, micro_batch_size, dist.rank(), dist.world_size()):
        out = fn(idx or [0])
        if idx:
            table[idx] = (
                out.detach().to(device=device, dtype=torch.float64).reshape(len(idx), width)
            )
    return dist.all_reduce_sum(table).cpu()
