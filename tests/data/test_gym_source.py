"""reasoning-gym as a prompt source (issue 42, item 1): ``reasoning-gym://NAME?...`` yields the
generator's own entries (compared with ``create_dataset``'s, called here), a held-out split that
shares no seed and no question with training (the seed-shift trap shown first, with reasoning-gym
itself), weighted mixtures (each item's generator drawn here as reasoning-gym's composite draws it),
config mistakes and a missing package in one line, and a one-step ``proximal grpo`` run on the
source scored by ``proximal.rewards:reasoning_gym``."""

from __future__ import annotations

import json
import random
import sys

import pytest
import reasoning_gym as rg
from ppo_support import command_main, read_jsonl

from proximal.data import gym
from proximal.data.jsonl import DataError
from proximal.data.sources import is_data_source, read_rows, source_problem
from proximal.rewards import reasoning_gym

SMALL = "min_terms=2&max_terms=2&min_digits=1&max_digits=1"  # 10 × 2 × 10 = 200 questions


def test_the_train_split_is_create_datasets_entries():
    url = f"reasoning-gym://chain_sum?size=50&seed=7&{SMALL}&instruction=none"
    rows = list(read_rows(url))
    own = rg.create_dataset(
        "chain_sum", size=50, seed=7, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    assert len(rows) == 50
    for (_, row), entry in zip(rows, own):
        assert row["prompt"] == entry["question"] and row["answer"] == entry["answer"]
        meta = dict(entry["metadata"], difficulty={"num_terms": [2, 2], "num_digits": [1, 1]})
        assert row["metadata"] == meta  # JSON-able: the difficulty tuples as lists
        json.dumps(row)
        assert row["generator_config"] == {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
        }
    assert rows[3][0] == f"{url}[train][row 3]"


def test_the_instruction_is_reasoning_gyms_system_prompt_before_the_question():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    (_, default), *_ = read_rows("reasoning-gym://chain_sum?size=1")
    (_, direct), *_ = read_rows("reasoning-gym://chain_sum?size=1&instruction=direct")
    question = rg.create_dataset("chain_sum", size=1, seed=0)[0]["question"]
    assert default["prompt"] == SYSTEM_PROMPTS["default"].strip() + "\n\n" + question
    assert direct["prompt"] == SYSTEM_PROMPTS["direct"].strip() + "\n\n" + question
    assert "generator_config" not in default  # the default config: nothing to carry


def test_the_seed_shift_trap_is_real():
    """What the held-out scheme avoids: reasoning-gym's 'seed 1' is 'seed 0' shifted by one item."""
    zero = rg.create_dataset("chain_sum", size=20, seed=0)
    one = rg.create_dataset("chain_sum", size=20, seed=1)
    assert [one[i]["question"] for i in range(19)] == [zero[i + 1]["question"] for i in range(19)]


def test_the_held_out_split_shares_no_seed_and_no_question_with_training(capsys):
    url = f"reasoning-gym://chain_sum?size=150&seed=3&eval_size=100&{SMALL}&instruction=none"
    train = [r for _, r in read_rows(url)]
    test = [r for _, r in read_rows(url, split="test")]
    # by seed: item j of the held-out split was made by Random(held-out seed + j), every one past the
    # training split's Random(3 + i), i < 150 (one generator)
    assert gym.parse(url).held_out_seed() == 3 + 150 + 1
    cfg = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    drawn = rg.create_dataset("chain_sum", size=100, seed=154, **cfg)
    by_index = {e["metadata"]["source_index"]: e for e in drawn}
    for row in test:
        j = row["metadata"]["source_index"]
        assert 154 + j >= 3 + 150
        assert row["prompt"] == by_index[j]["question"]
    # by content: no held-out question is a training one, none twice; what went is counted
    train_q = {r["prompt"] for r in train}
    assert not train_q & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in test}) == len(test)
    in_train = sum(e["question"] in train_q for e in drawn)
    first = {}
    for e in drawn:
        if e["question"] not in train_q:
            first.setdefault(e["question"], e)
    repeated = 100 - in_train - len(first)
    assert in_train > 0 and repeated > 0, "the space is small: both kinds must occur"
    assert len(test) == len(first)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{url} [test]: {len(first)} held-out questions kept of 100 (seed 154): {in_train} also "
        f"in the training split and {repeated} repeated were dropped"
    ]


def test_a_mixture_draws_each_items_generator_by_its_weights():
    url = (
        "reasoning-gym://chain_sum,basic_arithmetic?size=400&seed=5&weights=3,1"
        "&chain_sum.max_terms=3&instruction=none"
    )
    rows = [r for _, r in read_rows(url)]
    names = ["chain_sum", "basic_arithmetic"]
    expected = [names[random.Random(5 + i).choices([0, 1], weights=[3, 1])[0]] for i in range(400)]
    assert [r["metadata"]["source_dataset"] for r in rows] == expected
    share = expected.count("chain_sum") / 400
    assert abs(share - 0.75) < 0.07  # 3 standard errors of 400 draws at 3:1
    for r in rows:  # each row carries its own generator's config, and scores by it
        name = r["metadata"]["source_dataset"]
        assert r.get("generator_config") == ({"max_terms": 3} if name == "chain_sum" else None)
    # the k-th generator's items are its own dataset's at seed + k + 1 (reasoning-gym's composite)
    own = rg.create_dataset("basic_arithmetic", size=400, seed=5 + 2)
    for i, r in enumerate(rows):
        if r["metadata"]["source_dataset"] == "basic_arithmetic":
            assert r["prompt"] == own[i]["question"] and r["answer"] == own[i]["answer"]


