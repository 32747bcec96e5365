"""The arithmetic reasoning task: expressions and their working, the verifier on hand-written answers,
the sloppy teacher's behaviours and the generator's determinism.

Expected values are written out by hand (the arithmetic of each case is in the test), not computed
with the functions under test.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from proximal.tasks import arithmetic as A


@pytest.mark.parametrize(
    "prompt, value, working",
    [
        ("3+4=", 7, "3+4=7;answer: 7"),
        ("(7+5)*3=", 36, "7+5=12;12*3=36;answer: 36"),
        ("9-(2*4)=", 1, "2*4=8;9-8=1;answer: 1"),
        ("((2+3)*4)-7=", 13, "2+3=5;5*4=20;20-7=13;answer: 13"),
        ("(1+2)*(3+4)=", 21, "1+2=3;3+4=7;3*7=21;answer: 21"),
    ],
)
def test_solve_and_worked_solution(prompt, value, working):
    assert A.solve(prompt) == value
    assert A.worked_solution(prompt) == working


@pytest.mark.parametrize(
    "prompt", ["3/4=", "3+4", "__import__('os')=", "3**2=", "-3+4=", "3.5+1=", "(3+4=", "x+1="]
)
def test_prompts_that_are_not_the_task_are_refused(prompt):
    with pytest.raises(ValueError, match="not an arithmetic"):
        A.solve(prompt)


GOOD = [
    ("7+5=12;12*3=36;answer: 36", "36"),
    ("answer: 36", "36"),  # no working: the verifier reads the answer only
    ("answer:36", "36"),
    ("7+5=12;12*3=36;answer: 36.", "36"),
    ("so \\boxed{36}", "36"),
    ("\\boxed{ 36 }", "36"),
    ("answer: 36.0", "36"),  # the same number
    ("answer: 36<eos>answer: 5", "36"),  # what follows EOS is not the answer
    ("answer: 5;answer: 36", "36"),  # the last answer counts
    ("answer: -4", "-4"),
    ("answer: 36", 36),  # a reference given as a number
]
WRONG = [
    ("7+5=12;12*3=35;answer: 35", "36"),
    ("7+5=12;answer: 12", "36"),  # stopped after the first step
    ("\\boxed{37}", "36"),
    ("answer: 36;answer: 5", "36"),
    ("answer: 3.6", "36"),
    ("answer: 4", "-4"),
]
MALFORMED = [
    "7+5=12;12*3=36",  # no answer line
    "7+5=12;12*3=36;answer 36",  # no colon
    "36",
    "answer: ",
    "answer: 3x6",  # not a number that ends: no answer at all, not the answer 3
    "\\boxed{}",
    "\\boxed{36",
    "",
    "<eos>answer: 36",
]


@pytest.mark.parametrize("completion, ref", GOOD)
def test_verifier_accepts_the_right_answer(completion, ref):
    assert A.verify(["(7+5)*3="], [completion], answer=[ref]) == [1.0]
    assert A.format_error(["(7+5)*3="], [completion]) == [0.0]


@pytest.mark.parametrize("completion, ref", WRONG)
def test_verifier_rejects_a_wrong_answer_that_is_well_formed(completion, ref):
    assert A.verify(["(7+5)*3="], [completion], answer=[ref]) == [0.0]
    assert A.format_error(["(7+5)*3="], [completion]) == [0.0]


@pytest.mark.parametrize("completion", MALFORMED)
def test_malformed_answers_score_zero_and_are_counted(completion):
    assert A.verify(["(7+5)*3="], [completion], answer=["36"]) == [0.0]
    assert A.format_error(["(7+5)*3="], [completion]) == [1.0]
    assert A.exact_match(["(7+5)*3="], [completion]) == [0.0]


def test_a_batch_with_groups_and_extra_keywords():
    # G = 2 completions per prompt, the answers repeated per completion as the trainers pass them
    prompts = ["3+4=", "3+4=", "9-(2*4)=", "9-(2*4)="]
    completions = ["answer: 7", "answer: 8", "2*4=8;9-8=1;answer: 1", "2*4=8;9-8=1"]
    answer = ["7", "7", "1", "1"]
    got = A.verify(prompts, completions, answer=answer, completion_ids=[[1]] * 4, step=3)
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert A.format_error(prompts, completions, answer=answer) == [0.0, 0.0, 0.0, 1.0]
    # the gold score computes each expression itself: the same verdicts without the answer column
    assert A.exact_match(prompts, completions) == [1.0, 0.0, 1.0, 0.0]


def test_the_verifier_reads_the_reference_not_the_prompt():
    # a wrong reference in the data is what the verifier trusts; the gold score is not fooled
    assert A.verify(["3+4="], ["answer: 8"], answer=["8"]) == [1.0]
    assert A.exact_match(["3+4="], ["answer: 8"]) == [0.0]


def test_verifier_errors_name_the_problem():
    with pytest.raises(ValueError, match="2 prompts but 1 answer"):
        A.verify(["3+4=", "1+1="], ["answer: 7", "answer: 2"], answer=["7"])
    with pytest.raises(ValueError, match=r"answer\[0\] = 'seven' is not a number"):
        A.verify(["3+4="], ["answer: 7"], answer=["seven"])
    with pytest.raises(TypeError):  # TRL's signature: the reference is required
        A.verify(["3+4="], ["answer: 7"])


def test_random_expressions_stay_in_range():
    rng = random.Random(0)
    seen_ops = set()
    for _ in range(2000):
        e = A.random_expression(rng)
        working = A.steps(e)
        assert 1 <= len(working) <= 2
        assert all(0 <= s.value <= A.MAX_VALUE for s in working)
        seen_ops |= {s.op for s in working}
        assert all(1 <= int(t) <= 9 for t in re.findall(r"\d+", e))
    assert seen_ops == set("+-*")


def test_the_teachers_behaviours():
    prompt = "(7+5)*3="
    right = "7+5=12;12*3=36;answer: 36"
    rng = random.Random(1)
    assert A.teacher_response(prompt, rng, {"correct": 1.0}) == right
    assert A.teacher_response(prompt, rng, {"early": 1.0}) == "7+5=12;answer: 12"
    for _ in range(50):
        bad = A.teacher_response(prompt, rng, {"format": 1.0})
        assert bad.startswith("7+5=12;12*3=36") and A.format_error([prompt], [bad]) == [1.0]
        slip = A.teacher_response(prompt, rng, {"slip": 1.0})
        # one step wrong, the wrong value carried on: every step is still "left op right = value"
        # with the next step reading the previous value, and the final answer is wrong
        s1, s2, line = slip.split(";")
        a, v1 = s1.split("=")
        b, v2 = s2.split("=")
        assert a == "7+5" and b == f"{v1}*3" and line == f"answer: {v2}"
        assert (v1 != "12") != (int(v2) != int(v1) * 3)
        assert A.exact_match([prompt], [slip]) == [0.0]


def test_make_task_data_is_deterministic_and_keeps_held_out_apart(tmp_path):
    sizes = dict(n_sft_train=300, n_sft_eval=20, n_prompts_train=100, n_prompts_eval=40)
    info = A.make_task_data(tmp_path / "a", 3, **sizes)
    A.make_task_data(tmp_path / "b", 3, **sizes)
    A.make_task_data(tmp_path / "c", 4, **sizes)
    files = ["sft_train.jsonl", "sft_eval.jsonl", "prompts_train.jsonl", "prompts_eval.jsonl"]
    for f in [*files, "task.json", "base_model/model.safetensors"]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "sft_train.jsonl").read_bytes() != (
        tmp_path / "c" / "sft_train.jsonl"
    ).read_bytes()

    def rows(f):
        return [json.loads(line) for line in (tmp_path / "a" / f).read_text().splitlines()]

    train = {r["prompt"] for f in ("sft_train.jsonl", "prompts_train.jsonl") for r in rows(f)}
    held = [r["prompt"] for f in ("sft_eval.jsonl", "prompts_eval.jsonl") for r in rows(f)]
    assert len(held) == len(set(held)) == 60 and not train & set(held)
    for r in rows("prompts_train.jsonl") + rows("prompts_eval.jsonl"):
        assert set(r) == {"prompt", "answer"} and r["answer"] == str(A.solve(r["prompt"]))
    assert len(rows("sft_train.jsonl")) == 300 and len(rows("prompts_eval.jsonl")) == 40
    # the teacher's rates, recounted from the file: right about 0.4 of the time (TEACHER), about
    # 0.2 malformed, with a binomial standard error of sqrt(0.24/300) = 0.028 on the first
    sft = rows("sft_train.jsonl")
    right = sum(r["response"] == A.worked_solution(r["prompt"]) for r in sft) / len(sft)
    assert abs(right - 0.4) < 4 * (0.24 / 300) ** 0.5
    # exact match counts a little more: an early answer is right where the last step multiplies by 1
    em = sum(r["response"].split(";")[-1] == f"answer: {A.solve(r['prompt'])}" for r in sft) / len(
        sft
    )
    assert info["teacher_exact_match_train"] == pytest.approx(em, abs=1e-12) and em >= right
    assert info["teacher_format_errors_train"] == pytest.approx(
        sum("answer:" not in r["response"] for r in sft) / len(sft), abs=1e-12
    )
    # every character of every file is one token of the task's tokenizer, none unknown
    tok = A.build_tokenizer()
    for text in [r["prompt"] + r["response"] for r in sft] + ["\\boxed{-36}"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text) and tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text


def test_the_verifier_is_a_reward_function_by_name():
    from proximal.rollout.reward_functions import load_reward_function

    for name in ("verify", "format_error", "exact_match"):
        assert load_reward_function(f"proximal.tasks.arithmetic:{name}") is getattr(A, name)
