"""The ``proximal`` commands: one table, read by the command line (``cli.py``), the Python API
(``api.py``), the methods of the comparison and the demo (``methods.py``) and the memory planner
(``memory/runconfig.py``).

Each entry holds names only — the module and function that run it, and for a training command its
config class and its training function — as ``module:name`` strings. This module imports nothing of
proximal's (layer 0), so ``proximal --help`` reads it without loading torch, and each reader imports
the one thing an entry names when it needs it (:func:`load`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    name: str  # proximal <name>
    summary: str  # its line in `proximal --help`
    entry: str  # module:function, called with the command line's arguments after the name
    config: str | None = None  # a training command's config class (module:Class)
    train: str | None = (
        None  # its training function: f(config, resume_dir=None) -> the run directory
    )
    online: bool = False  # a training command that samples its own responses (ppo, grpo, distill)


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command(
            "ppo",
            "PPO-based RLHF: actor, reference, reward model and critic",
            "proximal.trainers.ppo:cli",
            "proximal.trainers.ppo_config:PPOConfig",
            "proximal.trainers.ppo:train",
            online=True,
        ),
        Command(
            "grpo",
            "critic-free online RL: GRPO, Dr. GRPO, DAPO and RLOO (grpo.advantage: rloo)",
            "proximal.trainers.grpo:cli",
            "proximal.trainers.grpo_config:GRPOConfig",
            "proximal.trainers.grpo:train",
            online=True,
        ),
        Command(
            "sft",
            "supervised fine-tuning on prompt/response pairs",
            "proximal.trainers.sft:cli",
            "proximal.trainers.sft_config:SFTConfig",
            "proximal.trainers.sft:train",
        ),
        Command(
            "rm",
            "reward-model training with the Bradley-Terry loss",
            "proximal.trainers.reward:cli",
            "proximal.trainers.reward_config:RMConfig",
            "proximal.trainers.reward:train",
        ),
        Command(
            "dpo",
            "DPO on preference pairs: the policy against a frozen reference",
            "proximal.trainers.dpo:dpo_cli",
            "proximal.trainers.dpo_config:DPOConfig",
            "proximal.trainers.dpo:train",
        ),
        Command(
            "simpo",
            "SimPO on preference pairs: one model, no reference",
            "proximal.trainers.dpo:simpo_cli",
            "proximal.trainers.dpo_config:SimPOConfig",
            "proximal.trainers.dpo:train",
        ),
        Command(
            "distill",
            "on-policy distillation: the student samples, a teacher grades every token "
            "(reverse KL), optionally plus a verifier's reward",
            "proximal.trainers.distill:cli",
            "proximal.trainers.distill_config:DistillConfig",
            "proximal.trainers.distill:train",
            online=True,
        ),
        Command(
            "demo",
            "the whole of RLHF offline on a CPU: SFT -> RM -> PPO (and DPO, SimPO, GRPO, RLOO "
            "beside it), with a report",
            "proximal.demo:cli",
        ),
        Command(
            "compare",
            "PPO, DPO, SimPO, GRPO and RLOO from one SFT model, over seeds, measured alike: "
            "compare.md",
            "proximal.compare:cli",
        ),
        Command(
            "memory",
            "GPU memory planner: will a run of any method fit, and on how many GPUs?",
            "proximal.memory.command:cli",
        ),
    )
}

#: The commands that train a model (each has a config class and a training function), in order.
TRAINING = tuple(name for name, c in COMMANDS.items() if c.config is not None)


def load(target: str) -> Any:
    """What a ``module:name`` string of the table names, its module imported (torch, for most)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def config_class(command: str) -> type:
    """The config class of the training command ``command`` (KeyError for another name)."""
    return load(_training(command).config)


def trainer(command: str) -> Any:
    """The training function of the training command ``command``: ``f(config, resume_dir=None)``."""
    return load(_training(command).train)


def _training(command: str) -> Command:
    c = COMMANDS[command]
    if c.config is None:
        raise KeyError(f"{command!r} is not a training command ({', '.join(TRAINING)})")
    return c