def test_the_rows_score_by_the_reasoning_gym_reward():
    rows = [r for _, r in read_rows(f"reasoning-gym://chain_sum?size=6&{SMALL}")]
    right = [f"<answer>{r['answer']}</answer>" for r in rows]
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in rows]
    cols = {k: [r.get(k) for r in rows] for k in ("answer", "metadata", "generator_config")}
    assert reasoning_gym(right, **cols) == [1.0] * 6
    assert reasoning_gym(wrong, **cols) == [0.0] * 6


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("reasoning-gym://", "no generator named (e.g. reasoning-gym://chain_sum)"),
        ("reasoning-gym://chain_sums", "'chain_sums' is not a reasoning-gym generator"),
        ("reasoning-gym://chain_sum?size=0", "size=0 must be an integer ≥ 1"),
        ("reasoning-gym://chain_sum?seed=x", "seed=x must be an integer ≥ 0"),
        ("reasoning-gym://chain_sum?foo=1", "chain_sum has no config field 'foo' (its fields: "),
        ("reasoning-gym://chain_sum?instruction=loud", "instruction=loud is none or a key of"),
        (
            "reasoning-gym://chain_sum?min_terms=4&max_terms=2",
            "chain_sum rejects its config {'min_terms': 4, 'max_terms': 2}: max_terms must be",
        ),
        (
            "reasoning-gym://chain_sum,basic_arithmetic?weights=1",
            "weights=1 must be 2 positive number(s), one per generator",
        ),
        (
            "reasoning-gym://chain_sum,basic_arithmetic?max_terms=3",
            "max_terms=3: with several generators a config field is NAME.max_terms",
        ),
    ],
)
def test_a_bad_source_is_one_config_line(url, message):
    problem = source_problem(url, "data.prompts")
    assert problem is not None and problem.startswith(f"data.prompts: {url}: ")
    assert message in problem and "\n" not in problem


def test_a_query_value_keeps_its_plus_signs():
    """'+' is an operator here, not a space (urllib's parse_qsl would read it as one)."""
    url = 'reasoning-gym://basic_arithmetic?operators=["+"]&size=5&allow_parentheses=false'
    rows = [r for _, r in read_rows(url)]
    assert rows[0]["generator_config"]["operators"] == ["+"]
    assert all(set(r["metadata"]["expression"]) <= set("0123456789 +") for r in rows)


def test_a_source_is_never_a_path_or_a_spec():
    url = "reasoning-gym://chain_sum"
    assert is_data_source(url) and source_problem(url, "data.prompts") is None
    with pytest.raises(DataError, match=r"no split 'validation' \(a reasoning-gym source has"):
        list(read_rows(url, split="validation"))


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    problem = source_problem("reasoning-gym://chain_sum", "data.prompts")
    assert problem == (
        "data.prompts: reasoning-gym://chain_sum: a reasoning-gym source needs reasoning-gym "
        "(module 'reasoning_gym.factory' is not installed): pip install 'proximal-rlhf[reasoning]'"
    )


def test_grpo_trains_a_step_on_a_reasoning_gym_source(assets, tmp_path, capsys):
    """One GRPO step on reasoning-gym://chain_sum, rewarded by proximal.rewards:reasoning_gym: each
    sample's row is the source's and its score is the generator's score_answer of its answer."""
    url = f"reasoning-gym://chain_sum?size=4&seed=0&{SMALL}&instruction=none"
    cfg = {
        "model": {
            "path": str(assets.policy("llama")),
            "reward_functions": ["proximal.rewards:reasoning_gym"],
        },
        "data": {"prompts": url, "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 1, "seed": 0, "device": "cpu"},
        "output": {"dir": str(tmp_path / "run"), "progress": False, "samples_per_step": 8},
    }
    assert command_main("grpo", cfg) == 0, capsys.readouterr().err
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(samples) == 8
    entries = rg.create_dataset(
        "chain_sum", size=4, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    score_answer = rg.get_score_answer_fn("chain_sum")
    tok = assets.tokenizer
    seen = {tok.decode(tok(e["question"]).input_ids[-16:]): e for e in entries}
    for s in samples:
        entry = seen[s["prompt"]]  # the prompt as the tiny tokenizer kept it (its last 16 tokens)
        assert s["score"] == s["score/proximal.rewards:reasoning_gym"]
        assert s["score"] == score_answer(gym_extract(s["response"]), entry)
    assert len({s["prompt"] for s in samples}) == 2


def gym_extract(text: str):
    from reasoning_gym.utils import extract_answer

    return extract_answer(text, tag_name="answer")
