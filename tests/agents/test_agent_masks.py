"""The agent mask through the trainers' own update functions, on a fixed multi-turn batch.

Changing everything at the observation positions — the models' outputs there (the policy's logits
and the critic's values, through their final hidden states) and every per-token label of the
experience (π_old, π_ref, μ, V_old, advantages, returns) — but not the observation *tokens*, which
later agent tokens attend to, changes no loss, no statistic and no gradient of ``grpo_update`` and
``ppo_update``, to the bit. The control, the same batch with the agent mask switched off (the
response mask = every real token), must fail it.

And the training forward's log-probabilities of the agent tokens equal the engine's own, taken while
sampling (``Rollout.behaviour_logprobs``), within the decode path's tested tolerance (2·2e-5/τ,
tests/rollout/test_engine_logprobs.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from agent_support import Echo
from ppo_support import ALPHABET
from transformers import AutoModelForCausalLM

from proximal.agents.env import Environments
from proximal.agents.trajectory import run_trajectories, to_rollout
from proximal.models.loading import load_sequence_scorer
from proximal.models.tiny import build_char_tokenizer
from proximal.rollout.engine import HFEngine, SamplingParams
from proximal.rollout.experience import compute_experience
from proximal.rollout.sampling import response_logprobs
from proximal.train.optim import Trained, build_scheduler
from proximal.trainers import grpo, ppo

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(list(ALPHABET))
    with open("tests/fixtures/data/chat_template.jinja") as f:
        t.chat_template = f.read()
    return t


@pytest.fixture(scope="module")
def model(assets):
    return AutoModelForCausalLM.from_pretrained(assets.policy("llama")).eval()


@pytest.fixture(scope="module")
def batch(tok, model):
    """Four three-turn trajectories of the tiny Llama against Echo (replies "ab"), with μ."""
    ids = [
        tok(p, add_special_tokens=False)["input_ids"]
        for p in ("8 abc 9 ", "8 a 9 ", "8 hh 9 ", "8 dd 9 ")
    ]
    stops = (tok.eos_token_id, *tok("0123456789", add_special_tokens=False)["input_ids"])
    trajs = run_trajectories(
        HFEngine(model, tok.pad_token_id), tok, Environments(Echo, workers=0), ids,
        [{"turns": 3}] * 4, seeds=[5, 6, 7, 8],
        params=SamplingParams(max_new_tokens=5, stop_token_ids=stops, temperature=TEMPERATURE),
        max_turns=3, max_tokens=60, logprobs=True,
    )  # fmt: skip
    r = to_rollout(trajs, tok.pad_token_id)
    holes = r.context_mask & ~r.response_mask
    assert int(holes.sum()) >= 4 and bool((holes.sum(1) > 0).sum() >= 2), "pick seeds with turns"
    return r


def test_training_logprobs_of_agent_tokens_are_the_engines(batch, model):
    got = response_logprobs(model, batch, TEMPERATURE, path="logits").logprobs.detach()
    agent = batch.response_mask
    err = (got - batch.behaviour_logprobs).abs()[agent].max()
    assert float(err) <= 2 * 2e-5 / TEMPERATURE, float(err)  # noqa: PLR2004
    # the control: the same forward with the observations hidden from attention is clearly off
    hidden = dataclasses.replace(batch, context_mask=None)
    off = response_logprobs(model, hidden, TEMPERATURE, path="logits").logprobs.detach()
    assert float((off - batch.behaviour_logprobs).abs()[agent].max()) > 1e-2


# ----------------------------------------------------------------------------------------------


def _noise_at(model: torch.nn.Module, full_ids: torch.Tensor, positions: torch.Tensor, seed: int):
    """Hooks adding noise to ``model``'s final hidden states (the final norm's output) at the
    positions of ``full_ids`` (B, L) that ``positions`` (B, L) marks — found in each forward's rows,
    which are a micro-batch's: some rows of the batch, trimmed (``Rollout.select``)."""
    norm = _final_norm(model)
    body = [m for m in model.modules() if norm in m.children()][0]
    seen = {}

    def remember(_mod, args, kwargs):
        seen["ids"] = kwargs.get("input_ids", args[0] if args else None)

    def add(_mod, _inp, out):
        ids, g = seen["ids"], torch.Generator().manual_seed(seed)
        noise = torch.randn(out.shape, generator=g) * 3.0
        where = torch.zeros(out.shape[:2], dtype=torch.bool)
        L = ids.shape[1]
        for i in range(ids.shape[0]):
            j, off = next(
                (j, off)
                for j in range(full_ids.shape[0])
                for off in range(full_ids.shape[1] - L + 1)
                if torch.equal(full_ids[j, off : off + L], ids[i])
            )
            where[i] = positions[j, off : off + L]
        return out + torch.where(where[..., None], noise, 0.0)

    return [
        body.register_forward_pre_hook(remember, with_kwargs=True),
        norm.register_forward_hook(add),
    ]


def _final_norm(m: torch.nn.Module) -> torch.nn.Module:
    return [
        mod for name, mod in m.named_modules() if name.endswith("norm") and "layers" not in name
    ][-1]


def _sgd(module) -> Trained:
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    return Trained(
        module, opt, build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=9)
    )


def _record(monkeypatch, trainer) -> list:
    grads = []
    step = getattr(trainer.clip_and_step, "original", trainer.clip_and_step)

    def record(model, opt, sched, max_norm, **kw):
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        return step(model, opt, sched, max_norm, **kw)

    record.original = step
    monkeypatch.setattr(trainer, "clip_and_step", record)
    return grads


