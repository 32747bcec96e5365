"""Token in, token out: a multi-turn rollout of a tiny model, checked id by id.

The engine is wrapped to record what it was given and what it sampled; the trajectory must be
exactly the sampled ids (cut at the turn's stop token) and the observation ids appended after them,
the agent mask True exactly on the sampled ones, and each turn's input exactly the prompt and
everything before it — nothing decoded and encoded again.
"""

from __future__ import annotations

import pytest
import torch
from agent_support import Echo, Greeter, OneTurn
from ppo_support import ALPHABET
from transformers import AutoModelForCausalLM

from proximal.agents.env import Environments
from proximal.agents.trajectory import observation_ids, run_trajectories, to_rollout
from proximal.data.collate import pad_left
from proximal.models.tiny import build_char_tokenizer
from proximal.rollout.engine import HFEngine, SamplingParams, row_seed
from proximal.rollout.sampling import Rollout, response_logprobs, sample

TEMPLATE = (
    "tests/fixtures/data/chat_template.jinja"  # user "8 " + c + " ", assistant "9 " + c + EOS
)


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(list(ALPHABET))
    with open(TEMPLATE) as f:
        t.chat_template = f.read()
    return t


@pytest.fixture(scope="module")
def model(assets):
    return AutoModelForCausalLM.from_pretrained(assets.policy("llama")).eval()


