"""Session fixtures for the PPO tests: the two full runs that several test modules inspect
(``llama_run``, ``lora_run``) run once per session. The tiny models, tokenizers and prompt files
(``assets``) come from ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # reward functions are configured as 'ppo_support:<name>'
    sys.path.insert(0, str(HERE))

from ppo_support import Spy, ppo_main, tiny_config  # noqa: E402


@dataclass
class Run:
    """A finished CLI run: its exit code, directory, config and the trainer's models (spied on)."""

    rc: int
    dir: Path
    config: dict
    models: object  # trainers.ppo.PPOModels


def run_with_models(monkeypatch, config: dict, *args: str) -> Run:
    """Run the CLI and keep the ``_Models`` the trainer built (``ppo.build_models``; for bitwise
    checks after training)."""
    from proximal.trainers import ppo

    spy = Spy(ppo.build_models)
    monkeypatch.setattr(ppo, "build_models", spy)
    rc = ppo_main(config, *args)
    return Run(rc, Path(config["output"]["dir"]), config, spy.results[-1] if spy.results else None)


@pytest.fixture(scope="session")
def llama_run(assets, tmp_path_factory) -> Run:
    """3 steps on Llama with a reward model (same tokenizer), a reward function, the critic initialised
    from the reward model (the default), checkpoints at steps 2 and 3."""
    run_dir = tmp_path_factory.mktemp("llama_run") / "run"
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        ppo={"epochs": 2},
    )
    with pytest.MonkeyPatch.context() as mp:
        return run_with_models(mp, cfg, "--train.steps", "3", "--train.save_every", "2")


@pytest.fixture(scope="session")
def lora_run(assets, tmp_path_factory) -> Run:
    """2 steps on Llama with LoRA on the actor and on the critic (initialised from the reward model)."""
    run_dir = tmp_path_factory.mktemp("lora_run") / "run"
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        optim={"lr": 1e-2, "critic_lr": 1e-2},
    )
    with pytest.MonkeyPatch.context() as mp:
        # the adapters alone in the checkpoints (merged: tests/trainers/test_lora_exports.py)
        return run_with_models(
            mp,
            cfg,
            "--model.lora_r",
            "4",
            "--model.critic_lora",
            "true",
            "--output.merge_lora",
            "false",
        )
