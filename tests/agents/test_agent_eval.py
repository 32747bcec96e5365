"""Held-out evaluation with trajectories, and a prompt row's ``tools`` column.

* A row's ``tools`` column (names, or TRL's JSON schemas) picks which registered tools its trajectory
  may call and whose schemas its chat template is given; a call to another tool is malformed; a name
  that is no registered tool is refused before any model loads.
* ``evaluate_loaded`` with a :class:`MultiTurn` responder runs the run's trajectories: on a scripted policy
  the calculator task's columns (exact match, tool calls, tool errors, malformed calls, turns,
  length) are the hand-counted ones, and the environments' counts are left as they were.
* A one-turn environment evaluates exactly as the single-turn evaluation (same seeds, same
  responses, same KL), so the trajectory path draws from the same generators.
* ``proximal grpo`` with tools and ``eval.prompts``: the held-out trajectories' columns are logged.
"""

from __future__ import annotations

import pytest
import torch
from agent_support import TOOLS_TEMPLATE, OneTurn, add, table
from ppo_support import ALPHABET, command_main, read_jsonl

from proximal.agents.collect import AGENT_COLUMNS, MultiTurn
from proximal.agents.env import Environments, check_offered, offered_tools, row_schemas
from proximal.agents.tools import tool_schemas
from proximal.agents.trajectory import first_prompt
from proximal.config import ConfigError
from proximal.data.jsonl import DataError, write_jsonl
from proximal.data.prompts import load_prompts
from proximal.evaluation import evaluate_loaded
from proximal.models.tiny import build_char_tokenizer
from proximal.tasks import calculator
from proximal.tasks.calculator import build_tokenizer, exact_match, make_task_data

TOOLS = {"add": add, "table": table}
SCHEMA_TABLE = {"type": "function", "function": {"name": "table", "parameters": {}}}


def test_offered_tools_reads_names_and_schemas():
    assert offered_tools(None, TOOLS) is None  # no column: every tool
    assert offered_tools(["add"], TOOLS) == ["add"]
    assert offered_tools([SCHEMA_TABLE, "add", "add"], TOOLS) == ["table", "add"]
    assert offered_tools([{"name": "add"}], TOOLS) == ["add"]
    assert offered_tools([], TOOLS) == []  # a row may offer none
    assert offered_tools(["anything"], {}) is None  # no tools registered: the column is only data
    with pytest.raises(ValueError, match="names shout, which is not a registered tool"):
        offered_tools(["add", "shout"], TOOLS)
    with pytest.raises(ValueError, match="must be a list"):
        offered_tools("add", TOOLS)
    assert check_offered([{"tools": ["add"]}, {}], TOOLS, "p.jsonl") is None
    assert check_offered([{}, {"tools": ["nope"]}], TOOLS, "p.jsonl").startswith(
        "p.jsonl[row 1]: the row's 'tools' column names nope"
    )


def test_a_row_calls_only_the_tools_it_offers():
    envs = Environments(None, TOOLS, call_format="minimal", workers=0)
    envs.reset([{"prompt": "a", "tools": ["add"]}, {"prompt": "b", "tools": [SCHEMA_TABLE]}, {}])
    assert envs.schemas(0) == tool_schemas({"add": add})
    assert envs.schemas(1) == tool_schemas({"table": table})
    assert envs.schemas(2) == tool_schemas(TOOLS)
    out = envs.step({0: "[table 3]", 1: "[table 3]", 2: "[add 1 2]"})
    assert out[0].messages == [
        {"role": "tool", "name": "", "content": "error: malformed tool call: no tool is named "
         "'table' (tools: add)"}
    ]  # fmt: skip
    assert out[0].counts["malformed_calls"] == 1
    assert out[1].messages[0]["content"] == '{"n": 3, "square": 9}'
    assert out[2].messages[0]["content"] == "3"
    envs.close()


def _tools_tokenizer():
    tok = build_char_tokenizer(list(ALPHABET))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _user(text):
    return [{"role": "user", "content": text}]