class Recording:
    """An engine that records each call: (ids, mask, seeds, params, sampled)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, ids, mask, seeds, params, **kw):
        out = self.engine.generate(ids, mask, seeds, params, **kw)
        sampled = out[0] if isinstance(out, tuple) else out
        self.calls.append((ids.clone(), mask.clone(), list(seeds), params, sampled.clone()))
        return out


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def stops(tok) -> tuple[int, ...]:
    # EOS and every digit end a turn, so the random tiny model ends its turns within a few tokens
    return (tok.eos_token_id, *ids_of(tok, "0123456789"))


def test_observation_ids_are_the_templates_text_after_the_turn(tok):
    # after the assistant's EOS the template writes the user turn "8 ab " and the generation prompt "9 "
    assert observation_ids(tok, [{"role": "user", "content": "ab"}]) == ids_of(tok, "8 ab 9 ")
    tool = [{"role": "tool", "name": "f", "content": "12"}, {"role": "tool", "content": "3"}]
    assert observation_ids(tok, tool) == ids_of(tok, "8 12 8 3 9 ")


def test_ids_are_exactly_the_sampled_and_the_observation_ids(tok, model):
    engine = Recording(HFEngine(model, tok.pad_token_id))
    prompts = [ids_of(tok, "8 abc 9 "), ids_of(tok, "8 a 9 "), ids_of(tok, "8 hh 9 ")]
    rows = [
        {"prompt": "abc", "turns": 3},
        {"prompt": "a", "turns": 2},
        {"prompt": "hh", "turns": 4},
    ]
    seeds = [11, 12, 13]
    params = SamplingParams(max_new_tokens=5, stop_token_ids=stops(tok))
    envs = Environments(Echo, workers=2, timeout_s=30)
    try:
        trajs = run_trajectories(
            engine, tok, envs, prompts, rows, seeds=seeds, params=params, max_turns=4,
            max_tokens=200,
        )  # fmt: skip
    finally:
        envs.close()
    obs = ids_of(tok, "8 ab 9 ")  # Echo's reply, as the template renders it after a turn
    stop_set = set(stops(tok))
    for b, t in enumerate(trajs):
        expected, mask, turn = [], [], 0
        for ids, amask, call_seeds, _, sampled in engine.calls:
            want = seeds[b] if turn == 0 else row_seed(seeds[b], turn)
            if want not in call_seeds:
                continue
            i = call_seeds.index(want)
            # the turn's input: exactly the prompt and everything appended so far, left-padded
            real = ids[i][amask[i].bool()].tolist()
            assert real == prompts[b] + expected
            seq = sampled[i].tolist()
            cut = next((j for j, x in enumerate(seq) if x in stop_set), len(seq))
            seq = seq[: min(cut + 1, params.max_new_tokens)]
            expected += seq
            mask += [True] * len(seq)
            turn += 1
            if len(t.turns) > turn:  # the trajectory went on: the observation follows
                expected += obs
                mask += [False] * len(obs)
        assert t.ids == expected and t.agent_mask == mask
        assert len(t.turns) == turn >= 1
        if t.stop == "done":  # Echo ends after `turns` turns, each rewarded 0.5
            assert turn == rows[b]["turns"] and t.ended
            assert [u.reward for u in t.turns] == [0.5] * turn and t.env_reward == float(turn)
        else:
            assert t.stop == "turn_length" and not t.ended
    assert [len(t.turns) for t in trajs] == [3, 2, 4]  # these seeds exercise several turns
    assert [t.stop for t in trajs] == ["done", "done", "done"]


def test_scoring_sees_the_observations(tok, model):
    """The trainer's forward over the converted rollout gives each agent token the log-probability
    of a forward over exactly the ids before it (observations attended to); a plain Rollout whose
    attention mask is the agent mask (observations hidden) does not."""
    engine = HFEngine(model, tok.pad_token_id)
    prompts = [ids_of(tok, "8 abc 9 "), ids_of(tok, "8 a 9 ")]
    params = SamplingParams(max_new_tokens=5, stop_token_ids=stops(tok))
    envs = Environments(Echo, workers=0)
    trajs = run_trajectories(
        engine, tok, envs, prompts, [{"turns": 3}, {"turns": 3}], seeds=[5, 6], params=params,
        max_turns=3, max_tokens=100,
    )  # fmt: skip
    assert any(len(t.turns) > 1 for t in trajs), "pick seeds whose turns stop"
    r = to_rollout(trajs, tok.pad_token_id)
    got = response_logprobs(model, r, path="logits").logprobs
    hidden = Rollout(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, r.ended)
    wrong = response_logprobs(model, hidden, path="logits").logprobs
    differs = False
    for b, t in enumerate(trajs):
        full = torch.tensor([t.prompt_ids + t.ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(full).logits[0].float(), -1)
        P = len(t.prompt_ids)
        for j, agent in enumerate(t.agent_mask):
            if agent:
                ref = lp[P + j - 1, t.ids[j]]
                assert got[b, j].item() == pytest.approx(ref.item(), abs=2e-5)
                differs |= abs(wrong[b, j].item() - ref.item()) > 1e-3
    assert differs  # the control: hiding the observations changes the later agent tokens


def test_one_turn_is_todays_single_turn_rollout(tok, model):
    engine = HFEngine(model, tok.pad_token_id)
    prompts = [ids_of(tok, "8 abc 9 "), ids_of(tok, "8 a 9 "), ids_of(tok, "8 hh 9 ")]
    seeds = [row_seed(0, 1, r) for r in range(3)]
    envs = Environments(OneTurn, workers=0)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=stops(tok))
    trajs = run_trajectories(
        engine, tok, envs, prompts, [{}] * 3, seeds=seeds, params=params, max_turns=3,
        max_tokens=6,
    )  # fmt: skip
    got = to_rollout(trajs, tok.pad_token_id)
    ids, mask = pad_left(prompts, tok.pad_token_id)
    today = sample(
        engine, tok, ids, mask, seeds=seeds, max_new_tokens=6, stop_token_ids=list(stops(tok))[1:]
    )
    assert torch.equal(got.prompt_ids, today.prompt_ids)
    assert torch.equal(got.prompt_mask, today.prompt_mask)
    T = got.response_ids.shape[1]
    assert torch.equal(got.response_ids, today.response_ids[:, :T])
    assert torch.equal(got.response_mask, today.response_mask[:, :T])
    assert not today.response_mask[:, T:].any()
    assert torch.equal(got.ended, today.ended)
    assert torch.equal(got.attention_mask, today.attention_mask[:, : got.attention_mask.shape[1]])


def test_limits_end_trajectories_cleanly(tok, model):
    engine = HFEngine(model, tok.pad_token_id)
    prompts = [ids_of(tok, "8 abc 9 ")] * 3
    params = SamplingParams(max_new_tokens=5, stop_token_ids=stops(tok))
    envs = Environments(Echo, workers=0)
    rows = [{"turns": 99}] * 3
    seeds = [21, 22, 23]

    def run(**limits):
        return run_trajectories(
            engine, tok, envs, prompts, rows, seeds=seeds, params=params, **limits
        )

    for t in run(max_turns=2, max_tokens=500):
        assert len(t.turns) <= 2 and t.stop in ("max_turns", "turn_length") and not t.ended
    for t in run(max_turns=50, max_tokens=12):
        assert len(t.ids) <= 12 and t.stop in ("max_tokens", "turn_length") and not t.ended
    P = len(prompts[0])
    for t in run(max_turns=50, max_tokens=500, max_context=P + 15):
        assert P + len(t.ids) <= P + 15 and t.stop in ("context", "turn_length")
    assert any(t.stop == "context" for t in run(max_turns=50, max_tokens=500, max_context=P + 15))


def test_a_first_observation_extends_the_prompt(tok, model):
    engine = HFEngine(model, tok.pad_token_id)
    params = SamplingParams(max_new_tokens=3, stop_token_ids=stops(tok))
    envs = Environments(Greeter, workers=0)
    text = run_trajectories(
        engine, tok, envs, [ids_of(tok, "8 c 9 ")], [{}], seeds=[1], params=params, max_turns=1,
        max_tokens=3,
    )[0]  # fmt: skip
    assert text.prompt_ids == ids_of(tok, "8 c 9 ab")  # a text prompt: the string appended
    chat = run_trajectories(
        engine, tok, envs, [ids_of(tok, "8 c 9 ")], [{}], seeds=[1], params=params, max_turns=1,
        max_tokens=3, messages=[[{"role": "user", "content": "c"}]],
    )[0]  # fmt: skip
    assert chat.prompt_ids == ids_of(tok, "8 cab 9 ")  # messages: added to the last user turn
