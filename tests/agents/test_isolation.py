"""One trajectory's crash fails that trajectory only: the others whose environments shared its
worker process run again from their own reset (docs/agents.md, "Robust tools")."""

from __future__ import annotations

import pytest
import torch
from agent_support import BadReset, Crashy
from ppo_support import ALPHABET

from proximal.agents.env import AgentError, Environments
from proximal.agents.trajectory import run_trajectories
from proximal.models.tiny import build_char_tokenizer
from proximal.rollout.engine import SamplingParams

TEMPLATE = "tests/fixtures/data/chat_template.jinja"


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(list(ALPHABET))
    with open(TEMPLATE) as f:
        t.chat_template = f.read()
    return t


class Scripted:
    """An engine that samples "a" then EOS for every row, and records each call's seeds."""

    def __init__(self, tok):
        self.turn = [tok.convert_tokens_to_ids("a"), tok.eos_token_id]
        self.seeds: list[list[int]] = []

    def generate(self, ids, mask, seeds, params, logprobs=False):
        self.seeds.append(list(seeds))
        out = torch.tensor([self.turn] * ids.shape[0])
        return (out, torch.zeros(out.shape)) if logprobs else out


def run(tok, rows, envs):
    engine = Scripted(tok)
    prompt = tok("8 ab 9 ", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,))
    trajs = run_trajectories(
        engine,
        tok,
        envs,
        [prompt] * len(rows),
        rows,
        seeds=list(range(100, 100 + len(rows))),
        params=params,
        max_turns=3,
        max_tokens=40,
    )
    return trajs, engine


@pytest.mark.parametrize("crash", ["exit", "hang"])
def test_one_crash_fails_one_trajectory(tok, crash):
    """Fault 3: slot 0 kills its worker (or hangs past the timeout) at its second step; slots 2
    and 4 share that worker (6 slots on 2 workers). Slot 2 was mid-way (its step queued behind
    slot 0's), slot 4 had finished (its get_reward asked after): both failed before. Now they run
    again from their own reset, with their own seeds, and score 1.0."""
    rows = [{"prompt": "ab", "turns": 2} for _ in range(6)]
    rows[0].update(crash=crash, crash_at=2)
    rows[4]["turns"] = 1
    envs = Environments(Crashy, timeout_s=1.0, workers=2)
    try:
        trajs, engine = run(tok, rows, envs)
        counts = envs.take_counts()
    finally:
        envs.close()
    assert [t.failed for t in trajs] == [True, False, False, False, False, False]
    assert [t.env_reward for t in trajs] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [t.stop for t in trajs] == ["failed", "done", "done", "done", "done", "done"]
    assert [len(t.turns) for t in trajs] == [2, 2, 2, 2, 1, 2]
    # slot 0's step and its get_reward (its environment is gone); nothing of the thrown-away tries
    assert counts["agent/env_errors"] == 2 and counts["agent/reruns"] == 2
    assert counts["agent/tool_timeouts"] == int(crash == "hang")
    # the re-run drew slots 2 and 4's own seeds again (turn 0 is the row's seed)
    assert [102, 104] in engine.seeds


def test_a_reset_that_raises_is_one_line(tok):
    """Fault 4: a reset that raises stopped the run with a 40-line traceback; now AgentError (a
    ConfigError, exit status 2) naming the class and the row."""
    envs = Environments(BadReset, workers=0)
    with pytest.raises(AgentError) as e:
        run(tok, [{"prompt": "ab"}, {"prompt": "cd"}], envs)
    assert str(e.value) == (
        "env.factory BadReset: reset failed for row 0 of the batch (prompt 'ab'): KeyError: 'answer'"
    )


def test_drop_leaves_failed_rows_out_and_lone_groups_whole():
    """env.on_failure: drop, G = 4: group 0 loses row 0 and keeps a baseline over its other three;
    group 1 is left with one member, whose baseline would be its own score: dropped whole."""
    from proximal.agents.collect import dropped_rows
    from proximal.core.grpo import grpo_advantages

    failed = torch.tensor([True, False, False, False, True, True, True, False])
    valid = torch.ones(8, dtype=torch.bool)
    dropped = dropped_rows(failed, valid, 4)
    assert dropped.tolist() == [True, False, False, False, True, True, True, True]
    assert dropped_rows(failed, valid, 1).tolist() == failed.tolist()  # PPO: the failed rows
    scores = torch.tensor([0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0])
    adv, train, _ = grpo_advantages(
        scores,
        valid & ~dropped,
        torch.ones(8, dtype=torch.bool),
        4,
        scale="group",
        eps=1e-4,
        skip_uniform_groups=False,
        mask_truncated=False,
    )
    # rows 1-3: mean 0.5, sample std 0.5
    expected = [0.0, 0.5 / 0.5001, 0.0, -0.5 / 0.5001, 0.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)
    assert train.tolist() == [False, True, True, True, False, False, False, False]


def test_a_long_tool_result_is_cut_and_counted():
    from agent_support import add, long_result

    envs = Environments(
        tools={"long_result": long_result, "add": add},
        call_format="minimal",
        workers=0,
        max_result_chars=100,
    )
    out = envs.step({0: "[long_result 250] [add 1 2]", 1: "[long_result 100]"})
    assert [m["content"] for m in out[0].messages] == [
        "x" * 100 + "… [cut: 250 characters, tools.max_result_chars = 100]",
        "3",
    ]
    assert out[1].messages[0]["content"] == "x" * 100
    assert envs.take_counts()["agent/results_truncated"] == 1