def test_a_conversational_prompt_is_loaded_with_the_tools_its_row_offers(tmp_path):
    """An agent run's loader renders each conversational row with the schemas of the tools its
    trajectory is offered — a ``tools`` column of names included, which a single-turn run refuses —
    so the length limit holds for the prompt the model reads."""
    tok = _tools_tokenizer()
    path = tmp_path / "p.jsonl"
    rows = [
        {"messages": _user("ab"), "tools": ["table"]},  # names one
        {"messages": _user("ab")},  # no column: every registered tool, in registration order
        {"messages": _user("ab"), "tools": [SCHEMA_TABLE, "add"]},  # a schema and a name, in order
        {"prompt": "ab", "tools": ["add"]},  # a text prompt is used as it is
        {"messages": _user("ab"), "tools": []},  # offers none
    ]
    write_jsonl(path, rows)
    want = ["7 table 8 ab 9 ", "7 add table 8 ab 9 ", "7 table add 8 ab 9 ", "ab", "8 ab 9 "]
    got = load_prompts(str(path), tok, max_length=64, tools=row_schemas(TOOLS))
    assert got.texts == want
    assert got.token_ids == [tok(t, add_special_tokens=False)["input_ids"] for t in want]
    # the limit is on what the model reads, schemas included: 10 characters keep two rows
    short = load_prompts(
        str(path), tok, max_length=10, on_too_long="skip", tools=row_schemas(TOOLS)
    )
    assert (short.texts, short.skipped_too_long) == (["ab", "8 ab 9 "], 3)
    cut = load_prompts(str(path), tok, max_length=10, tools=row_schemas(TOOLS))
    assert cut.truncated == 3
    assert cut.token_ids[0] == tok(want[0], add_special_tokens=False)["input_ids"][-10:]
    # a single-turn run: a text row's column is only data; a conversational row's must be schemas
    text_only = tmp_path / "text.jsonl"
    write_jsonl(text_only, [{"prompt": "ab", "tools": ["add"]}])
    assert load_prompts(str(text_only), tok, max_length=64).texts == ["ab"]
    with pytest.raises(DataError, match=r"p\.jsonl:1: field 'tools' must be a list of objects"):
        load_prompts(str(path), tok, max_length=64)


def test_a_rows_unregistered_tool_is_refused_at_its_line(tmp_path):
    tok = _tools_tokenizer()
    path = tmp_path / "p.jsonl"
    for row in (
        {"messages": _user("ab"), "tools": ["shout"]},
        {"prompt": "ab", "tools": ["shout"]},
    ):
        write_jsonl(path, [{"prompt": "ab"}, row])
        with pytest.raises(DataError) as e:
            load_prompts(str(path), tok, max_length=64, tools=row_schemas(TOOLS))
        assert str(e.value) == (
            f"{path}:2: the row's 'tools' column names shout, which is not a registered tool "
            "(tools: add, table)"
        )


def test_the_first_prompt_is_the_loaded_one_unless_reset_observes():
    tok = _tools_tokenizer()
    schemas = tool_schemas({"table": table})
    loaded = tok("7 table 8 ab 9 ", add_special_tokens=False)["input_ids"]
    messages = _user("ab")
    assert first_prompt(tok, loaded, messages, None, schemas) == loaded  # as loaded (and truncated)
    # reset()'s observation joins the last user message; rendered again with the row's tools
    want = tok("7 table 8 abcd 9 ", add_special_tokens=False)["input_ids"]
    assert first_prompt(tok, loaded, messages, "cd", schemas) == want
    assert first_prompt(tok, [5, 6], None, "cd", schemas) == [5, 6] + tok("cd")["input_ids"]


# ----------------------------------------------------------------------------------------------
# evaluate_loaded with trajectories
# ----------------------------------------------------------------------------------------------

#: What the scripted policy writes for each prompt, turn by turn (EOS after each turn).
SCRIPT = {
    "123*456=": ["[calculator 123*456]", "answer: 56088"],  # right, with the tool
    "100*100=": ["[calculator 100*]", "answer: 10000"],  # the tool raises; right anyway
    "200*300=": ["[add 1]", "answer: 5"],  # no tool named add: malformed; wrong
    "999*999=": ["answer: 998001"],  # no call: one turn, right
}


