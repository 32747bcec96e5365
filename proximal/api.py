"""The training commands as Python functions: ``proximal.train_sft(config)`` runs what ``proximal sft
--config ...`` runs (docs/python.md).

Each function takes its method's config — built in Python (``SFTConfig()``, its fields set one by
one) or the path of a YAML file — and returns the run directory, which holds the trained model in
Hugging Face format, ``config.yaml`` and ``metrics.jsonl``: it is the next stage's ``model.path``.
Where a config file names a path, a config built in Python may hold the thing itself (a loaded model,
rows, a reward function: :class:`proximal.config.PythonObject`). Mistakes raise the exceptions the
command would report in one line (:class:`~proximal.config.ConfigError`,
:class:`~proximal.data.jsonl.DataError`, :class:`~proximal.models.loading.ModelLoadError`, ...);
a stop signal (Ctrl-C, the notebook's interrupt) ends the run after its step with a checkpoint,
as on the command line, and the process's own signal handlers are back when the function returns,
however it ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from proximal.commands import config_class, trainer
from proximal.config import load_config
from proximal.train import signals
from proximal.trainers.distill_config import DistillConfig
from proximal.trainers.dpo_config import DPOConfig, SimPOConfig
from proximal.trainers.grpo_config import GRPOConfig
from proximal.trainers.ppo_config import PPOConfig
from proximal.trainers.reward_config import RMConfig
from proximal.trainers.sft_config import SFTConfig

__all__ = [
    "train_sft",
    "train_rm",
    "train_ppo",
    "train_grpo",
    "train_dpo",
    "train_simpo",
    "train_distill",
]

Config = Any  # one of the config classes, or a YAML file's path


def _run(command: str, config: Config, resume_dir: str | Path | None) -> Path:
    """``proximal <command>``'s training function (the table's, :mod:`proximal.commands`) on
    ``config``, an instance of its config class or a YAML file's path."""
    name, cls, train = f"train_{command}", config_class(command), trainer(command)
    if isinstance(config, (str, os.PathLike)):
        config = load_config(cls, config)
    elif type(config) is not cls:
        raise TypeError(
            f"{name}: expected a {cls.__name__} (or a YAML file's path), got "
            f"{type(config).__name__}"
        )
    try:
        return Path(train(config, resume_dir=resume_dir))
    finally:
        signals.restore()  # the run's stop-signal handlers, however it ended


def train_sft(config: SFTConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """Supervised fine-tuning (``proximal sft``; docs/sft.md). ``resume_dir``: continue that run
    from its newest intact checkpoint (``'auto'``: the one in ``output.dir``, if any)."""
    return _run("sft", config, resume_dir)


def train_rm(config: RMConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """A Bradley–Terry reward model (``proximal rm``; docs/rm.md)."""
    return _run("rm", config, resume_dir)


def train_ppo(config: PPOConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """PPO with actor, reference, reward model and critic (``proximal ppo``; docs/ppo.md)."""
    return _run("ppo", config, resume_dir)


def train_grpo(config: GRPOConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """GRPO, Dr. GRPO, DAPO or RLOO (``proximal grpo``; docs/grpo.md)."""
    return _run("grpo", config, resume_dir)


def train_dpo(config: DPOConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """DPO, IPO or robust DPO on preference pairs (``proximal dpo``; docs/dpo.md)."""
    return _run("dpo", config, resume_dir)


def train_simpo(config: SimPOConfig | str | Path, *, resume_dir: str | Path | None = None) -> Path:
    """SimPO on preference pairs, no reference (``proximal simpo``; docs/simpo.md)."""
    return _run("simpo", config, resume_dir)


def train_distill(
    config: DistillConfig | str | Path, *, resume_dir: str | Path | None = None
) -> Path:
    """On-policy distillation: the student samples, ``model.teacher`` grades every token
    (``proximal distill``; docs/distill.md)."""
    return _run("distill", config, resume_dir)
