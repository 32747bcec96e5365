"""TRL's and OpenRLHF's names get a hint naming where they live in the command being run (issue 37
item 7): one table, :data:`proximal.train.trl_names.TRL_NAMES`, keyed by command."""

from __future__ import annotations

import re

import pytest
import yaml

from proximal.config import ConfigError, describe, load_config
from proximal.train.trl_names import COMMANDS, TRL_NAMES
from proximal.trainers.distill_config import DistillConfig
from proximal.trainers.dpo_config import DPOConfig, SimPOConfig
from proximal.trainers.grpo_config import GRPOConfig
from proximal.trainers.ppo_config import PPOConfig
from proximal.trainers.reward_config import RMConfig
from proximal.trainers.sft_config import SFTConfig

CONFIGS = {
    "sft": SFTConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
    "simpo": SimPOConfig,
    "ppo": PPOConfig,
    "grpo": GRPOConfig,
    "distill": DistillConfig,
}
#: A dotted config name in a hint: ``optim.lr``, ``rollout.group_size``.
FIELD = re.compile(r"\b([a-z]+\.[a-z_0-9]+)\b")
#: Hints that say there is nothing of the kind here, and so name no field.
NOTHING_HERE = {
    ("rm", "center_rewards_coefficient"),
    ("simpo", "cpo_alpha"),
    ("simpo", "loss_type"),
}


def test_every_command_has_a_row_and_its_config_takes_it():
    assert set(TRL_NAMES) == set(COMMANDS) == set(CONFIGS)
    for command, cls in CONFIGS.items():
        assert cls.FOREIGN_NAMES is TRL_NAMES[command]


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_field_a_hint_names_is_a_field_of_that_command(command):
    fields = {name for name, *_ in describe(CONFIGS[command])}
    sections = {name.split(".")[0] for name in fields}
    wrong, bare = [], []
    for name, hint in TRL_NAMES[command].items():
        named = [f for f in FIELD.findall(hint) if not f.endswith(".jsonl")]  # a file's name
        wrong += [f"{name}: {f}" for f in named if f not in fields]
        if not named and (command, name) not in NOTHING_HERE:
            bare.append(name)
        # the name itself is no top-level section here (it would never reach the hint)
        assert name not in sections, name
    assert not wrong, f"{command}: hints name fields its config lacks: {wrong}"
    assert not bare, f"{command}: hints that name no field: {bare}"


@pytest.mark.parametrize(
    ("command", "name", "field"),
    [
        ("grpo", "num_generations", "rollout.group_size"),
        *[(c, "per_device_train_batch_size", "train.micro_batch_size") for c in ("sft", "rm")],
        *[(c, "per_device_train_batch_size", "train.micro_batch_size") for c in ("dpo", "simpo")],
        ("grpo", "per_device_train_batch_size", "grpo.micro_batch_size"),
        ("ppo", "per_device_train_batch_size", "ppo.micro_batch_size"),
        *[(c, "learning_rate", "optim.lr") for c in COMMANDS],
        ("ppo", "max_completion_length", "rollout.max_new_tokens"),
        ("grpo", "max_completion_length", "rollout.max_new_tokens"),
        ("grpo", "beta", "grpo.beta"),
        ("ppo", "beta", "kl.beta"),
        ("dpo", "beta", "dpo.beta"),
        ("simpo", "beta", "simpo.beta"),
        ("grpo", "gradient_accumulation_steps", "grpo.mini_batch_size"),
        ("sft", "gradient_accumulation_steps", "train.batch_size"),
        ("ppo", "vf_coef", "ppo.vf_coef"),
        ("ppo", "cliprange", "ppo.clip_eps"),
        ("grpo", "epsilon", "grpo.clip_eps"),
        ("dpo", "num_train_epochs", "train.epochs"),
        ("grpo", "max_prompt_length", "data.max_prompt_length"),
    ],
)
def test_the_issue_s_names_point_to_the_command_s_own_field(command, name, field):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS[command], overrides={name: "1"})
    line = f"{name}: a TRL/OpenRLHF name, not a field here; {TRL_NAMES[command][name]}"
    assert str(e.value).splitlines()[1] == f"  - {line}"  # then what the empty config lacks
    assert field in TRL_NAMES[command][name]


def test_a_flat_trl_config_gets_every_hint_in_one_message(tmp_path):
    trl = {
        "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "num_generations": 8,
        "max_completion_length": 256,
        "beta": 0.04,
        "bf16": True,
        "output_dir": "runs/grpo",
        "dataset_name": "trl-lib/tldr",
        "logging_steps": 10,
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(trl, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, path)
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid configuration:"
    hints = [
        f"  - {name}: a TRL/OpenRLHF name, not a field here; {TRL_NAMES['grpo'][name]}"
        for name in trl
    ]
    assert lines[1 : 1 + len(trl)] == hints
    assert "  - learning_rate: a TRL/OpenRLHF name, not a field here; it is optim.lr" in lines
    assert (
        "  - num_generations: a TRL/OpenRLHF name, not a field here; it is rollout.group_size"
        in (lines)
    )
    # the rest are what the config lacks once the TRL names are set aside: no "unknown key"
    assert not [line for line in lines if "unknown key" in line]


def test_a_trl_name_inside_a_section_gets_the_hint_too():
    with pytest.raises(ConfigError, match=r"train\.learning_rate: a TRL/OpenRLHF name, not a "):
        load_config(SFTConfig, overrides={"train.learning_rate": "1e-5"})
