"""What ``proximal sft`` and ``proximal rm`` share: the optimisation section of their configs and its
checks, the step plan and learning-rate schedule, batching, devices, and the run directory.

Both commands train one model on a fixed dataset and write one checkpoint, so they behave alike; the
PPO trainer has its own loop and schedules (:mod:`proximal.trainers.ppo`) and shares only
:func:`resolve_device`.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from proximal.checkpoint import atomic_dir
from proximal.config import ConfigError, check_divides, option
from proximal.data.jsonl import DataError
from proximal.models.loading import ModelLoadError


@dataclass
class TrainSection:
    lr: float = option(1e-5, "Peak AdamW learning rate, reached after warmup_steps and then decayed "
                             "linearly towards zero (the last step runs at lr / (steps - warmup_steps)).")
    epochs: int = option(1, "Passes over train_file (used when max_steps is null). Each pass is reshuffled; "
                            "the last len(train) mod batch_size rows of a pass are left out of it.")
    max_steps: int | None = option(None, "If set, train for exactly this many optimizer steps (passing over "
                                         "the data as often as needed) instead of `epochs`.")
    batch_size: int = option(32, "Rows per optimizer step.")
    micro_batch_size: int = option(8, "Rows per forward/backward pass; batch_size / micro_batch_size passes "
                                      "are accumulated into one step. Must divide batch_size. Also the "
                                      "evaluation batch size.")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay, applied to matrices and embeddings "
                                      "only (not to biases or norm gains).")
    warmup_steps: int = option(0, "Steps of linear warmup from 0 to lr.")
    max_grad_norm: float = option(1.0, "Clip the global gradient L2 norm to this value before each step.")
    eval_every: int = option(100, "Evaluate on eval_file every this many steps (and always before the first "
                                  "step and after the last); 0 = only before and after.")
    device: str = option("auto", "Where to train: cpu, cuda, cuda:N, or auto (cuda when available).")



def common_errors(cfg) -> list[str]:
    """Checks shared by ``proximal sft`` and ``proximal rm`` (same section layout)."""
    errors = []
    if not cfg.model.path:
        errors.append("model.path is required (a local checkpoint directory or a hub id)")
    if not cfg.data.train_file:
        errors.append("data.train_file is required (a JSONL file)")
    if cfg.data.max_length < 2:
        errors.append(f"data.max_length = {cfg.data.max_length} must be at least 2 (a prompt token and EOS)")
    t = cfg.train
    if not (t.lr > 0 and math.isfinite(t.lr)):
        errors.append(f"train.lr = {t.lr} must be a positive number")
    if t.epochs < 1:
        errors.append(f"train.epochs = {t.epochs} must be at least 1")
    if t.max_steps is not None and t.max_steps < 1:
        errors.append(f"train.max_steps = {t.max_steps} must be at least 1 (or null to use train.epochs)")
    if t.batch_size < 1:
        errors.append(f"train.batch_size = {t.batch_size} must be at least 1")
    else:
        check_divides(errors, "train.batch_size", t.batch_size, "train.micro_batch_size", t.micro_batch_size)
    if t.weight_decay < 0:
        errors.append(f"train.weight_decay = {t.weight_decay} must be >= 0")
    if t.warmup_steps < 0:
        errors.append(f"train.warmup_steps = {t.warmup_steps} must be >= 0")
    if t.max_steps is not None and t.warmup_steps >= t.max_steps >= 1:
        errors.append(f"train.warmup_steps = {t.warmup_steps} must be less than train.max_steps = {t.max_steps}")
    if not (t.max_grad_norm > 0):
        errors.append(f"train.max_grad_norm = {t.max_grad_norm} must be > 0")
    if t.eval_every < 0:
        errors.append(f"train.eval_every = {t.eval_every} must be >= 0 (0 = only before and after training)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device):
        errors.append(f"train.device = {t.device!r} is not one of auto, cpu, cuda, cuda:N")
    if not cfg.output.dir:
        errors.append("output.dir is required")
    return errors




def plan_steps(n_train: int, t: TrainSection, train_file: str) -> tuple[int, int]:
    """``(total optimizer steps, steps per pass over the data)``; ConfigError if a pass has no full batch."""
    steps_per_epoch = n_train // t.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size = {t.batch_size} is larger than the {n_train} usable rows of "
                          f"data.train_file = {train_file}; lower the batch size or add data")
    total = t.max_steps if t.max_steps is not None else t.epochs * steps_per_epoch
    if t.warmup_steps >= total:
        raise ConfigError(f"train.warmup_steps = {t.warmup_steps} must be less than the {total} training steps")
    return total, steps_per_epoch


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup to ``lr``, linear decay after.

    Step k ≤ warmup gets lr·k/warmup; step k > warmup gets lr·(total − k + 1)/(total − warmup), so the
    first step after warmup runs at the peak and the last at lr/(total − warmup) — no step is wasted
    at learning rate 0.
    """
    if step <= warmup_steps:
        return lr * step / warmup_steps
    return lr * (total_steps - step + 1) / (total_steps - warmup_steps)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu; ConfigError for a CUDA device this machine lacks.

    Any config's ``train.device``: the error names that field."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        index = int(name.split(":")[1]) if ":" in name else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"train.device = {name!r}, but this machine has "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA devices")
    return torch.device(name)


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings (ndim ≥ 2), none on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def index_batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless stream of row-index batches: a fresh permutation per pass, the remainder of a pass dropped."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g).tolist()
        for i in range(0, n - batch_size + 1, batch_size):
            yield perm[i:i + batch_size]


