"""The four PPO models of seed §2, built from config values.

- actor π_θ: an ``AutoModelForCausalLM``, optionally with LoRA adapters (peft);
- reference π_ref: a frozen copy of the actor's starting weights — or, with LoRA, the same weights
  with the adapters disabled, so no second copy is held in memory;
- reward model r_ψ: a frozen one-label ``AutoModelForSequenceClassification``;
- critic V_φ: a one-label sequence-classification model used per token, initialised from the reward
  model (the default), from the policy (a fresh zero head) or from a path.
"""

from __future__ import annotations

import contextlib

import torch

from proximal.models.loading import freeze, load_causal_lm, load_sequence_scorer


def lora_config(task_type: str, r: int, alpha: float, target_modules: list[str]):
    """LoRA without dropout: models stay in eval mode in RLHF, so dropout would never act anyway."""
    from peft import LoraConfig

    targets = target_modules[0] if target_modules == ["all-linear"] else list(target_modules)
    return LoraConfig(task_type=task_type, r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)


def build_actor(path: str, *, dtype: str, lora: dict | None = None, adapter_path: str | None = None):
    """The trainable policy. With ``lora`` (r, alpha, target_modules) only adapters train;
    ``adapter_path`` resumes adapters saved by an earlier run."""
    model = load_causal_lm(path, role="policy", dtype=dtype)
    if lora:
        from peft import PeftModel, get_peft_model

        if adapter_path is not None:
            model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
        else:
            model = get_peft_model(model, lora_config("CAUSAL_LM", **lora))
    model.eval()  # no dropout anywhere in RLHF: the rollout and the update must see one policy
    return model


class Reference:
    """π_ref: a frozen copy, or the LoRA actor with its adapters switched off."""

    def __init__(self, actor, *, path: str | None, dtype: str, shares_actor: bool):
        self.shares_actor = shares_actor
        if shares_actor:
            self.model = actor
        else:
            self.model = load_causal_lm(path, role="reference", dtype=dtype)
            freeze(self.model)

    @contextlib.contextmanager
    def active(self):
        if self.shares_actor:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model


def build_critic(source: str, *, policy_path: str, reward_model_path: str | None, dtype: str,
                 pad_token_id: int, lora: dict | None = None, path: str | None = None):
    """V_φ. ``source``: 'reward_model', 'policy' or a checkpoint path; ``path`` overrides (resume)."""
    if path is not None:
        model = load_sequence_scorer(path, role="critic", dtype=dtype, pad_token_id=pad_token_id)
    elif source == "reward_model":
        model = load_sequence_scorer(reward_model_path, role="critic (from the reward model)", dtype=dtype,
                                     pad_token_id=pad_token_id)
    elif source == "policy":
        model = load_sequence_scorer(policy_path, role="critic (from the policy)", dtype=dtype,
                                     pad_token_id=pad_token_id, new_head=True)
    else:
        model = load_sequence_scorer(source, role="critic", dtype=dtype, pad_token_id=pad_token_id)
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config("SEQ_CLS", **lora))
    model.eval()
    return model


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
