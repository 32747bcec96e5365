"""The calculator tool task: deterministic data, the tool, the verifier on trajectories, and the
demonstrations as SFT and the agent code read them."""

from __future__ import annotations

import json
import random

import pytest

from proximal.agents.env import Environments
from proximal.agents.tools import MinimalFormat, ToolCall, load_tools, tool_schemas
from proximal.agents.trajectory import observation_ids
from proximal.data.sft import load_sft_examples
from proximal.tasks import calculator as C

SMALL = {"n_sft_train": 40, "n_sft_eval": 10, "n_prompts_train": 30, "n_prompts_eval": 12}
FILES = [
    f"{kind}_{split}.jsonl"
    for kind in ("sft", "sft_notool", "prompts")
    for split in ("train", "eval")
] + ["task.json"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("calculator")
    info = C.make_task_data(out, seed=3, **SMALL, model={"hidden": 16, "layers": 1, "heads": 2})
    return out, info


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_files(task, tmp_path):
    out, _ = task
    C.make_task_data(tmp_path, seed=3, **SMALL, model={"hidden": 16, "layers": 1, "heads": 2})
    for name in FILES:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    other = tmp_path / "other"
    C.make_task_data(other, seed=4, **SMALL, model={"hidden": 16, "layers": 1, "heads": 2})
    assert (other / "prompts_train.jsonl").read_bytes() != (
        out / "prompts_train.jsonl"
    ).read_bytes()


def test_files(task):
    out, info = task
    train = {r["prompt"] for r in rows(out / "prompts_train.jsonl")}
    train |= {r["messages"][0]["content"] for r in rows(out / "sft_train.jsonl")}
    held = {r["prompt"] for r in rows(out / "prompts_eval.jsonl")}
    held |= {r["messages"][0]["content"] for r in rows(out / "sft_eval.jsonl")}
    assert not train & held
    for r in rows(out / "prompts_eval.jsonl"):
        a, b = r["prompt"][:-1].split("*")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and r["answer"] == str(int(a) * int(b))
    assert info["tools"] == ["proximal.tasks.calculator:calculator"]
    assert 0 < info["teacher_exact_match_train"] < 1 and 0 < info["teacher_tool_use_train"] < 1
    notool = rows(out / "sft_notool_train.jsonl")
    sft = rows(out / "sft_train.jsonl")
    assert [r["response"] for r in notool] == [r["messages"][-1]["content"] for r in sft]


def test_calculator_tool():
    assert C.calculator("123*456") == 56088
    assert C.calculator(" (2+3)*4 ") == 20
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        C.calculator("12*")
    (schema,) = tool_schemas(load_tools(["proximal.tasks.calculator:calculator"]))
    assert schema["function"]["name"] == "calculator"
    assert list(schema["function"]["parameters"]["properties"]) == ["expression"]


@pytest.mark.parametrize(
    ("completion", "score", "malformed"),
    [
        ("[calculator 123*456]<eos>{56088}answer: 56088<eos>", 1.0, 0.0),
        ("answer: 56088<eos>", 1.0, 0.0),  # right without the tool is right
        ("[calculator 123*456]<eos>{56088}answer: 56078<eos>", 0.0, 0.0),  # miscopied
        ("[calculator 123*456]<eos>{56088}answer 56088<eos>", 0.0, 1.0),  # no colon
        ("[calculator 123*456]<eos>{56088}<eos>", 0.0, 1.0),  # the result is not an answer
        ("[calculator 123*4", 0.0, 1.0),
    ],
)
def test_verifier(completion, score, malformed):
    assert C.verify(["123*456="], [completion], answer=["56088"]) == [score]
    assert C.exact_match(["123*456="], [completion]) == [score]
    assert C.format_error(["123*456="], [completion]) == [malformed]
    # the same read from the agent's text alone (special tokens dropped, as the scorer decodes)
    plain = completion.replace("<eos>", "").replace("{56088}", "")
    assert C.verify(["123*456="], [plain], answer=["56088"]) == [score]


def test_verifier_on_messages():
    turns = [
        {"role": "assistant", "content": "[calculator 123*456]"},
        {"role": "tool", "content": "56088"},
        {"role": "assistant", "content": "answer: 56088"},
    ]
    assert C.verify(["123*456="], [turns], answer=["56088"]) == [1.0]
    assert C.verify(["123*456="], [turns[:2]], answer=["56088"]) == [0.0]  # a result is no answer
    assert C.format_error(["123*456="], [turns[:2]]) == [1.0]


def test_the_teachers_habits():
    rng = random.Random(0)
    seen = {}
    for _ in range(400):
        m = C.teacher_messages(C.random_product(rng) + "=", rng)
        right = C.exact_match([m[0]["content"]], [C.completion_text(m)])[0]
        seen.setdefault((len(m), right), 0)
        seen[(len(m), right)] += 1
    # right with the tool, wrong with it (miscopy, typo, format), wrong without it (a near miss)
    assert set(seen) == {(4, 1.0), (4, 0.0), (2, 0.0)}
    assert 0.35 < seen[(4, 1.0)] / 400 < 0.55


def test_demonstrations_as_the_agent_code_reads_them():
    """The teacher's call parses with the minimal format; the tool run by the agent code answers
    the text the demonstration holds; the template renders that result as the ids a rollout
    appends; SFT trains exactly the assistant turns."""
    tok = C.build_tokenizer()
    m = C.teacher_messages("123*456=", random.Random(0), {"correct": 1.0})
    tools = {"calculator": C.calculator}
    assert MinimalFormat().parse(m[1]["content"], tools) == [
        ToolCall("calculator", {"expression": "123*456"})
    ]
    envs = Environments(tools=tools, call_format="minimal", workers=0)
    (result,) = envs.step({0: m[1]["content"]})[0].messages
    assert result == m[2] == {"role": "tool", "name": "calculator", "content": "56088"}
    assert observation_ids(tok, [result]) == tok("{56088}", add_special_tokens=False)["input_ids"]


def test_sft_trains_the_assistant_turns(task):
    out, _ = task
    tok = C.build_tokenizer()
    examples, _ = load_sft_examples(
        out / "sft_train.jsonl", tok, max_length=96, loss_on="all_assistant"
    )
    first = rows(out / "sft_train.jsonl")[0]["messages"]
    ex = examples[0]
    trained = "".join(tok.decode([i]) for i, on in zip(ex.input_ids, ex.target_mask) if on)
    want = "".join(m["content"] + "<eos>" for m in first if m["role"] == "assistant")
    assert trained == want
    assert tok.decode(ex.input_ids) == first[0]["content"] + C.completion_text(first)
