"""The fused log-probabilities under FSDP2: the experience (log π_old, log π_ref) and one PPO update
on 2 processes, every log-probability from the hidden states of sharded models, equal the same on
one process through the logits.

Under FSDP2 the output layer's weight exists whole only inside the model's forward, and its
gradient reaches the reduce-scatter only as a gradient of that gathered tensor:
:mod:`proximal.models.output` computes the fused log-probabilities inside the forward for that
reason. Two heads are covered: a plain one with a frozen reference sharded as its own model (its
root reshards after every forward, so a weight read after it would be a shard), and LoRA adapters
on the head (its effective weight W + s·B A built from gathered tensors, the reference the same
model with its adapters off). If the head's gradient were lost, or read from a shard, the
parameters after the update would differ from one process's by the update itself (> 1e-3).

SGD keeps the update linear in the gradient, so what is left is float32 summation order: the
processes' shares against the whole batch, and the fused chunks against the logits' product;
asserted at 1e-6 (the bound of test_update_invariance.py); observed: log-probabilities 4.8e-7,
parameters after the update 1.2e-7.
"""

from __future__ import annotations

import pytest
import torch
from dist_support import fixed_rollout, gathered, sgd
from multiproc import run_ranks

from proximal import dist
from proximal.models.loading import load_tokenizer
from proximal.models.parallel import prepare_trained
from proximal.models.policy import build_actor, build_critic, load_reference
from proximal.rollout.experience import compute_experience, gather
from proximal.trainers.ppo import PPOUpdate, ppo_update

ATOL = 1e-6
LORA = dict(r=4, alpha=8, target_modules=["q_proj", "lm_head"])


def _experience_and_update(policy_path: str, rm_path: str, path: str, lora_head: bool) -> dict:
    tok = load_tokenizer(policy_path)
    W, cpu = dist.world_size(), torch.device("cpu")
    actor = build_actor(policy_path, dtype="float32", lora=LORA if lora_head else None)
    if lora_head:  # peft starts B at 0; give the head's adapters a value, the same on every rank
        g = torch.Generator().manual_seed(11)
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    reference = load_reference(
        actor, policy_path, lora=lora_head, precision="32-true", device=cpu, world_size=W
    )
    critic = build_critic(
        "reward_model",
        policy_path=policy_path,
        reward_model_path=rm_path,
        dtype="float32",
        pad_token_id=tok.pad_token_id,
    )
    for m in (actor, critic):
        prepare_trained(m, device=cpu, precision="32-true", world_size=W)
    # before any forward: the root of a sharded trained model keeps its parameters gathered after
    # one, and an optimiser built then would hold the gathered tensors
    actor_opt, critic_opt = sgd(actor, 0.5), sgd(critic, 0.5)
    rollout = fixed_rollout(tok)
    B = len(rollout)
    per = B // W
    mine = torch.arange(dist.rank() * per, (dist.rank() + 1) * per)
    exp = gather(  # each rank's share computed on its own, with sharded models
        compute_experience(
            rollout.select(mine),
            torch.linspace(-1, 1, B)[mine],
            torch.ones(per, dtype=torch.bool),
            actor=actor,
            reference=reference,
            critic=critic,
            micro_batch_size=3,
            logprobs_path=path,
        )
    )
    g = torch.Generator().manual_seed(7)
    mask = exp.rollout.response_mask
    old = torch.where(mask, exp.old_logprobs + 0.3 * torch.randn(mask.shape, generator=g), 0.0)
    adv = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    ret = torch.where(mask, exp.values + torch.randn(mask.shape, generator=g), 0.0)
    out = ppo_update(
        exp.replace(old_logprobs=old, advantages=adv, returns=ret),
        PPOUpdate(
            epochs=2,
            mini_batch_size=4,
            micro_batch_size=1,
            aggregation="token-mean",
            clip_eps=0.2,
            value_clip_eps=0.2,
            entropy_coef=0.01,
            vf_coef=0.5,
            target_kl=None,
            temperature=1.0,
            max_length=mask.shape[1],
            max_grad_norm=0.0,
            logprobs_path=path,
        ),
        actor=actor_opt,
        critic=critic_opt,
        shuffle_seed=3,
    )
    return {
        "logprobs": exp.old_logprobs,
        "ref_logprobs": exp.ref_logprobs,
        "actor": gathered(actor),
        "entropy": out["stats"]["policy/entropy"],
    }


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("lora_head", [False, True], ids=["plain-head", "lora-on-head"])
def test_fused_on_2_processes_is_the_logits_path_on_1(assets, lora_head):
    args = (str(assets.policy("llama")), str(assets.reward_model("llama")))
    logits_1 = run_ranks(1, _experience_and_update, *args, "logits", lora_head)[0]
    fused_2 = run_ranks(2, _experience_and_update, *args, "fused", lora_head)
    assert torch.equal(fused_2[0]["logprobs"], fused_2[1]["logprobs"])  # gathered: the same batch
    for key in ("logprobs", "ref_logprobs"):
        diff = float((fused_2[0][key] - logits_1[key]).abs().max())
        assert diff <= ATOL, (key, diff)
    if lora_head:  # the reference is the head with its adapters off: another distribution
        assert float((logits_1["logprobs"] - logits_1["ref_logprobs"]).abs().max()) > 1e-2
    start = run_ranks(1, _initial, *args, lora_head)[0]
    moved = [k for k in start if float((start[k] - logits_1["actor"][k]).abs().max()) > 1e-3]
    head = [k for k in moved if "lm_head" in k]
    assert head, "the update did not move the head (the test could not fail)"
    if lora_head:
        assert all("lora_" in k for k in head)
    assert _max_diff(fused_2[0]["actor"], logits_1["actor"]) <= ATOL
    assert fused_2[0]["entropy"] == pytest.approx(logits_1["entropy"], abs=ATOL)


def _initial(policy_path: str, rm_path: str, lora_head: bool) -> dict:
    """The actor's parameters before the update (the same seeded adapters)."""
    actor = build_actor(policy_path, dtype="float32", lora=LORA if lora_head else None)
    if lora_head:
        g = torch.Generator().manual_seed(11)
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in actor.state_dict().items()}
