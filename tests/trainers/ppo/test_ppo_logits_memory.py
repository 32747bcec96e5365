"""Issue 22's memory test: a PPO step at a large vocabulary never allocates a (B, T, V) tensor on the
fused path (``train.logprobs: fused``), and does on the logits path (the control).

The step is built from the trainer's own functions — the experience (log π_old, log π_ref, V_old:
:func:`proximal.rollout.experience.compute_experience`) and the update (clipped surrogate with a
trained entropy bonus, value loss: :func:`proximal.trainers.ppo.ppo_update`) — on a tiny Llama with
V = 32,768 and one micro-batch of B = 8 responses of T = 128 tokens: B·T·V = 2^25 elements. The
evidence is the profiler's allocation events (every allocation's size, recorded by
``torch.profiler.profile(profile_memory=True)``), not time or resident memory: the largest single
allocation of the fused step must stay below B·T·V elements at 2 bytes each (the smallest float a
logits tensor could have), while the logits path's must reach it (its float32 logits are 4 bytes
per element, 268 MB).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from proximal.models.tiny import tiny_config
from proximal.rollout.experience import compute_experience
from proximal.rollout.sampling import Rollout
from proximal.train.optim import Trained, build_scheduler
from proximal.trainers.ppo import PPOUpdate, ppo_update

V, B, P, T = 32_768, 8, 8, 128
LOGITS_BYTES = B * T * V * 2  # a (B, T, V) tensor of the narrowest float


class _Frozen:
    """A frozen reference, entered as :class:`proximal.models.policy.Reference` is."""

    def __init__(self, model):
        self.model = model

    @contextlib.contextmanager
    def active(self):
        yield self.model


def _trained(module) -> Trained:
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    return Trained(
        module, opt, build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=1)
    )


def _step(path: str) -> None:
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(tiny_config("llama", V, hidden=32, layers=1)).eval()
    reference = copy.deepcopy(actor).requires_grad_(False)
    critic = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", V, hidden=32, layers=1, num_labels=1)
    ).eval()
    g = torch.Generator().manual_seed(1)
    response = torch.randint(4, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 100:] = False  # one shorter response
    rollout = Rollout(
        torch.randint(4, V, (B, P), generator=g),
        torch.ones(B, P, dtype=torch.long),
        torch.where(mask, response, 0),
        mask,
        mask[:, -1].logical_not(),
    )
    exp = compute_experience(
        rollout,
        torch.linspace(-1, 1, B),
        torch.ones(B, dtype=torch.bool),
        actor=actor,
        reference=_Frozen(reference),
        critic=critic,
        micro_batch_size=B,
        logprobs_path=path,
    )
    adv = torch.where(mask, torch.randn(B, T, generator=g), 0.0)
    exp = exp.replace(advantages=adv, returns=torch.where(mask, exp.values + adv, 0.0))
    ppo_update(
        exp,
        PPOUpdate(
            epochs=1,
            mini_batch_size=B,
            micro_batch_size=B,
            aggregation="token-mean",
            clip_eps=0.2,
            value_clip_eps=0.2,
            entropy_coef=0.01,  # the entropy bonus trained on: its gradient goes through the same path
            vf_coef=0.5,
            target_kl=None,
            temperature=0.7,
            max_length=T,
            max_grad_norm=1.0,
            logprobs_path=path,
        ),
        actor=_trained(actor),
        critic=_trained(critic),
        shuffle_seed=0,
    )


def _largest_allocation(path: str) -> int:
    """The largest single allocation (bytes) of one PPO step, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(path)

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    sizes = [n.extra_fields.alloc_size for n in walk(tree) if n.tag == _EventType.Allocation]
    assert sizes, "the profiler recorded no allocation"
    return max(sizes)


def test_fused_ppo_step_never_allocates_a_logits_tensor():
    fused = _largest_allocation("fused")
    logits = _largest_allocation("logits")
    # the control: the logits path holds the (B, T, V) float32 logits (and their gradient)
    assert logits >= B * T * V * 4, f"the logits path's largest allocation is {logits:,} bytes"
    # the fused path: nothing as large as B·T·V elements of any float dtype
    assert fused < LOGITS_BYTES, (
        f"the fused path allocated {fused:,} bytes at once (B·T·V·2 = {LOGITS_BYTES:,})"
    )
    print(f"largest allocation: fused {fused:,} B, logits {logits:,} B (B·T·V = {B * T * V:,})")
