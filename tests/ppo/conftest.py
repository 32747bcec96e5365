"""Session fixtures for the PPO tests: tiny models, tokenizers and prompt files, built once, on disk.

Everything is made here with :mod:`proximal.models.tiny` and saved in Hugging Face format, so the
trainer loads it through the same ``from_pretrained`` path a user's checkpoint takes; nothing is
downloaded. Models are built lazily (a test that needs GPT-2 builds GPT-2), and the two full runs
that several test modules inspect (``llama_run``, ``lora_run``) run once per session.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # reward functions are configured as 'ppo_support:<name>'
    sys.path.insert(0, str(HERE))

from ppo_support import ALPHABET, Spy, ppo_main, prompt_texts, tiny_config  # noqa: E402

# A second tokenizer for a reward model: other special-token strings, the alphabet reversed (so every
# id differs from the policy's) and a few characters the policy never writes.
OTHER_ALPHABET = "9876543210 hgfedcbaxyz"
OTHER_SPECIALS = ("[PAD]", "[EOS]", "[BOS]", "[UNK]")


class Assets:
    """Tiny checkpoints and data files under one session temp dir; each built on first use."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cached_property
    def tokenizer(self):
        from proximal.models.tiny import build_char_tokenizer

        return build_char_tokenizer(list(ALPHABET))

    @functools.cached_property
    def other_tokenizer(self):
        from proximal.models.tiny import build_char_tokenizer

        return build_char_tokenizer(list(OTHER_ALPHABET), specials=OTHER_SPECIALS)

    @functools.cache
    def policy(self, arch: str = "llama") -> Path:
        from proximal.models.tiny import build_tiny_causal_lm

        return build_tiny_causal_lm(self.root / f"policy_{arch}", self.tokenizer, arch=arch, seed=0)

    @functools.cache
    def reward_model(self, arch: str = "llama") -> Path:
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(self.root / f"rm_{arch}", self.tokenizer, arch=arch, seed=1)

    @functools.cached_property
    def other_tokenizer_reward_model(self) -> Path:
        """A GPT-2 reward model whose tokenizer differs from the policy's in every id and special token."""
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(self.root / "rm_other_tok", self.other_tokenizer, arch="gpt2", seed=2)

    @functools.cached_property
    def two_label_reward_model(self) -> Path:
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(self.root / "rm_2labels", self.tokenizer, arch="llama", num_labels=2)

    @functools.cached_property
    def no_pad_policy(self) -> Path:
        """A policy saved with a tokenizer that has no pad token (as many base LMs ship)."""
        from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

        tok = build_char_tokenizer(list(ALPHABET))
        tok.pad_token = None
        assert tok.pad_token_id is None
        return build_tiny_causal_lm(self.root / "policy_no_pad", tok, arch="llama", seed=0)

    @functools.cached_property
    def prompts(self) -> Path:
        from proximal.data.jsonl import write_jsonl

        path = self.root / "prompts.jsonl"
        write_jsonl(path, [{"prompt": p} for p in prompt_texts()])
        return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    return Assets(tmp_path_factory.mktemp("ppo_assets"))


@dataclass
class Run:
    """A finished CLI run: its exit code, directory, config and the trainer's models (spied on)."""

    rc: int
    dir: Path
    config: dict
    models: object  # trainers.ppo._Models


def run_with_models(monkeypatch, config: dict, *args: str) -> Run:
    """Run the CLI and keep the ``_Models`` the trainer built (``ppo.build_models``; for bitwise checks after training)."""
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
    cfg = tiny_config(assets.policy("llama"), assets.prompts, run_dir,
                      model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
                      ppo={"epochs": 2})
    with pytest.MonkeyPatch.context() as mp:
        return run_with_models(mp, cfg, "--train.steps", "3", "--train.save_every", "2")


@pytest.fixture(scope="session")
def lora_run(assets, tmp_path_factory) -> Run:
    """2 steps on Llama with LoRA on the actor and on the critic (initialised from the reward model)."""
    run_dir = tmp_path_factory.mktemp("lora_run") / "run"
    cfg = tiny_config(assets.policy("llama"), assets.prompts, run_dir,
                      model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
                      optim={"lr": 1e-2, "critic_lr": 1e-2})
    with pytest.MonkeyPatch.context() as mp:
        return run_with_models(mp, cfg, "--model.lora_r", "4", "--model.critic_lora", "true")
