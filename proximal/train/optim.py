"""The optimiser, its learning-rate schedule, seeding, and one optimiser step — the same for every
method.

AdamW with decoupled weight decay on matrices and embeddings only (parameters with two or more
dimensions; never biases or norm gains), the schedule from ``transformers.get_scheduler``, and a
step that clips the global gradient norm (under FSDP2 the norm of the whole, sharded model) and
refuses to apply a non-finite gradient.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from transformers import get_scheduler


@dataclass
class Trained:
    """A model being trained, with its optimiser and learning-rate schedule."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object


#: ``optim.schedule`` → ``transformers.get_scheduler`` name.
_SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on those with ndim ≥ 2 only.

    The fused implementation (one kernel per parameter, the same update) where torch has it for the
    parameters' device and dtype: on CPU it measured 7× faster than the default loop over 144M
    parameters — seconds per step for a wide model. Otherwise torch's default."""
    params = trainable_parameters(model)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int
):
    """``transformers.get_scheduler``: linear warm-up over ``warmup_steps`` optimiser steps, then
    ``schedule`` (constant, linear to 0, or cosine to 0) until ``total_steps``. A ``LambdaLR``, so its
    ``state_dict`` resumes exactly."""
    if schedule not in _SCHEDULERS:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(_SCHEDULERS)}")
    return get_scheduler(
        _SCHEDULERS[schedule],
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=max(total_steps, 1),
    )


def optimizer_and_scheduler(
    model: torch.nn.Module, o, *, lr: float | None = None, total_steps: int
):
    """Both, from an ``optim`` section (:class:`proximal.train.sections.OptimSection`); ``lr``
    overrides ``o.lr`` (PPO's critic has its own)."""
    opt = build_optimizer(
        model,
        lr=o.lr if lr is None else lr,
        weight_decay=o.weight_decay,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
    )
    return opt, build_scheduler(
        opt, schedule=o.schedule, warmup_steps=o.warmup_steps, total_steps=total_steps
    )


def resync_schedule(scheduler) -> None:
    """Set the optimiser's learning rates to what ``scheduler`` gives at its current step.

    A restored ``LambdaLR`` keeps the learning rate the checkpoint's optimiser had; when a run is
    extended (``--resume`` with more ``train.steps``) the schedule's shape changed, and the first new
    step would run at the old schedule's last rate (0 for a linear decay). For an unchanged schedule
    this sets exactly the rates that were saved.
    """
    values = [
        base * fn(scheduler.last_epoch)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, values):
        group["lr"] = lr
    scheduler._last_lr = values


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    max_grad_norm: float,
    *,
    what: str = "model",
) -> float:
    """Clip the global gradient norm to ``max_grad_norm`` (0 = no clipping), step, advance the schedule,
    clear the gradients; return the norm before clipping.

    A non-finite norm raises ``FloatingPointError`` before the step, so NaN never reaches the weights.
    The norm is global (every rank computes the same number, under FSDP2 a reduction over shards), so
    every rank takes the same decision.
    """
    norm = torch.nn.utils.clip_grad_norm_(
        trainable_parameters(model), max_grad_norm if max_grad_norm > 0 else math.inf
    )
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    norm = float(norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"the gradient norm of the {what} is {norm}; the step was not applied "
            "(a non-finite loss: lower optim.lr, or check the data and the rewards)"
        )
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@contextlib.contextmanager
def at_step(step: int):
    """Prefix ``step N:`` to a ``FloatingPointError`` raised inside (a non-finite gradient is
    detected deep in an update; the user needs to know which step, e.g. to resume before it)."""
    try:
        yield
    except FloatingPointError as e:
        if str(e).startswith("step "):
            raise
        raise FloatingPointError(f"step {step}: {e}") from e


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device), as ``transformers.set_seed`` does —
    without importing ``transformers.trainer_utils``, which pulls in half of the Trainer's stack."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds every CUDA device
