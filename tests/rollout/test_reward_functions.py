"""Reward functions that see the data (issue 24, deliverable 1): called as TRL's GRPOTrainer calls
them — the prompt row's other columns as keywords, one value per completion in the rollout's order,
``completion_ids``, ``step`` / ``trainer_state``, conversational prompts as messages — with the first
convention ``f(prompts, completions)`` unchanged, ``async def`` functions awaited together, callables
accepted, and ``model.reward_timeout_s`` ending a hung run with one line.

Expected values are built from the prompt rows the test writes (``reward_support.answer_of``), never
from the code under test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from ppo_support import frac_a, prompt_texts, read_jsonl
from reward_support import ENV, answer_of

from proximal.config import ConfigError
from proximal.data.collate import pad_left
from proximal.data.jsonl import write_jsonl
from proximal.data.prompts import load_prompts
from proximal.models.tiny import build_char_tokenizer
from proximal.rollout.collect import load_inputs
from proximal.rollout.reward_functions import (
    DEFAULT_TIMEOUT_S,
    RewardFunctionError,
    reward_argument_problems,
    reward_function_names,
)
from proximal.rollout.sampling import Rollout
from proximal.rollout.scoring import Scorer
from proximal.train.sections import OnlineModelSection

HERE = Path(__file__).resolve().parent
TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
ALPHABET = "abcdefgh 0123456789<>:"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(list(ALPHABET), chat_template=TEMPLATE)


def _ids(tok, text: str) -> list[int]:
    """Hand ids: specials are 0..3 and ALPHABET[i] is 4 + i."""
    return [4 + ALPHABET.index(c) for c in text]


def _rollout(tok, prompt_texts_: list[str], responses: list[tuple[str, bool]]) -> Rollout:
    """A rollout written by hand: each response's characters, then EOS where it ended."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompt_ids, prompt_mask = pad_left([tok(p).input_ids for p in prompt_texts_], pad)
    rows = [_ids(tok, text) + ([eos] if ended else []) for text, ended in responses]
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[j < len(r) for j in range(T)] for r in rows])
    return Rollout(prompt_ids, prompt_mask, ids, mask, torch.tensor([e for _, e in responses]))


def _prompt_set(tok, tmp_path, rows: list[dict]):
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    return load_prompts(str(tmp_path / "prompts.jsonl"), tok, max_length=32)


class Recorder:
    """A TRL-style reward function (``**kwargs``) that keeps what it was given; scores 0.25 each."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return [0.25] * len(completions)


def test_each_completion_gets_its_own_rows_columns_in_rollout_order(tok, tmp_path):
    """G = 3 completions per prompt: each prompt's answer (and other columns) repeated 3 times in the
    rollout's row order; completion_ids are the response tokens with the stop token; the step."""
    texts = ["ab 1", "cdd 2"]
    ps = _prompt_set(
        tok,
        tmp_path,
        [{"prompt": p, "answer": answer_of(p), "level": i} for i, p in enumerate(texts)],
    )
    idx = [1, 1, 1, 0, 0, 0]  # the sampler's order: prompt 1's group first
    responses = [("a", True), ("bb", False), ("", True), ("c1", True), ("h", False), ("22", True)]
    rollout = _rollout(tok, [ps.texts[i] for i in idx], responses)
    rec = Recorder()
    scorer = Scorer(tok, functions={"rec": rec})
    total, parts = scorer(rollout, [ps.texts[i] for i in idx], columns=ps.columns_of(idx), step=7)
    (call,) = rec.calls
    assert call["answer"] == [answer_of("cdd 2")] * 3 + [answer_of("ab 1")] * 3
    assert call["level"] == [1, 1, 1, 0, 0, 0]
    assert call["prompts"] == ["cdd 2"] * 3 + ["ab 1"] * 3
    assert call["completions"] == ["a", "bb", "", "c1", "h", "22"]
    eos = tok.eos_token_id
    assert call["completion_ids"] == [
        _ids(tok, "a") + [eos],
        _ids(tok, "bb"),
        [eos],
        _ids(tok, "c1") + [eos],
        _ids(tok, "h"),
        _ids(tok, "22") + [eos],
    ]
    assert call["step"] == 7 and call["trainer_state"].global_step == 7
    assert set(call) == {
        "prompts",
        "completions",
        "completion_ids",
        "answer",
        "level",
        "step",
        "trainer_state",
    }
    torch.testing.assert_close(parts["rec"], torch.full((6,), 0.25), rtol=0, atol=0)
    torch.testing.assert_close(total, torch.full((6,), 0.25), rtol=0, atol=0)


