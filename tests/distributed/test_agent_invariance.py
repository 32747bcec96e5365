"""1 vs 2 processes give the same multi-turn run (issue 26): PPO with the critic across turns and
GRPO over the two-turn ``Talk`` environment (tests/agents/agent_support.py), at the tolerances of
tests/distributed/test_run_invariance.py. Each process runs its own trajectories to the end; the
gathered experience carries ``Rollout.context_mask``, so the observations stay in attention on
every process. The control: with the mask dropped in ``gather`` (as before ab93248) the update's
log-probabilities — and everything after — differ from one process's, and the comparison fails."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from multiproc import run_ranks
from ppo_support import load_safetensors_dir, prompt_texts, read_jsonl, tiny_config
from test_run_invariance import _compare, _train

from proximal.data.jsonl import write_jsonl

AGENTS = str(Path(__file__).resolve().parents[1] / "agents")  # agent_support, for ranks and workers


def test_ppo_multi_turn_1_vs_2_processes(assets, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(AGENTS)
    assert AGENTS in sys.path
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p, "turns": 2} for p in prompt_texts(16)])

    def cfg(name):
        return tiny_config(
            assets.policy("llama"),
            prompts,
            tmp_path / name,
            model={"reward_functions": ["ppo_support:length"]},
            rollout={"batch_size": 8, "max_new_tokens": 6, "stop_token_ids": [11, 12, 13]},
            ppo={"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2},
            env={"factory": "agent_support:Talk", "max_turns": 3},
            tools={"workers": 1},
            train={"steps": 2, "save_every": 0},
        )

    one = run_ranks(1, _train, "ppo", cfg("w1"), "checkpoints/step_000002/policy")[0]
    two = run_ranks(2, _train, "ppo", cfg("w2"), "checkpoints/step_000002/policy")[0]
    _compare(one, two, lr=1e-3)
    assert any(r["agent/turns"] > 1 for r in one[0])


# ----------------------------------------------------------------------------------------------
# GRPO, and the control: the same comparison fails when gather drops the context mask
# ----------------------------------------------------------------------------------------------


def _gather_without_context(gather):
    """``experience.gather`` as it was before ab93248: on several processes the gathered rollout
    has no ``context_mask``, so attention no longer sees the observations (one process: the
    identity, as then)."""

    def dropped(exp):
        from proximal import dist

        out = gather(exp)
        if dist.world_size() == 1:
            return out
        return out.replace(rollout=dataclasses.replace(out.rollout, context_mask=None))

    return dropped


def _train_grpo(cfg: dict, drop_context: bool = False):
    """Inside a rank: ``grpo.train`` on ``cfg`` (optionally with :func:`_gather_without_context` —
    patched in this forked rank only); rank 0 returns the metrics and the final weights."""
    import yaml

    from proximal import dist
    from proximal.config import load_config
    from proximal.rollout import experience
    from proximal.trainers import grpo

    if drop_context:
        grpo.gather = _gather_without_context(experience.gather)
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        path.write_text(yaml.safe_dump(cfg))
    dist.barrier()
    run_dir = grpo.train(load_config(grpo.GRPOConfig, path))
    if not dist.is_main():
        return None
    return read_jsonl(run_dir / "metrics.jsonl"), load_safetensors_dir(run_dir)


def _grpo_config(assets, prompts: Path, run_dir: Path) -> dict:
    """Two GRPO steps over the two-turn ``Talk`` environment: 4 prompts × G = 2, μ = 2 iterations
    of 2 mini-batches (the second pass off-policy, so π_old's log-probabilities — read with the
    observations in attention — enter every ratio), the length reward beside the environment's
    rewards (advantages not zero), β = 0.1."""
    return {
        "model": {"path": str(assets.policy("llama")), "reward_functions": ["ppo_support:length"]},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {
            "batch_size": 4,
            "group_size": 2,
            "max_new_tokens": 6,
            "stop_token_ids": [11, 12, 13],
        },
        "grpo": {
            "iterations": 2,
            "mini_batch_size": 4,
            "micro_batch_size": 2,
            "beta": 0.1,
            "clip_eps": 0.005,
        },
        "env": {"factory": "agent_support:Talk", "max_turns": 3},
        "tools": {"workers": 1},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu", "save_every": 0},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }


@pytest.fixture(scope="module")
def grpo_runs(assets, tmp_path_factory):
    """The one-process run, and a factory for two-process runs (with or without the dropped mask)."""
    tmp = tmp_path_factory.mktemp("grpo_agent")
    prompts = tmp / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p, "turns": 2} for p in prompt_texts(16)])
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(AGENTS)
        one = run_ranks(1, _train_grpo, _grpo_config(assets, prompts, tmp / "w1"))[0]

        def two(name: str, drop_context: bool = False):
            cfg = _grpo_config(assets, prompts, tmp / name)
            return run_ranks(2, _train_grpo, cfg, drop_context)[0]

        yield one, two


def test_grpo_multi_turn_1_vs_2_processes(grpo_runs):
    """GRPO over the gathered multi-turn batch (group baselines over whole trajectories, per-turn
    rewards in the score): the same metrics and weights on 1 and 2 processes."""
    one, two = grpo_runs
    _compare(one, two("w2"), lr=1e-3)
    rows = one[0]
    assert all(r["agent/turns"] > 1 for r in rows)  # observations inside the responses
    assert all(r["advantage/max"] > 0 for r in rows)  # the policy term is not zero
    assert max(r["policy/clipfrac"] for r in rows) > 0  # the second pass is off-policy and clips


def test_grpo_multi_turn_1_vs_2_differ_when_gather_drops_the_context_mask(grpo_runs):
    """The control: with ``Rollout.context_mask`` left out of the gathered experience, the two-process
    run's update reads every later turn without the observations before it, and the comparison above
    fails."""
    one, two = grpo_runs
    dropped = two("w2_dropped", drop_context=True)
    with pytest.raises(AssertionError, match="1 vs 2 processes"):
        _compare(one, dropped, lr=1e-3)
    first, other = one[0][0], dropped[0][0]
    assert other["score/mean"] == first["score/mean"]  # the same rollouts: only the update differs
    # measured: grad_norm/actor 0.851 vs 0.812 at step 1 (4.5 %), 400× the tolerance of 1e-4
    assert abs(other["grad_norm/actor"] / first["grad_norm/actor"] - 1) > 1e-2