def data_metrics(split: str, report) -> dict:
    if report is None:
        return {}
    return {f"data/{split}_rows": report.rows - report.skipped, f"data/{split}_skipped": report.skipped}


def check_fits(model, tokenizer, max_length: int, path: str) -> None:
    """ConfigError if data.max_length exceeds the model's context or the tokenizer's ids exceed its vocabulary."""
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and max_length > limit:
        raise ConfigError(f"data.max_length = {max_length} is longer than the context of model.path = {path} "
                          f"({limit} positions)")
    n_embed = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embed:
        raise ModelLoadError(f"model.path = {path}: the tokenizer has {len(tokenizer)} tokens but the model's "
                             f"embedding has only {n_embed} rows")


RUN_MARKERS = ("config.yaml", "metrics.jsonl", "config.json")


def prepare_output_dir(directory: str, overwrite: bool) -> Path:
    """Create the run directory; refuse to reuse a non-empty one unless ``overwrite`` and it is a run.

    The final save replaces the whole directory in one rename, so a directory that does not look like
    a previous run (none of config.yaml, metrics.jsonl, config.json) is never overwritten.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir = {directory}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"output.dir = {directory} is not empty; choose a new directory or set "
                              "output.overwrite: true to replace the run there")
        if not any((out / m).exists() for m in RUN_MARKERS):
            raise ConfigError(f"output.dir = {directory} is not empty and does not look like a run directory "
                              f"(no {', '.join(RUN_MARKERS)}); refusing to replace it even with output.overwrite")
        for name in ("metrics.jsonl", "config.yaml"):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def finalize_run(out: Path, model, tokenizer) -> None:
    """Write the checkpoint, config.yaml and metrics.jsonl into ``out`` atomically (one directory rename)."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name in ("config.yaml", "metrics.jsonl"):
            shutil.copy2(out / name, tmp / name)


def run_and_report(prog: str, train_fn, cfg, metric: tuple[str, str]) -> int:
    """Run ``train_fn(cfg)`` for the CLI: print a one-line summary, or the error without a traceback."""
    from proximal.logging import read_metrics

    try:
        out = train_fn(cfg)
    except (DataError, ConfigError, ModelLoadError) as e:
        print(f"proximal {prog}: {e}", file=sys.stderr)
        return 2
    key, label = metric
    values = [r[key] for r in read_metrics(out / "metrics.jsonl") if key in r]
    change = f"{label} {values[0]:.4f} -> {values[-1]:.4f}; " if values else ""
    print(f"proximal {prog}: {change}checkpoint saved to {out}")
    return 0