def test_the_first_convention_is_called_as_before(tok, tmp_path):
    """``f(prompts, completions)`` — parameters named anything — gets the two lists positionally and no
    column, so it neither fails on the extra data nor changes its scores."""
    seen = []

    def old(ps, cs):
        seen.append((ps, cs))
        return [len(c) for c in cs]

    ps = _prompt_set(tok, tmp_path, [{"prompt": "ab 1", "answer": "9"}])
    rollout = _rollout(tok, ["ab 1", "ab 1"], [("aab", True), ("h", False)])
    scorer = Scorer(tok, functions={"old": old, "frac_a": frac_a})
    _, parts = scorer(rollout, ["ab 1", "ab 1"], columns=ps.columns_of([0, 0]), step=1)
    assert seen == [(["ab 1", "ab 1"], ["aab", "h"])]
    assert parts["old"].tolist() == [3.0, 1.0]
    assert frac_a(["ab 1", "ab 1"], ["aab", "h"]) == [2 / 3, 0.0]
    torch.testing.assert_close(parts["frac_a"], torch.tensor([2 / 3, 0.0]), rtol=0, atol=0)


def test_a_function_gets_only_the_keywords_it_names(tok):
    got = {}

    def by_name(completions, answer, step):  # TRL's keyword call, no **kwargs
        got.update(completions=completions, answer=answer, step=step)
        return [1.0] * len(completions)

    rollout = _rollout(tok, ["a 1"], [("b", True)])
    Scorer(tok, functions={"f": by_name})(
        rollout, ["a 1"], columns=[{"answer": "7", "x": 1}], step=2
    )
    assert got == {"completions": ["b"], "answer": ["7"], "step": 2}


def test_async_functions_are_awaited_together(tok):
    """The two async functions can only both finish if they run at the same time: ``first`` waits for
    ``second`` to have started (and gives up after 10 s, which fails the test, rather than hanging)."""
    started = asyncio.Event()
    order = []

    async def first(prompts, completions, **kwargs):
        await asyncio.wait_for(started.wait(), 10)
        order.append("first")
        return [1.0 for _ in completions]

    async def second(prompts, completions, **kwargs):
        started.set()
        order.append("second")
        return [2.0 for _ in completions]

    def sync(prompts, completions):
        order.append("sync")
        return [3.0 for _ in completions]

    rollout = _rollout(tok, ["a 1", "b 2"], [("b", True), ("c", True)])
    scorer = Scorer(tok, functions={"first": first, "second": second, "sync": sync})
    total, parts = scorer(rollout, ["a 1", "b 2"], step=1)
    assert order == ["sync", "second", "first"]
    assert list(parts) == [
        "first",
        "second",
        "sync",
    ]  # the configured order, whatever finished first
    assert parts["first"].tolist() == [1.0, 1.0] and parts["second"].tolist() == [2.0, 2.0]
    assert total.tolist() == [6.0, 6.0]

    async def broken(prompts, completions):
        raise KeyError("no such answer")

    line = broken.__code__.co_firstlineno + 1  # the raise, in the coroutine's own frame
    with pytest.raises(
        RewardFunctionError,
        match=r"^reward function 'broken' at step 4 raised KeyError: 'no such answer' "
        rf"\(\S*test_reward_functions\.py:{line} in broken\)$",
    ):
        Scorer(tok, functions={"broken": broken})(rollout, ["a 1", "b 2"], step=4)


def test_conversational_prompts_arrive_as_messages(tok, tmp_path):
    """TRL's form: a conversational row's prompt is its messages and its completion one assistant
    message; a text row in the same batch keeps the text form."""
    user = [{"role": "user", "content": "ab"}]
    ps = _prompt_set(
        tok,
        tmp_path,
        [
            {"messages": user, "answer": "1"},
            {"prompt": [{"role": "user", "content": "c"}], "answer": "2"},
            {"prompt": "dd", "answer": "3"},
        ],
    )
    assert ps.texts == ["<ab>:", "<c>:", "dd"]
    rec = Recorder()
    rollout = _rollout(tok, ps.texts, [("1", True), ("2", False), ("3", True)])
    Scorer(tok, functions={"rec": rec})(
        rollout, ps.texts, ps.messages, columns=ps.columns_of([0, 1, 2]), step=1
    )
    (call,) = rec.calls
    assert call["prompts"] == [user, [{"role": "user", "content": "c"}], "dd"]
    assert call["completions"] == [
        [{"role": "assistant", "content": "1"}],
        [{"role": "assistant", "content": "2"}],
        "3",
    ]
    assert call["answer"] == ["1", "2", "3"]


