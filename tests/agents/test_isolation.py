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
