"""1 vs 2 processes give the same multi-turn run (issue 26): PPO with the critic across turns and
GRPO over the two-turn ``Talk`` environment (tests/agents/agent_support.py), at the tolerances of
tests/distributed/test_run_invariance.py. Each process runs its own trajectories to the end; the
gathered experience carries ``Rollout.context_mask``, so the observations stay in attention on
every process (were they dropped, the update's log-probabilities — and everything after — would
differ from one process's)."""

from __future__ import annotations

import sys
from pathlib import Path

from multiproc import run_ranks
from ppo_support import prompt_texts, tiny_config
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