def test_callables_are_named_like_specs_and_weighted_by_that_name():
    assert reward_function_names([frac_a, "m:f", "m:f", frac_a]) == [
        "ppo_support:frac_a",
        "m:f",
        "m:f#2",
        "ppo_support:frac_a#2",
    ]
    section = OnlineModelSection(
        path="p", reward_functions=[frac_a, "m:f"], reward_function_weights=[0.5, 2.0]
    )
    assert section.problems() == []
    assert section.function_weights() == {"ppo_support:frac_a": 0.5, "m:f": 2.0}
    assert OnlineModelSection(path="p", reward_functions=["mf", 3]).problems() == [
        "model.reward_functions[0] = 'mf': expected 'module:function'",
        "model.reward_functions[1] = 3: expected 'module:function'",
    ]
    assert (
        OnlineModelSection(path="p", reward_functions=["m:f"]).reward_timeout_s == DEFAULT_TIMEOUT_S
    )
    assert OnlineModelSection(
        path="p", reward_functions=["m:f"], reward_timeout_s=0
    ).problems() == ["model.reward_timeout_s = 0 must be > 0 seconds, or null for no limit"]


def test_a_required_argument_the_data_lacks_stops_before_any_model_loads(assets, tmp_path):
    def correct(prompts, completions, answer, **kwargs):
        return [0.0] * len(completions)

    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "solution": "1"}])
    with pytest.raises(ConfigError) as e:
        load_inputs(
            [correct],
            str(tmp_path / "p.jsonl"),
            str(assets.policy("llama")),
            max_prompt_length=8,
            on_long_prompt="skip",
            on_empty_prompt="error",
        )
    assert str(e.value) == (
        f"reward function 'test_reward_functions:test_a_required_argument_the_data_lacks_stops_"
        f"before_any_model_loads.<locals>.correct' needs argument 'answer', which is not a column of "
        f"{tmp_path / 'p.jsonl'} (columns: solution) nor one proximal passes (prompts, completions, "
        "completion_ids, step, trainer_state); add the column, map one to it with data.columns "
        "({answer: <column>}) or give the parameter a default"
    )
    # ... and the mapping it suggests is the fix: the column renamed, the function loads
    functions, prompts = load_inputs(
        [correct],
        str(tmp_path / "p.jsonl"),
        str(assets.policy("llama")),
        max_prompt_length=8,
        on_long_prompt="skip",
        on_empty_prompt="error",
        columns={"answer": "solution"},
    )
    assert prompts.columns == [{"answer": "1"}]
    # a column named as an argument proximal passes is refused, with the way out
    assert reward_argument_problems({"f": frac_a}, ["step", "answer"], "p.jsonl") == [
        "the prompts have a column 'step', the name of an argument proximal passes to reward "
        "functions (prompts, completions, completion_ids, step, trainer_state); rename it with "
        "data.columns (e.g. {my_step: step})"
    ]
    assert reward_argument_problems({}, ["step"], "p.jsonl") == []  # no function: no conflict


def test_evaluation_hands_the_columns_to_its_score_functions(assets, tmp_path):
    """evaluate_policy (compare's evaluations, and a run's eval) goes through the same scorer."""
    from proximal.evaluation import evaluate_policy

    texts = prompt_texts(3)
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p, "answer": answer_of(p)} for p in texts])
    rec = Recorder()
    policy = str(assets.policy("llama"))
    ev = evaluate_policy(
        policy,
        reference=policy,
        prompts_file=tmp_path / "eval.jsonl",
        scores={"rec": rec},
        samples_per_prompt=2,
        max_new_tokens=3,
        max_prompt_length=64,
    )
    assert ev["n"] == 6
    got = [(p, a) for call in rec.calls for p, a in zip(call["prompts"], call["answer"])]
    assert got == [(p, answer_of(p)) for p in texts for _ in range(2)]


def test_held_out_prompts_without_a_needed_column_are_refused_at_start(assets, tmp_path):
    """A run's eval section checks its prompts as the training prompts are checked: before any model
    loads, not at the first evaluation."""
    from proximal.evaluation import training_eval
    from proximal.train.sections import EvalSection

    def correct(prompts, completions, answer, **kwargs):
        return [0.0] * len(completions)

    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "ab"}])
    kwargs = dict(max_new_tokens=4, seed=0, max_prompt_length=8)
    with pytest.raises(
        ConfigError, match=r"^eval.prompts: reward function 'correct' needs argument "
    ):
        training_eval(
            EvalSection(prompts=str(tmp_path / "eval.jsonl")),
            assets.tokenizer,
            functions={"correct": correct},
            **kwargs,
        )
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "ab", "answer": "1"}])
    ev = training_eval(
        EvalSection(prompts=str(tmp_path / "eval.jsonl")),
        assets.tokenizer,
        functions={"correct": correct},
        **kwargs,
    )
    assert ev.prompts.columns == [{"answer": "1"}]


# ----------------------------------------------------------------------------------------------
# Real runs: two processes, and a hung verifier
# ----------------------------------------------------------------------------------------------


