"""TRL's ``None`` rewards (issue 37, item 2): a reward function returns None for a completion it does
not apply to. A row's total is the weighted sum over the functions that scored it; a row no function
scored has no score and follows ``rollout.nonfinite_scores`` (TRL would train on 0); a NaN stays a
non-finite score. ``score/<name>`` averages over the rows the function scored, and
``score/<name>_count`` counts them.

Expected values are written out by hand from the functions' definitions."""

from __future__ import annotations

import json
import math

import pytest
import torch
from ppo_support import prompt_texts, read_jsonl
from reward_support import code_reward, math_reward
from test_reward_functions import ALPHABET, TEMPLATE, _grpo_config, _rollout

from proximal.data.jsonl import write_jsonl
from proximal.logging import write_samples
from proximal.models.tiny import build_char_tokenizer
from proximal.rollout.collect import finite_rows
from proximal.rollout.reward_functions import RewardFunctionError, call_reward_functions
from proximal.rollout.scoring import Scorer, score_metrics

NAN = float("nan")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(list(ALPHABET), chat_template=TEMPLATE)


def _score(tok, functions, weights, responses, task):
    rollout = _rollout(tok, ["a 1"] * len(responses), [(r, True) for r in responses])
    scorer = Scorer(tok, functions=functions, function_weights=weights)
    return scorer(rollout, ["a 1"] * len(responses), columns=[{"task": t} for t in task], step=1)


def test_the_multi_task_pattern_scores_every_row_by_the_function_that_applies(tok):
    """Two functions, each None on the other task's rows: every row has a finite total, its own
    function's weighted score; each function's metric averages over its own rows only."""
    task = ["math", "code", "math", "code"]
    responses = ["ab", "abc", "cd", "d"]
    total, parts = _score(
        tok, {"math": math_reward, "code": code_reward}, {"math": 2.0, "code": 0.5}, responses, task
    )
    # math: 'a' in "ab" → 1, 'a' in "cd" → 0 (×2); code: len("abc") = 3, len("d") = 1 (×0.5)
    assert total.tolist() == [2.0, 1.5, 0.0, 0.5]
    assert parts["math"][[0, 2]].tolist() == [1.0, 0.0] and parts["math"][[1, 3]].isnan().all()
    assert parts["code"][[1, 3]].tolist() == [3.0, 1.0] and parts["code"][[0, 2]].isnan().all()
    valid = finite_rows(total, responses, step=1, policy="error", device=torch.device("cpu"))
    assert valid.tolist() == [True] * 4
    assert score_metrics(parts, valid, ["math", "code"]) == {
        "score/math": 0.5,
        "score/math_count": 2,
        "score/code": 2.0,
        "score/code_count": 2,
    }


def test_a_row_no_function_scores_follows_nonfinite_scores(tok):
    """Row 1 has neither task: no function scores it, so it has no score (NaN, not TRL's 0): 'skip'
    leaves it out of training, 'error' stops the run naming it."""
    task = ["math", "other", "code"]
    total, parts = _score(
        tok, {"math": math_reward, "code": code_reward}, None, ["a", "b", "cc"], task
    )
    assert total[[0, 2]].tolist() == [1.0, 2.0] and math.isnan(total[1])
    cpu = torch.device("cpu")
    valid = finite_rows(total, ["p0", "p1", "p2"], step=3, policy="skip", device=cpu)
    assert valid.tolist() == [True, False, True]
    assert score_metrics(parts, valid, ["math", "code"]) == {
        "score/math": 1.0,
        "score/math_count": 1,
        "score/code": 2.0,
        "score/code_count": 1,
    }
    with pytest.raises(
        FloatingPointError, match=r"^step 3: non-finite scores \[nan\] for prompts \['p1'\]"
    ):
        finite_rows(total, ["p0", "p1", "p2"], step=3, policy="error", device=cpu)
    only, _ = _score(tok, {"math": math_reward}, None, ["a", "b"], ["code", "other"])
    with pytest.raises(FloatingPointError, match="no reward function scored the row"):
        finite_rows(only, ["p0", "p1"], step=3, policy="skip", device=cpu)


def test_an_environments_reward_scores_the_rows_no_function_scored(tok):
    """In an agent run with an environment's reward (added by the caller), a row no function scored
    is scored: the functions' part of its total is 0, not NaN."""
    rollout = _rollout(tok, ["a 1"] * 2, [("a", True), ("b", True)])
    scorer = Scorer(tok, functions={"math": math_reward})
    columns = [{"task": "math"}, {"task": "code"}]
    total, _ = scorer(rollout, ["a 1"] * 2, columns=columns, step=1, scored_elsewhere=True)
    assert total.tolist() == [1.0, 0.0]


