"""Reference and reward model are never updated (Ouyang et al. 2022: the reference is a frozen copy
of the SFT model, the reward model is frozen);
with LoRA the reference is the base model itself, adapters switched off."""

from __future__ import annotations

import torch
from ppo_support import assert_state_equal, load_safetensors_dir


def test_reference_and_reward_model_bitwise_unchanged(llama_run, assets):
    assert llama_run.rc == 0
    m = llama_run.models
    policy_on_disk = load_safetensors_dir(assets.policy("llama"))
    rm_on_disk = load_safetensors_dir(assets.reward_model("llama"))

    assert_state_equal(m.reference.model, policy_on_disk, "reference after 3 PPO steps")
    assert_state_equal(m.scorer.reward_model, rm_on_disk, "reward model after 3 PPO steps")
    for model, name in ((m.reference.model, "reference"), (m.scorer.reward_model, "reward model")):
        assert not model.training, f"{name} is in train mode"
        assert not any(p.requires_grad for p in model.parameters()), (
            f"{name} has trainable parameters"
        )

    # The control: the models that should train did (so the comparison above can fail).
    actor = m.actor.state_dict()
    assert any(not torch.equal(actor[k], v) for k, v in policy_on_disk.items()), (
        "the actor did not change"
    )
    critic = m.critic.state_dict()
    assert any(not torch.equal(critic[k], v) for k, v in rm_on_disk.items()), (
        "the critic did not change"
    )
    assert m.critic is not m.scorer.reward_model
    assert all(
        p.data_ptr() != q.data_ptr()
        for p, q in zip(m.critic.parameters(), m.scorer.reward_model.parameters())
    )


def test_lora_reference_is_the_base_model(lora_run, assets):
    from transformers import AutoModelForCausalLM

    assert lora_run.rc == 0
    m = lora_run.models
    assert m.reference.model is m.actor  # no second copy in memory
    base = AutoModelForCausalLM.from_pretrained(assets.policy("llama"))
    ids = torch.tensor([[0, 0, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
    att = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = base(input_ids=ids, attention_mask=att).logits
        with m.reference.active() as ref:
            got = ref(input_ids=ids, attention_mask=att).logits
        trained = m.actor(input_ids=ids, attention_mask=att).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(trained, expected, atol=1e-4), "the LoRA adapters did not train"
    assert torch.equal(
        m.actor(input_ids=ids, attention_mask=att).logits, trained
    )  # adapters back on

    # The base weights under both LoRA models are untouched, and so is the reward model.
    base_actor = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in m.actor.state_dict().items()
        if "lora_" not in k
    }
    for k, v in load_safetensors_dir(assets.policy("llama")).items():
        assert torch.equal(base_actor[k], v), f"actor base weight {k} changed"
    rm_on_disk = load_safetensors_dir(assets.reward_model("llama"))
    assert_state_equal(m.scorer.reward_model, rm_on_disk, "reward model (LoRA run)")
    base_critic = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in m.critic.state_dict().items()
        if "lora_" not in k and "modules_to_save" not in k and "original_module" not in k
    }
    for k, v in rm_on_disk.items():
        if not k.startswith("score."):  # the scalar head is fully trained (peft modules_to_save)
            assert torch.equal(base_critic[k], v), f"critic base weight {k} changed"