def _grpo_config(policy, prompts, run_dir, **model) -> dict:
    return {
        "model": {"path": str(policy), **model},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 4, "group_size": 3, "max_new_tokens": 4},
        "grpo": {"micro_batch_size": 6, "beta": 0.0},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu", "save_every": 0},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 0},
    }


def _grpo_rank(cfg: dict) -> None:
    import yaml

    from proximal import dist
    from proximal.config import load_config
    from proximal.trainers import grpo

    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        path.write_text(yaml.safe_dump(cfg))
    dist.barrier()
    grpo.train(load_config(grpo.GRPOConfig, path))


def test_two_processes_each_score_their_own_rows_with_their_answers(assets, tmp_path, monkeypatch):
    """GRPO on 2 processes, 4 prompts × G = 3 per step: every call's answers are those of its own
    prompts, each repeated over its group; the two ranks split every step's prompts between them."""
    texts = prompt_texts(8)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": answer_of(p)} for p in texts])
    (tmp_path / "record").mkdir()
    monkeypatch.setenv(ENV, str(tmp_path / "record"))
    cfg = _grpo_config(
        assets.policy("llama"),
        tmp_path / "p.jsonl",
        tmp_path / "run",
        reward_functions=["reward_support:record_answer"],
    )
    run_ranks(2, _grpo_rank, cfg)

    calls = {r: read_jsonl(tmp_path / "record" / f"rank{r}.jsonl") for r in (0, 1)}
    for r in (0, 1):
        assert [c["step"] for c in calls[r]] == [1, 2], r
        assert [c["global_step"] for c in calls[r]] == [1, 2], r
    tok = assets.tokenizer
    for step in (0, 1):
        mine = [calls[r][step] for r in (0, 1)]
        for c in mine:
            n = len(c["completions"])
            assert n == 6 and len(c["answer"]) == n == len(c["completion_ids"])  # 2 prompts × G = 3
            assert c["answer"] == [answer_of(p) for p in c["prompts"]]
            groups = [c["prompts"][g : g + 3] for g in range(0, n, 3)]
            assert all(len(set(g)) == 1 for g in groups)  # a group: one prompt, three times
            for ids, text in zip(c["completion_ids"], c["completions"]):
                assert tok.decode(ids, skip_special_tokens=True) == text
            assert c["other"] == []  # record_answer names every argument proximal gives
        groups0, groups1 = ({tuple(c["prompts"][::3])} for c in mine)
        prompts0, prompts1 = set(mine[0]["prompts"]), set(mine[1]["prompts"])
        assert not prompts0 & prompts1 and len(prompts0 | prompts1) == 4, (groups0, groups1)


def test_a_hung_reward_function_ends_the_run_at_its_limit(assets, tmp_path):
    """``proximal grpo`` with a verifier that sleeps at step 2 and model.reward_timeout_s = 2: the
    process ends about 2 s after the call began, exit status 1, with one line naming the function, the
    step and the limit, and no traceback; step 1 was logged."""
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompt_texts(4)])
    cfg = _grpo_config(
        assets.policy("llama"),
        tmp_path / "p.jsonl",
        tmp_path / "run",
        reward_functions=["reward_support:sleep_at_step_2"],
        reward_timeout_s=2,
    )
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    env = {
        **os.environ,
        ENV: str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "proximal", "grpo", "--config", str(tmp_path / "run.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,  # the function sleeps 120 s: finishing at all means it was stopped
    )
    ended = time.time()
    began = float((tmp_path / "hang_started").read_text())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "proximal: reward function 'reward_support:sleep_at_step_2' at step 2 did not return within "
        "model.reward_timeout_s = 2 s; the run was stopped (exit status 1). Fix the function or raise "
        "the limit (null: none), then resume from the last checkpoint"
    )
    assert 2 <= ended - began <= 2 + 4, ended - began
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_a_function_that_holds_the_interpreter_lock_is_ended_by_the_backstop(tmp_path):
    """Catastrophic regex backtracking runs in C without releasing the GIL, so no Python watchdog can
    run: faulthandler ends the process BACKSTOP_S after the limit, naming the function in its stack."""
    script = (
        "import re, proximal.rollout.reward_functions as s\n"
        "s.BACKSTOP_S = 1.0\n"
        "def hog(prompts, completions):\n"
        "    re.match(r'(a+)+$', 'a' * 60 + 'b')\n"
        "    return [0.0]\n"
        "s.call_reward_functions({'hog': hog}, {'prompts': ['p'], 'completions': ['c']}, n=1,"
        " step=3, timeout_s=1.0)\n"
        "print('not stopped')\n"
    )
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "not stopped" not in proc.stdout
    assert "Timeout (0:00:02)!" in proc.stderr and ", line 4 in hog" in proc.stderr, proc.stderr
    assert time.time() - t0 < 60
