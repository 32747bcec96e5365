"""``output.merge_lora`` in the commands that train a policy with LoRA beyond sft and rm: a DPO or
SimPO run directory, a PPO checkpoint's ``policy/`` and ``critic/`` (``model.critic_lora``) and a
GRPO checkpoint's ``policy/`` are, by default, plain models that load with ``from_pretrained`` and
compute what the trained (adapted, unmerged) model computes. And ``proximal rm`` starts from an
adapters-only SFT export (``output.merge_lora: false``), which has no ``config.json``.

The expected outputs are the live peft models' own forward passes (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), not the
merge (W + s·B·A); the two differ only by float32 round-off, hence the 1e-5 tolerance."""

from __future__ import annotations

import pytest
import torch
from grpo_support import grpo_config, grpo_main
from peft import AutoPeftModelForCausalLM
from ppo_support import Spy, checkpoint_dirs, ppo_main, tiny_config
from test_dpo_cli import write_yaml
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaForSequenceClassification,
)

from proximal.cli import main
from proximal.models.loading import ModelLoadError, load_sequence_scorer, load_tokenizer
from proximal.models.reward import load_reward_model
from proximal.trainers import dpo, grpo, ppo

IDS = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])


def _assert_plain_and_equal(directory, trained, loader, base_path):
    """``directory`` holds a plain model (no adapters) whose outputs on ``IDS`` equal ``trained``'s
    and differ from the untrained ``base_path``'s (so the adapters did move the model)."""
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    assert not (directory / "adapter_config.json").exists()
    exported = loader.from_pretrained(directory)
    assert not any("lora" in n for n, _ in exported.named_parameters())
    base = loader.from_pretrained(base_path)
    with torch.no_grad():
        got, before = exported(input_ids=IDS).logits, base(input_ids=IDS).logits
        want = trained(input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - before).abs().max() > 1e-3  # the adapters did change the model


@pytest.mark.parametrize("method", ["dpo", "simpo"])
def test_a_lora_preference_run_exports_the_merged_policy(assets, tmp_path, monkeypatch, method):
    spy = Spy(dpo.build_policy)
    monkeypatch.setattr(dpo, "build_policy", spy)
    config = write_yaml(
        tmp_path / f"{method}.yaml",
        assets.policy("llama"),
        tmp_path,
        method,
        model={"lora_r": 4},
        train={"steps": 2, "save_every": 2},
        optim={"lr": 5e-2},
    )
    assert main([method, "--config", config]) == 0  # output.merge_lora: true by default
    _, policy, _ = spy.results[-1]
    policy.eval()
    for directory in (tmp_path / "run", checkpoint_dirs(tmp_path / "run")[-1] / "policy"):
        _assert_plain_and_equal(directory, policy, AutoModelForCausalLM, assets.policy("llama"))


def test_a_lora_ppo_run_exports_the_merged_policy_and_critic(assets, tmp_path, monkeypatch):
    spy = Spy(ppo.build_models)
    monkeypatch.setattr(ppo, "build_models", spy)
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={
            "reward_model": str(assets.reward_model("llama")),
            "critic": "reward_model",
            "lora_r": 4,
            "critic_lora": True,
        },
        optim={"lr": 5e-2, "critic_lr": 5e-2},
        train={"steps": 1},
    )
    assert ppo_main(cfg) == 0
    m = spy.results[-1]
    [ckpt] = checkpoint_dirs(tmp_path / "run")
    _assert_plain_and_equal(ckpt / "policy", m.actor, AutoModelForCausalLM, assets.policy("llama"))
    _assert_plain_and_equal(
        ckpt / "critic", m.critic, AutoModelForSequenceClassification, assets.reward_model("llama")
    )


def test_a_lora_grpo_run_exports_the_merged_policy(assets, tmp_path, monkeypatch):
    spy = Spy(grpo.build_models)
    monkeypatch.setattr(grpo, "build_models", spy)
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"lora_r": 4},
        optim={"lr": 5e-2},
        train={"steps": 1},
    )
    assert grpo_main(cfg) == 0
    [ckpt] = checkpoint_dirs(tmp_path / "run")
    _assert_plain_and_equal(
        ckpt / "policy", spy.results[-1].actor, AutoModelForCausalLM, assets.policy("llama")
    )