def _experience(r, model, critic=None):
    g = torch.Generator().manual_seed(3)
    exp = compute_experience(r, torch.zeros(len(r)), torch.ones(len(r), dtype=torch.bool), actor=model,
                             critic=critic, temperature=TEMPERATURE)  # fmt: skip
    shape = r.response_ids.shape
    return exp.replace(
        old_logprobs=exp.old_logprobs
        + 0.3 * torch.randn(shape, generator=g),  # ratios leave the clip
        ref_logprobs=exp.old_logprobs + 0.2 * torch.randn(shape, generator=g),
        advantages=torch.randn(shape, generator=g),
        returns=torch.randn(shape, generator=g) if critic is not None else None,
    )


def _scramble(exp, holes):
    """Every (B, T) label of ``exp`` replaced by noise at the observation positions ``holes``."""
    g = torch.Generator().manual_seed(11)
    out = {}
    for f in dataclasses.fields(exp):
        v = getattr(exp, f.name)
        if isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_floating_point():
            out[f.name] = torch.where(holes, v - torch.rand(v.shape, generator=g), v)
    out["rollout"] = dataclasses.replace(
        exp.rollout,
        behaviour_logprobs=torch.where(
            holes, exp.rollout.behaviour_logprobs - 0.5, exp.rollout.behaviour_logprobs
        ),
    )
    return exp.replace(**out)


def _grpo_run(monkeypatch, model, exp, holes=None):
    actor = copy.deepcopy(model).train()
    grads = _record(monkeypatch, grpo)
    hooks = []
    if holes is not None:
        P = exp.rollout.prompt_ids.shape[1]
        at = torch.nn.functional.pad(holes, (P - 1, 1))  # position P-1+t predicts response token t
        hooks = _noise_at(actor, exp.rollout.input_ids, at, seed=1)
    try:
        out = grpo.grpo_update(
            exp,
            grpo.GRPOUpdate(
                aggregation="seq-mean-token-mean", iterations=2, mini_batch_size=2,
                micro_batch_size=1, clip_eps=0.2, clip_eps_high=0.28, beta=0.04,
                temperature=TEMPERATURE, max_length=60, max_grad_norm=1e9, entropy_coef=0.01,
                correction="tis",
            ),
            actor=_sgd(actor), shuffle_seed=0,
        )  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    return out["stats"], grads


def _ppo_run(monkeypatch, model, critic, exp, holes=None):
    actor, value = copy.deepcopy(model).train(), copy.deepcopy(critic).train()
    grads = _record(monkeypatch, ppo)
    hooks = []
    if holes is not None:
        P = exp.rollout.prompt_ids.shape[1]
        at = torch.nn.functional.pad(holes, (P - 1, 1))
        ids = exp.rollout.input_ids
        hooks = _noise_at(actor, ids, at, 1) + _noise_at(value, ids, at, 2)
    try:
        out = ppo.ppo_update(
            exp,
            ppo.PPOUpdate(
                epochs=2, mini_batch_size=2, micro_batch_size=1, aggregation="token-mean",
                clip_eps=0.2, value_clip_eps=0.2, entropy_coef=0.01, vf_coef=0.5, target_kl=None,
                temperature=TEMPERATURE, max_length=60, max_grad_norm=1e9, correction="tis",
            ),
            actor=_sgd(actor), critic=_sgd(value), shuffle_seed=0,
        )  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    return out["stats"], grads


def _same(a, b) -> bool:
    (sa, ga), (sb, gb) = a, b
    same_stats = sa.keys() == sb.keys() and all(
        sa[k] == sb[k] or (sa[k] != sa[k] and sb[k] != sb[k]) for k in sa
    )
    return (
        same_stats
        and len(ga) == len(gb)
        and all(torch.equal(x, y) for gx, gy in zip(ga, gb) for x, y in zip(gx, gy))
    )


@pytest.mark.parametrize("mask", ["agent", "off"])
def test_grpo_update_never_reads_observation_positions(batch, model, monkeypatch, mask):
    r = batch if mask == "agent" else dataclasses.replace(batch, response_mask=batch.context_mask)
    holes = batch.context_mask & ~batch.response_mask
    exp = _experience(r, model)
    exp = exp.replace(advantages=exp.advantages[:, 0].contiguous())  # one per response
    base = _grpo_run(monkeypatch, model, exp)
    changed = _grpo_run(monkeypatch, model, _scramble(exp, holes), holes)
    assert _same(base, changed) == (mask == "agent")


@pytest.mark.parametrize("mask", ["agent", "off"])
def test_ppo_update_never_reads_observation_positions(batch, model, assets, monkeypatch, mask):
    critic = load_sequence_scorer(
        str(assets.policy("llama")), role="critic", dtype="float32", pad_token_id=0, new_head=True
    )
    torch.nn.init.normal_(critic.score.weight, std=0.5)
    r = batch if mask == "agent" else dataclasses.replace(batch, response_mask=batch.context_mask)
    holes = batch.context_mask & ~batch.response_mask
    exp = _experience(r, model, critic)
    base = _ppo_run(monkeypatch, model, critic, exp)
    changed = _ppo_run(monkeypatch, model, critic, _scramble(exp, holes), holes)
    assert _same(base, changed) == (mask == "agent")
