"""``proximal ppo`` and ``proximal grpo`` with ``env:`` / ``tools:`` end to end on the tiny Llama.

* A one-turn environment whose ``get_reward`` is the verifier's score reproduces today's single-turn
  run bit for bit — metrics and weights (the trajectory path changes nothing when there is one turn).
* A multi-turn run: agent/* metrics every step, samples.jsonl keeps each trajectory's turns, the
  per-turn rewards reach the score (GRPO) and the shaped rewards (PPO).
* Tools in a run: a raising tool, a hanging one (ended within its timeout + slack), a malformed call
  and a non-text result — each counted in agent/*, none hangs or crashes the run.
* Resume of a multi-turn run continues exactly.
* The one-line refusals.
"""

from __future__ import annotations

import torch
from ppo_support import (
    checkpoint_dirs,
    command_main,
    load_safetensors_dir,
    prompt_texts,
    read_jsonl,
    tiny_config,
    without_timing,
)

from proximal.data.jsonl import write_jsonl


def ppo_main(config: dict | None, *args: str) -> int:
    return command_main("ppo", config, *args)


def grpo_main(config: dict | None, *args: str) -> int:
    return command_main("grpo", config, *args)


def grpo_config(policy, prompts, run_dir, **sections) -> dict:
    """tests/trainers/grpo_support.py's few cheap GRPO steps (that directory is not on this one's path)."""
    cfg = {
        "model": {"path": str(policy), "reward_functions": ["ppo_support:frac_a"]},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _prompts(tmp_path, n: int = 8, **columns):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": p, **columns} for p in prompt_texts(n)])
    return path


def _comparable(row: dict) -> dict:
    """A metrics row without timing and without the agent's own metrics."""
    return {k: v for k, v in without_timing(row).items() if not k.startswith("agent/")}


def _final_weights(run_dir):
    return load_safetensors_dir(checkpoint_dirs(run_dir)[-1] / "policy")


def _same_runs(a_dir, b_dir):
    a, b = read_jsonl(a_dir / "metrics.jsonl"), read_jsonl(b_dir / "metrics.jsonl")
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        x, y = _comparable(x), _comparable(y)
        diff = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
        assert not diff, f"step {x['step']}: {diff}"
    wa, wb = _final_weights(a_dir), _final_weights(b_dir)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# One turn, done after it, no reward of its own: the verifier scores the trajectory, as it scores
# today's response. (An environment's get_reward sees the turns it stepped; a turn cut by
# rollout.max_new_tokens is never stepped, so a FracA environment would score those 0.)
ONE_TURN = {"factory": "agent_support:OneTurn", "max_turns": 1}


def test_grpo_one_turn_environment_is_todays_run_bit_for_bit(assets, tmp_path, capsys):
    prompts = _prompts(tmp_path)
    train = {"steps": 2, "save_every": 2}
    plain = grpo_config(assets.policy("llama"), prompts, tmp_path / "plain", train=train)
    agent = grpo_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "agent",
        train=train,
        env=ONE_TURN,
        tools={"workers": 1},
    )
    assert grpo_main(plain) == 0, capsys.readouterr().err
    assert grpo_main(agent) == 0, capsys.readouterr().err
    _same_runs(tmp_path / "plain", tmp_path / "agent")
    rows = read_jsonl(tmp_path / "agent" / "metrics.jsonl")
    assert all(r["agent/turns"] == 1.0 for r in rows)
    assert read_jsonl(tmp_path / "plain" / "samples.jsonl") == [
        {k: v for k, v in r.items() if k != "trajectory"}
        for r in read_jsonl(tmp_path / "agent" / "samples.jsonl")
    ]


def test_ppo_one_turn_environment_is_todays_run_bit_for_bit(assets, tmp_path, capsys):
    prompts = _prompts(tmp_path)
    train = {"steps": 2, "save_every": 2}
    plain = tiny_config(assets.policy("llama"), prompts, tmp_path / "plain", train=train)
    agent = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "agent",
        train=train,
        env=ONE_TURN,
        tools={"workers": 1},
    )
    assert ppo_main(plain) == 0, capsys.readouterr().err
    assert ppo_main(agent) == 0, capsys.readouterr().err
    _same_runs(tmp_path / "plain", tmp_path / "agent")
