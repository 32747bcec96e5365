"""Helpers for the multi-process tests: fixed rollouts, SGD-trained models, gathered parameters.

Every function here runs inside a rank started by :func:`multiproc.run_ranks` (or alone, with a
world of one), builds its models from the tiny checkpoints, and returns plain CPU tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from proximal import dist
from proximal.data.collate import pad_left
from proximal.models.parallel import full_state_dict, prepare_trained
from proximal.models.policy import build_actor, build_critic
from proximal.rollout.experience import compute_experience
from proximal.rollout.sampling import Rollout, stop_mask
from proximal.train.optim import Trained, build_scheduler

# Eight prompts and responses of different lengths, so the ranks' shares hold unequal token counts.
PROMPTS = ["ab 1", "c", "dd 3", "hhhhhhh 4", "e 5", "fg", "a", "bbbbb 8"]
RESPONSES = ["abc", "a", "cdefgh", "hh", "b", "abcdefg", "gg", "defg"]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def fixed_rollout(tok) -> Rollout:
    prompt_ids, prompt_mask = pad_left([ids(tok, p) for p in PROMPTS], tok.pad_token_id)
    rows = [ids(tok, r) + [tok.eos_token_id] for r in RESPONSES]
    T = max(map(len, rows))
    resp = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask, ended = stop_mask(resp, [tok.eos_token_id])
    return Rollout(prompt_ids, prompt_mask, resp, mask, ended)


def sgd(module: torch.nn.Module, lr: float) -> Trained:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    return Trained(
        module, opt, build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=100)
    )


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters on every rank (rank 0 gathers; broadcast so every rank can return them)."""
    state = full_state_dict(module)
    state = dist.broadcast_object(
        {k: v.detach().clone() for k, v in state.items()} if dist.is_main() else None
    )
    return state


def fixed_experience(tok, actor, critic):
    """The rollout above with its experience under the initial actor, a perturbed π_old (so some
    ratios leave the clip interval), and advantages and returns drawn once from a fixed seed."""
    r = fixed_rollout(tok)
    B = len(r)
    exp = compute_experience(
        r,
        torch.linspace(-1, 1, B),
        torch.ones(B, dtype=torch.bool),
        actor=actor,
        critic=critic,
        temperature=1.0,
        micro_batch_size=3,
    )
    g = torch.Generator().manual_seed(7)
    mask = r.response_mask
    old = torch.where(
        mask, exp.old_logprobs + 0.3 * torch.randn(exp.old_logprobs.shape, generator=g), 0.0
    )
    adv = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    ret = torch.where(mask, exp.values + torch.randn(mask.shape, generator=g), 0.0)
    return exp.replace(old_logprobs=old, advantages=adv, returns=ret)


def ppo_update_once(
    policy_path: str,
    rm_path: str,
    aggregation: str,
    micro_batch_size: int = 1,
    mini_batch_size: int = 4,
) -> dict[str, dict[str, torch.Tensor]]:
    """One PPO update (2 epochs × 2 mini-batches) with SGD on the fixed experience; the gathered
    actor and critic parameters after it."""
    from proximal.models.loading import load_tokenizer
    from proximal.trainers.ppo import PPOUpdate, ppo_update

    tok = load_tokenizer(policy_path)
    W = dist.world_size()
    actor = build_actor(policy_path, dtype="float32")
    critic = build_critic(
        "reward_model",
        policy_path=policy_path,
        reward_model_path=rm_path,
        dtype="float32",
        pad_token_id=tok.pad_token_id,
    )
    exp = fixed_experience(tok, actor, critic)  # computed unsharded, identically on every rank
    for m in (actor, critic):
        prepare_trained(m, device=torch.device("cpu"), precision="32-true", world_size=W)
    out = ppo_update(
        exp,
        PPOUpdate(
            epochs=2,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            aggregation=aggregation,
            clip_eps=0.2,
            value_clip_eps=0.2,
            entropy_coef=0.01,
            vf_coef=0.5,
            target_kl=None,
            temperature=1.0,
            max_length=exp.rollout.response_ids.shape[1],
            max_grad_norm=0.0,
        ),
        actor=sgd(actor, 0.5),
        critic=sgd(critic, 0.5),
        shuffle_seed=3,
    )
    return {"actor": gathered(actor), "critic": gathered(critic), "stats": out["stats"]}


def _shares(rows: list) -> list:
    """This rank's contiguous share of a global batch (as the samplers split it)."""
    per = len(rows) // dist.world_size()
    return rows[dist.rank() * per : (dist.rank() + 1) * per]