class Scripted:
    """An engine that writes :data:`SCRIPT`: the prompt is found in each row's text, the turn is the
    number of EOS tokens already in it."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, ids, mask, seeds, params, logprobs=False):
        eos = self.tok.eos_token_id
        rows = []
        for row, m in zip(ids, mask):
            real = row[m.bool()].tolist()
            text = self.tok.decode(real, skip_special_tokens=True)
            prompt = next(p for p in SCRIPT if text.startswith(p))
            turn = real.count(eos)
            rows.append(
                self.tok(SCRIPT[prompt][turn], add_special_tokens=False)["input_ids"] + [eos]
            )
        width = max(len(r) for r in rows)
        out = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
        return (out, torch.zeros(out.shape)) if logprobs else out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("calculator")
    make_task_data(out, n_sft_train=4, n_sft_eval=2, n_prompts_train=4, n_prompts_eval=8)
    return out


def _scripted_eval(task, tmp_path, envs):
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": p, "answer": str(calculator.calculator(p[:-1]))} for p in SCRIPT])
    tok = build_tokenizer()
    prompts = load_prompts(str(path), tok, max_length=16)
    actor = torch.nn.Linear(1, 1)  # only its device is read: the engine writes every token
    return evaluate_loaded(
        actor,
        reference=None,
        tokenizer=tok,
        prompts=prompts,
        functions={"exact_match": exact_match},
        max_new_tokens=24,
        engine=Scripted(tok),
        responder=MultiTurn(envs, max_turns=2, max_tokens=200),  # room for the error text
    )


def test_evaluation_runs_trajectories_and_counts_each(task, tmp_path):
    envs = Environments(
        None, {"calculator": calculator.calculator}, call_format="minimal", workers=0
    )
    envs.counts.update(tool_calls=7)  # a run's own count, taken later: the evaluation leaves it
    out = _scripted_eval(task, tmp_path, envs)
    assert dict(envs.counts) == {"tool_calls": 7}
    rows = out["rows"]
    assert [r["exact_match"] for r in rows] == [1.0, 1.0, 0.0, 1.0]
    assert [r["turns"] for r in rows] == [2, 2, 2, 1]
    assert [r["tool_calls"] for r in rows] == [1, 1, 1, 0]
    assert [r["tool_errors"] for r in rows] == [0, 1, 0, 0]
    assert [r["malformed_calls"] for r in rows] == [0, 0, 1, 0]
    assert [r["failed"] for r in rows] == [False] * 4
    # length: the policy's own tokens, each turn's text and its EOS (the tool's "{...}" not counted)
    assert [r["length"] for r in rows] == [
        sum(len(t) + 1 for t in SCRIPT[p]) for p in SCRIPT
    ]  # fmt: skip
    assert rows[0]["trajectory"]["turns"][0]["observation"] == [
        {"role": "tool", "name": "calculator", "content": "56088"}
    ]
    assert rows[1]["trajectory"]["turns"][0]["observation"][0]["content"].startswith("error: ")
    assert out["mean"]["exact_match"] == 0.75
    assert out["mean"]["tool_calls"] == 0.75
    assert out["mean"]["tool_errors"] == 0.25
    assert out["mean"]["malformed_calls"] == 0.25
    assert out["mean"]["turns"] == 1.75
    assert set(AGENT_COLUMNS) <= set(out["mean"])
    envs.close()


def test_on_error_end_fails_the_trajectory(task, tmp_path):
    envs = Environments(
        None,
        {"calculator": calculator.calculator},
        call_format="minimal",
        on_error="end",
        workers=0,
    )
    rows = _scripted_eval(task, tmp_path, envs)["rows"]
    assert [r["failed"] for r in rows] == [False, True, True, False]
    assert [r["turns"] for r in rows] == [2, 1, 1, 1]
    assert [r["exact_match"] for r in rows] == [1.0, 0.0, 0.0, 1.0]
    envs.close()


def test_a_one_turn_environment_evaluates_as_the_single_turn_evaluation(task):
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    actor = AutoModelForCausalLM.from_pretrained(task / "base_model").eval()
    reference = AutoModelForCausalLM.from_pretrained(task / "base_model").eval()
    with torch.no_grad():  # a reference that differs, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    prompts = load_prompts(str(task / "prompts_eval.jsonl"), tok, max_length=16)
    common = dict(
        reference=reference,
        tokenizer=tok,
        prompts=prompts,
        functions={"exact_match": exact_match},
        samples_per_prompt=2,
        max_new_tokens=10,
        seed=3,
        batch_size=5,
    )
    plain = evaluate_loaded(actor, **common)
    envs = Environments(OneTurn, call_format="minimal", workers=0)
    turns = evaluate_loaded(actor, **common, responder=MultiTurn(envs, max_turns=1, max_tokens=10))
    envs.close()
    assert [r["response"] for r in turns["rows"]] == [r["response"] for r in plain["rows"]]
    assert [r["length"] for r in turns["rows"]] == [r["length"] for r in plain["rows"]]
    assert [r["eos"] for r in turns["rows"]] == [r["eos"] for r in plain["rows"]]
    kl_plain = torch.tensor([r["kl"] for r in plain["rows"]], dtype=torch.float64)
    kl_turns = torch.tensor([r["kl"] for r in turns["rows"]], dtype=torch.float64)
    assert kl_plain.min() > 0
    torch.testing.assert_close(kl_turns, kl_plain, rtol=1e-5, atol=1e-7)
    assert all(r["turns"] == 1 and r["tool_calls"] == 0 for r in turns["rows"])


def test_grpo_with_tools_logs_the_held_out_trajectories(task, tmp_path, capsys):
    cfg = {
        "model": {
            "path": str(task / "base_model"),
            "reward_functions": ["proximal.tasks.calculator:verify"],
        },
        "data": {"prompts": str(task / "prompts_train.jsonl"), "max_prompt_length": 16},
        "env": {"max_turns": 2, "max_tokens": 40},
        "tools": {
            "functions": ["proximal.tasks.calculator:calculator"],
            "format": "minimal",
            "workers": 1,
        },
        "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 12},
        "grpo": {"micro_batch_size": 4},
        "eval": {
            "prompts": str(task / "prompts_eval.jsonl"),
            "scores": {"exact_match": "proximal.tasks.calculator:exact_match"},
        },
        "train": {"steps": 1, "seed": 0, "device": "cpu"},
        "output": {"dir": str(tmp_path / "run"), "progress": False},
    }
    assert command_main("grpo", cfg) == 0, capsys.readouterr().err
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval/turns" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 1.0 <= r["eval/turns"] <= 2.0
        assert r["eval/tool_calls"] >= 0 and r["eval/malformed_calls"] >= 0
        assert 0.0 <= r["eval/exact_match"] <= 1.0
        assert r["eval/kl_ref"] >= 0


def test_a_rows_unknown_tool_is_refused_before_training(task, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": "123*456=", "answer": "56088", "tools": ["abacus"]}])
    cfg = {
        "model": {
            "path": str(task / "base_model"),
            "reward_functions": ["proximal.tasks.calculator:verify"],
        },
        "data": {"prompts": str(path), "max_prompt_length": 16},
        "tools": {"functions": ["proximal.tasks.calculator:calculator"], "format": "minimal"},
        "rollout": {"batch_size": 1, "group_size": 2, "max_new_tokens": 12},
        "grpo": {"micro_batch_size": 2},
        "train": {"steps": 1, "seed": 0, "device": "cpu"},
        "output": {"dir": str(tmp_path / "run"), "progress": False},
    }
    assert command_main("grpo", cfg) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: the row's 'tools' column names abacus" in err, err


def test_config_error_is_what_build_environments_raises(task):
    from proximal.agents.collect import build_environments

    with pytest.raises(ConfigError, match=r"x\[row 0\].*names abacus"):
        build_environments(
            None,
            ["proximal.tasks.calculator:calculator"],
            call_format="minimal",
            timeout_s=1.0,
            on_error="observe",
            workers=0,
            has_reward_source=True,
            columns=[{"tools": ["abacus"]}],
            source="x",
        )


def test_the_responder_is_chosen_once_from_the_sections():
    """agents.collect.run_responder is where a run chooses: one response per prompt without env or
    tools, else a multi-turn responder over the sections' environments and limits; the held-out
    evaluation's env/tools dicts take the sections' defaults for the keys they leave out."""
    from proximal.agents.collect import run_responder
    from proximal.evaluation import eval_responder
    from proximal.rollout.collect import SingleTurn
    from proximal.train.sections import EnvSection, ToolsSection

    single = run_responder(
        EnvSection(), ToolsSection(), max_new_tokens=7, max_tokens=28, has_reward_source=True
    )
    assert type(single) is SingleTurn and single.max_tokens == 7 and single.row_tools is None
    tools = ToolsSection(
        functions=["proximal.tasks.calculator:calculator"],
        format="minimal",
        timeout_s=3.0,
        workers=0,
        max_result_chars=50,
    )
    multi = run_responder(
        EnvSection(max_turns=3, on_failure="drop"),
        tools,
        max_new_tokens=7,
        max_tokens=21,
        has_reward_source=True,
    )
    try:
        assert isinstance(multi, MultiTurn)
        assert (multi.max_turns, multi.max_tokens, multi.on_failure) == (3, 21, "drop")
        assert (multi.envs.max_result_chars, multi.envs.pool.timeout_s) == (50, 3.0)
        assert list(multi.envs.functions) == ["calculator"]
    finally:
        multi.close()
    evaluated = eval_responder(
        {"max_turns": 2}, {"functions": ["proximal.tasks.calculator:calculator"], "workers": 0}, 5
    )
    try:
        assert (evaluated.max_turns, evaluated.max_tokens) == (2, 10)  # env.max_tokens null: 2 × 5
        defaults = ToolsSection()
        assert evaluated.envs.on_error == defaults.on_error
        assert evaluated.envs.max_result_chars == defaults.max_result_chars
        assert evaluated.envs.pool.timeout_s == defaults.timeout_s
    finally:
        evaluated.close()
