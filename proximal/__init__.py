"""proximal: textbook-exact PPO-based RLHF.

The Python API (docs/python.md): each method's config class and training function, and the helpers
a script around them uses, lent lazily, so that ``import proximal`` (and ``import proximal.core``,
and ``proximal --help``) loads neither torch nor transformers until one of them is touched::

    from proximal import SFTConfig, train_sft

    config = SFTConfig()
    config.model.path = "my-base-model"             # or a loaded model: (model, tokenizer)
    config.data.train_file = [{"prompt": "2+2=", "completion": "4"}, ...]   # or a file
    run_dir = train_sft(config)                     # the fine-tuned model, in Hugging Face format
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each name this package lends, and the module it lives in (imported on first use).
_LAZY = {
    # each method: its config and its training function
    "SFTConfig": "proximal.trainers.sft_config",
    "RMConfig": "proximal.trainers.reward_config",
    "PPOConfig": "proximal.trainers.ppo_config",
    "GRPOConfig": "proximal.trainers.grpo_config",
    "DPOConfig": "proximal.trainers.dpo_config",
    "SimPOConfig": "proximal.trainers.dpo_config",
    "DistillConfig": "proximal.trainers.distill_config",
    "train_sft": "proximal.api",
    "train_rm": "proximal.api",
    "train_ppo": "proximal.api",
    "train_grpo": "proximal.api",
    "train_dpo": "proximal.api",
    "train_simpo": "proximal.api",
    "train_distill": "proximal.api",
    # configs from YAML files and overrides, as the commands read them
    "load_config": "proximal.config",
    # data as every command reads it; reward functions as the online methods call them
    "read_rows": "proximal.data.sources",
    "load_reward_function": "proximal.rollout.reward_functions",
    # what a run leaves: its metrics, and a policy measured on held-out prompts
    "read_metrics": "proximal.logging",
    "evaluate_policy": "proximal.evaluation",
    # the errors a mistake raises (the commands print them in one line)
    "ConfigError": "proximal.config",
    "DataError": "proximal.data.jsonl",
    "ModelLoadError": "proximal.models.loading",
    "RewardFunctionError": "proximal.rollout.reward_functions",
}

__all__ = [  # the names of _LAZY, written out for the linter and for `from proximal import *`
    "__version__",
    "SFTConfig",
    "RMConfig",
    "PPOConfig",
    "GRPOConfig",
    "DPOConfig",
    "SimPOConfig",
    "DistillConfig",
    "train_sft",
    "train_rm",
    "train_ppo",
    "train_grpo",
    "train_dpo",
    "train_simpo",
    "train_distill",
    "load_config",
    "read_rows",
    "load_reward_function",
    "read_metrics",
    "evaluate_policy",
    "ConfigError",
    "DataError",
    "ModelLoadError",
    "RewardFunctionError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'proximal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from proximal.api import (
        train_distill,
        train_dpo,
        train_grpo,
        train_ppo,
        train_rm,
        train_sft,
        train_simpo,
    )
    from proximal.config import ConfigError, load_config
    from proximal.data.jsonl import DataError
    from proximal.data.sources import read_rows
    from proximal.evaluation import evaluate_policy
    from proximal.logging import read_metrics
    from proximal.models.loading import ModelLoadError
    from proximal.rollout.reward_functions import RewardFunctionError, load_reward_function
    from proximal.trainers.distill_config import DistillConfig
    from proximal.trainers.dpo_config import DPOConfig, SimPOConfig
    from proximal.trainers.grpo_config import GRPOConfig
    from proximal.trainers.ppo_config import PPOConfig
    from proximal.trainers.reward_config import RMConfig
    from proximal.trainers.sft_config import SFTConfig