def test_none_mixed_with_nan(tok):
    """A NaN is a non-finite score even where another function scored the row; a None beside a
    number leaves the number. The metrics count only trained rows a function scored."""

    def f(prompts, completions):
        return [None, NAN, 1.0]

    def g(prompts, completions):
        return [2.0, 3.0, None]

    total, parts = _score(tok, {"f": f, "g": g}, {"f": 1.0, "g": 10.0}, ["a", "b", "c"], ["x"] * 3)
    assert total[0] == 20.0 and math.isnan(total[1]) and total[2] == 1.0
    valid = finite_rows(
        total, ["p0", "p1", "p2"], step=1, policy="skip", device=torch.device("cpu")
    )
    assert valid.tolist() == [True, False, True]
    assert score_metrics(parts, valid, ["f", "g"]) == {
        "score/f": 1.0,
        "score/f_count": 1,
        "score/g": 2.0,
        "score/g_count": 1,
    }
    scores, scored = call_reward_functions(
        {"f": f}, {"prompts": ["p"] * 3, "completions": ["c"] * 3}, n=3
    )
    assert scored["f"].tolist() == [False, True, True] and scores["f"][2] == 1.0


def test_anything_else_than_a_number_or_none_is_still_refused(tok):
    def text(prompts, completions):
        return ["1.0" for _ in completions]

    with pytest.raises(
        RewardFunctionError,
        match=r"^reward function 'text' at step 1 returned a non-number at position 0: str '1.0' "
        r"\(a number, or None where the function does not apply\)$",
    ):
        _score(tok, {"text": text}, None, ["a"], ["x"])


def test_samples_write_null_for_a_function_that_did_not_apply(tok, tmp_path):
    total, parts = _score(
        tok, {"math": math_reward, "code": code_reward}, None, ["a", "bb"], ["math", "code"]
    )
    write_samples(
        tmp_path, 1, ["p0", "p1"], ["a", "bb"], total, parts, torch.ones(2, dtype=torch.bool), 2
    )
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["score/math"], r["score/code"]) for r in rows] == [(1.0, None), (None, 2.0)]


def test_evaluation_weighs_and_averages_only_what_a_function_scored(assets, tmp_path):
    """evaluate_policy: a function's None stays None in its rows, its mean is over the rest, and the
    weighted score of a row is over the functions that scored it (None where none did)."""
    from proximal.evaluation import evaluate_policy

    texts = prompt_texts(3)
    task = ["math", "code", "other"]
    write_jsonl(tmp_path / "e.jsonl", [{"prompt": p, "task": t} for p, t in zip(texts, task)])
    policy = str(assets.policy("llama"))
    ev = evaluate_policy(
        policy,
        reference=policy,
        prompts_file=tmp_path / "e.jsonl",
        scores={"math": math_reward, "code": code_reward},
        weights={"math": 1.0, "code": 2.0},
        max_new_tokens=3,
        max_prompt_length=64,
    )
    rows = ev["rows"]
    m, c = float("a" in rows[0]["response"]), float(len(rows[1]["response"]))
    assert [r["math"] for r in rows] == [m, None, None]
    assert [r["code"] for r in rows] == [None, c, None]
    assert [r["score"] for r in rows] == [m, 2.0 * c, None]
    assert ev["mean"]["math"] == m and ev["mean"]["code"] == c
    assert ev["mean"]["score"] == (m + 2.0 * c) / 2


def test_a_grpo_run_trains_on_every_row_of_the_multi_task_pattern(assets, tmp_path):
    """GRPO, 4 prompts (2 math, 2 code) × G = 3 a step, each function None on the other task's rows:
    the run trains on every row (TRL's multi-task pattern ended with "every score in the batch is
    non-finite"), and each function's count is its task's 6 rows."""
    from proximal.config import load_config
    from proximal.trainers import grpo

    texts = prompt_texts(4)
    write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": p, "task": ("math", "code")[i % 2]} for i, p in enumerate(texts)],
    )
    cfg = _grpo_config(
        assets.policy("llama"),
        tmp_path / "p.jsonl",
        tmp_path / "run",
        reward_functions=["reward_support:math_reward", "reward_support:code_reward"],
    )
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    grpo.train(load_config(grpo.GRPOConfig, tmp_path / "run.yaml"))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["data/skipped_nonfinite"] == 0 and r["data/trained_frac"] == 1.0, r
        assert r["score/reward_support:math_reward_count"] == 6
        assert r["score/reward_support:code_reward_count"] == 6
        assert math.isfinite(r["score/mean"])