def test_merge_lora_false_exports_the_adapters_alone(assets, tmp_path):
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"lora_r": 4},
        train={"steps": 1},
        output={"merge_lora": False},
    )
    assert grpo_main(cfg) == 0
    [ckpt] = checkpoint_dirs(tmp_path / "run")
    assert (ckpt / "policy" / "adapter_config.json").is_file()
    assert not (ckpt / "policy" / "model.safetensors").exists()


def _sft_adapters(assets, tmp_path):
    """``proximal sft`` with LoRA and ``output.merge_lora: false``: a run directory of adapters alone."""
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(f'{{"prompt": "{x} ", "response": "{x * 3}"}}\n' for x in "abcdefgh"))
    out = tmp_path / "sft"
    argv = [
        *("sft", "--model.path", str(assets.policy("llama")), "--model.lora_r", "2"),
        *("--data.train_file", str(rows), "--data.max_length", "16", "--optim.lr", "5e-2"),
        *("--train.steps", "2", "--train.batch_size", "4", "--train.micro_batch_size", "4"),
        *("--train.device", "cpu", "--output.dir", str(out), "--output.progress", "false"),
        *("--output.merge_lora", "false"),
    ]
    assert main(argv) == 0
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    return out


def test_rm_starts_from_an_adapters_only_sft_export(assets, tmp_path):
    """The reward model's backbone is the SFT model with its adapters applied (compared with peft's
    own unmerged model), its new head is zero, and ``proximal rm`` trains and exports it."""
    sft_dir = _sft_adapters(assets, tmp_path)
    tokenizer = load_tokenizer(str(sft_dir), padding_side="right")
    scorer, new_head = load_reward_model(str(sft_dir), "float32", tokenizer)
    assert new_head and isinstance(scorer, LlamaForSequenceClassification)
    assert all(p.requires_grad for p in scorer.parameters())
    adapted = AutoPeftModelForCausalLM.from_pretrained(str(sft_dir))  # unmerged: x·Wᵀ + s·x·Aᵀ·Bᵀ
    base = AutoModelForCausalLM.from_pretrained(assets.policy("llama"))
    with torch.no_grad():
        got = scorer.model(input_ids=IDS).last_hidden_state
        want = adapted.get_base_model().model(input_ids=IDS).last_hidden_state
        before = base.model(input_ids=IDS).last_hidden_state
        assert torch.equal(scorer(input_ids=IDS).logits, torch.zeros(1, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - before).abs().max() > 1e-3  # the SFT adapters did change the backbone

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            f'{{"prompt": "{x} ", "chosen": "{x * 3}", "rejected": "{x}"}}\n' for x in "abcdefgh"
        )
    )
    argv = [
        *("rm", "--model.path", str(sft_dir), "--data.train_file", str(pairs)),
        *("--data.max_length", "16", "--train.steps", "1", "--train.batch_size", "4"),
        *("--train.micro_batch_size", "4", "--train.device", "cpu"),
        *("--output.dir", str(tmp_path / "rm"), "--output.progress", "false"),
    ]
    assert main(argv) == 0
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert rm.config.num_labels == 1


def test_ppo_starts_from_an_adapters_only_sft_export(assets, tmp_path):
    """A critic initialised from the policy (``model.critic: policy``) over an adapters-only SFT
    export is the adapted backbone (peft's own unmerged model) under a fresh zero head, and
    ``proximal ppo`` trains from that export (it used to stop: peft's classifier loader refused the
    causal-LM adapters)."""
    sft_dir = _sft_adapters(assets, tmp_path)
    critic = load_sequence_scorer(str(sft_dir), role="critic", new_head=True)
    assert isinstance(critic, LlamaForSequenceClassification)
    adapted = AutoPeftModelForCausalLM.from_pretrained(str(sft_dir)).get_base_model()
    with torch.no_grad():
        got = critic.model(input_ids=IDS).last_hidden_state
        want = adapted.model(input_ids=IDS).last_hidden_state
        assert torch.equal(critic(input_ids=IDS).logits, torch.zeros(1, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelLoadError, match="language model's LoRA adapters"):
        load_sequence_scorer(str(sft_dir), role="reward model")  # not a reward model

    cfg = tiny_config(
        str(sft_dir),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.reward_model("llama")), "critic": "policy"},
        train={"steps": 1},
    )
    assert ppo_main(cfg) == 0