def sft_step_once(
    policy_path: str, records: list[dict], micro_batch_size: int
) -> dict[str, torch.Tensor]:
    """One SFT optimiser step (SGD) on ``records`` as one global batch; the gathered parameters."""
    from proximal.data.chat import encode_prompt, encode_response
    from proximal.data.sft import SFTExample
    from proximal.models.loading import load_causal_lm, load_tokenizer
    from proximal.train.batches import accumulate
    from proximal.train.optim import clip_and_step
    from proximal.trainers.sft import nll_step

    tok = load_tokenizer(policy_path, padding_side="right")
    rows = []
    for r in records:
        p = encode_prompt(r["prompt"], tok)
        rows.append(SFTExample(p + encode_response(r["response"], tok), len(p), "test"))
    model = load_causal_lm(policy_path)
    prepare_trained(
        model, device=torch.device("cpu"), precision="32-true", world_size=dist.world_size()
    )
    t = sgd(model, 0.5)
    n_tokens = sum(e.n_targets for e in rows)
    sums = accumulate(
        _shares(rows),
        micro_batch_size,
        lambda b: nll_step(model, b, tok.pad_token_id, "cpu", n_tokens / dist.world_size()),
    )
    clip_and_step(model, t.optimizer, t.scheduler, 0.0)
    return {"params": gathered(model), "loss": sums["loss_sum"] / n_tokens}


def rm_step_once(
    policy_path: str, records: list[dict], micro_batch_size: int
) -> dict[str, torch.Tensor]:
    """One reward-model optimiser step (SGD) on preference ``records``; the gathered parameters."""
    from proximal.data.chat import encode_prompt, encode_response
    from proximal.data.preferences import PreferencePair
    from proximal.models.loading import load_tokenizer
    from proximal.models.reward import load_reward_model
    from proximal.train.batches import accumulate
    from proximal.train.optim import clip_and_step
    from proximal.trainers.reward import pair_step

    tok = load_tokenizer(policy_path, padding_side="right")
    pairs = []
    for r in records:
        p = encode_prompt(r["prompt"], tok)
        pairs.append(
            PreferencePair(
                p + encode_response(r["chosen"], tok),
                p + encode_response(r["rejected"], tok),
                None,
                "test",
                len(p),
            )
        )
    torch.manual_seed(0)
    model, _ = load_reward_model(policy_path, "float32", tok)
    with torch.no_grad():  # a non-zero head, so the first step has a gradient everywhere
        model.score.weight.copy_(
            torch.linspace(-0.5, 0.5, model.score.weight.numel()).view_as(model.score.weight)
        )
    prepare_trained(
        model, device=torch.device("cpu"), precision="32-true", world_size=dist.world_size()
    )
    t = sgd(model, 0.1)
    sums = accumulate(
        _shares(pairs),
        micro_batch_size,
        lambda b: pair_step(model, b, tok.pad_token_id, "cpu", len(pairs) / dist.world_size()),
    )
    clip_and_step(model, t.optimizer, t.scheduler, 0.0)
    return {"params": gathered(model), "loss": sums["loss_sum"] / len(pairs)}


# ---- whole runs on 1 and 2 processes (tests/distributed/test_run_invariance.py's tolerances) ----

#: Metrics agree to relative 1e-4 with an absolute floor of 1e-4 (test_run_invariance.py says why).
REL, ABS = 1e-4, 1e-4


def train_in_rank(command: str, cfg: dict):
    """Inside a rank: ``proximal.trainers.<command>.train`` on ``cfg`` (written beside its output
    directory by rank 0); rank 0 returns ``(metrics rows, final weights)``, the others None."""
    import importlib

    import yaml

    from proximal.config import load_config

    module = importlib.import_module(f"proximal.trainers.{command}")
    cls = {"grpo": "GRPOConfig", "ppo": "PPOConfig", "distill": "DistillConfig"}[command]
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        path.write_text(yaml.safe_dump(cfg))
    dist.barrier()
    run_dir = module.train(load_config(getattr(module, cls), path))
    if not dist.is_main():
        return None
    from ppo_support import load_safetensors_dir, read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl"), load_safetensors_dir(run_dir)


def metric_close(a, b) -> bool:
    """Two values of one metric agree: floats to REL/ABS (NaN equals NaN), the rest exactly."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)
    return a == b


def assert_same_runs(one, two, *, steps: int, lr: float) -> None:
    """Two runs' ``(rows, weights)`` agree: every step's metrics but the clock's
    (:func:`metric_close`), and the weights — the 99.9th percentile of |Δw| ≤ 2e-5 and every
    |Δw| ≤ 2·lr (a flipped first Adam update at worst; test_run_invariance.py)."""
    from ppo_support import TIMING_PREFIXES

    (rows1, w1), (rows2, w2) = one, two
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == list(range(1, steps + 1))
    for a, b in zip(rows1, rows2, strict=True):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(TIMING_PREFIXES)}
        diff = {k: (a.get(k), b.get(k)) for k in keys if not metric_close(a.get(k), b.get(k))}
        assert not diff, f"step {a['step']}: 1 vs 2 processes: {diff}"
    assert w1.keys() == w2.keys()
    d = torch.cat([(w1[k].float() - w2[k].float()).abs().flatten() for k in sorted(w1)])
    assert float(torch.quantile(d, 0.999)) <= 2e-5
    assert float(d.max()) <= 2 * lr
