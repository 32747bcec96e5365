"""Tools: the call formats on hand-written text, schemas, and every way a call can go wrong —
each counted, none hanging the run."""

from __future__ import annotations

import json
import time

import agent_support as S
import pytest

from proximal.agents.env import Environments
from proximal.agents.tools import (
    Malformed,
    MinimalFormat,
    ToolCall,
    load_tools,
    parse_hermes,
    tool_schemas,
)
from proximal.agents.worker import Job, WorkerPool, as_text
from proximal.config import ConfigError

TOOLS = {"add": S.add, "shout": S.shout, "table": S.table, "fail": S.fail, "hang": S.hang}


# ----------------------------------------------------------------------------------------------
# Parsers
# ----------------------------------------------------------------------------------------------


def format_hermes(name: str, arguments: dict) -> str:
    """A call as a Hermes block, written as Qwen2.5's template writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_blocks():
    text = (
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call> done'
    )
    assert parse_hermes(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("shout", {"text": "hi"}),
    ]
    assert parse_hermes("no calls here") == []
    assert parse_hermes(format_hermes("add", {"a": 3, "b": 4})) == [
        ToolCall("add", {"a": 3, "b": 4})
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>{bad json}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "no closing </tool_call>"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name": str'),
        ('<tool_call>["add"]</tool_call>', 'expected {"name": str'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "is not an object"),
    ],
)
def test_hermes_malformed(text, reason):
    (call,) = parse_hermes(text)
    assert isinstance(call, Malformed) and reason in call.reason


def test_minimal_format():
    fmt = MinimalFormat()
    assert fmt.parse("x [add 1 2] y [shout hello there]", TOOLS) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("shout", {"text": "hello there"}),  # the last argument takes the rest
    ]
    assert fmt.format("add", 1, 2) == "[add 1 2]"
    assert fmt.parse("nothing", TOOLS) == []
    # other brackets, for an alphabet without [ ]
    assert MinimalFormat("a ", " h").parse("a add 3 4 h", TOOLS) == [
        ToolCall("add", {"a": 3, "b": 4})
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[add 1]", "add takes 2 argument(s), got 1"),
        ("[add one 2]", "argument a = 'one' is not of type int"),
        ("[add 1 2", "no closing ']'"),
        ("[1x 2]", "'1x' is not a tool name"),
    ],
)
def test_minimal_malformed(text, reason):
    (call,) = MinimalFormat().parse(text, TOOLS)
    assert call == Malformed(call.text, reason)


def test_schemas():
    assert tool_schemas({"add": S.add}) == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "the first."},
                        "b": {"type": "integer", "description": "the second."},
                    },
                    "required": ["a", "b"],
                },
                "return": {"type": "integer"},
            },
        }
    ]
    # an environment's method: read without self
    (bump,) = tool_schemas({"bump": S.Counter.bump})
    assert list(bump["function"]["parameters"]["properties"]) == ["by"]

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="tool 'undocumented': no schema"):
        tool_schemas({"undocumented": undocumented})


def test_load_tools():
    assert load_tools(["agent_support:add", S.shout]) == {"add": S.add, "shout": S.shout}
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        load_tools([S.add, "agent_support:add"])

    def local(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="cannot import"):
        load_tools([local])


def test_as_text():
    assert as_text("a b") == "a b"
    assert as_text(56088) == "56088"
    assert as_text({"n": 2, "square": 4}) == '{"n": 2, "square": 4}'
    assert as_text({1, 2}).startswith("{")  # not JSON: str()


# ----------------------------------------------------------------------------------------------
# Running calls: each outcome counted, nothing hangs
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def envs():
    e = Environments(tools=TOOLS, call_format="minimal", timeout_s=1.0, workers=2)
    yield e
    e.close()


def test_every_outcome_is_counted(envs):
    envs.take_counts()
    out = envs.step(
        {
            0: "[add 2 3] [table 3]",  # text and non-text results
            1: "[fail 7]",  # raises
            2: "[add 1] [nope 2]",  # malformed, unknown tool
            3: "the answer is 5",  # no call: done
        }
    )
    assert out[0].messages == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "table", "content": '{"n": 3, "square": 9}'},
    ]
    assert not out[0].done
    assert out[1].messages == [
        {"role": "tool", "name": "fail", "content": "error: ValueError: no good: 7"}
    ]
    assert [m["content"] for m in out[2].messages] == [
        "error: malformed tool call: add takes 2 argument(s), got 1",
        "error: malformed tool call: no tool is named 'nope' (tools: add, fail, hang, shout, table)",
    ]
    assert out[3].done and not out[3].failed and out[3].messages == []
    assert envs.take_counts() == {
        "agent/tool_calls": 5,
        "agent/tool_errors": 1,
        "agent/tool_timeouts": 0,
        "agent/malformed_calls": 2,
        "agent/env_errors": 0,
        "agent/results_truncated": 0,
        "agent/reruns": 0,
        "agent/dropped": 0,
    }


def test_a_hanging_tool_is_killed_within_its_timeout(envs):
    envs.take_counts()
    t0 = time.monotonic()
    out = envs.step({0: "[hang 1]", 1: "[add 1 1]", 2: "[hang 2] [add 2 2]"})
    took = time.monotonic() - t0
    assert took < 1.0 + 2.0  # the limit and slack for the kill and a busy machine
    assert out[0].messages[0]["content"] == "error: no result within tools.timeout_s = 1 s"
    assert out[1].messages[0]["content"] == "2"
    # slot 2 shares worker 0 with slot 0: its calls waited, then ran on the fresh worker
    assert [m["content"] for m in out[2].messages] == [
        "error: no result within tools.timeout_s = 1 s",
        "4",
    ]
    counts = envs.take_counts()
    assert counts["agent/tool_timeouts"] == 2 and counts["agent/tool_calls"] == 4
    assert envs.step({0: "[add 5 5]"})[0].messages[0]["content"] == "10"  # the worker was replaced


def test_on_error_end():
    e = Environments(tools=TOOLS, call_format="minimal", on_error="end", workers=0)
    out = e.step({0: "[fail 1]", 1: "[add 1 x]", 2: "[add 1 2]"})
    assert out[0].done and out[0].failed and out[1].done and out[1].failed
    assert not out[2].done and out[2].messages[0]["content"] == "3"


def test_environment_methods_as_tools_and_a_lost_environment():
    e = Environments(S.Counter, call_format="minimal", timeout_s=1.0, workers=2)
    try:
        assert set(e.tools) == {"bump", "stall"}
        e.reset([{"prompt": "a"}, {"prompt": "b"}])
        out = e.step({0: "[bump 10] [bump 10]", 1: "[stall 1]"})
        assert [m["content"] for m in out[0].messages] == ["10", "20"]  # state kept between calls
        assert out[1].done and out[1].failed  # its environment went with the killed worker
        assert e.outcome_rewards([0, 1]) == {0: 2.0, 1: None}
        counts = e.take_counts()
        assert counts["agent/tool_timeouts"] == 1 and counts["agent/env_errors"] == 2
    finally:
        e.close()


def test_worker_cost():
    """The per-call cost of a worker process (docs/agents.md): a pipe round trip, measured."""
    with WorkerPool(1, timeout_s=10) as pool:
        t0 = time.perf_counter()
        assert pool.run([Job(0, ("call", S.add, (1, 2), {}))]) == [("ok", "3")]
        start = time.perf_counter() - t0
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            pool.run([Job(0, ("call", S.add, (1, 2), {}))])
        per_call = (time.perf_counter() - t0) / n
    print(f"worker start + first call {start * 1e3:.0f} ms; per call {per_call * 1e6:.0f} µs")
    assert per_call < 0.02 and start < 10


def test_environment_mistakes_are_named():
    with pytest.raises(ValueError, match="Echo has step"):
        Environments(S.Echo, tools=TOOLS, workers=0)

    class NoKwargs:
        def reset(self):
            return None

        def step(self, text):
            return None, 0.0, True

    with pytest.raises(ValueError, match=r"NoKwargs.reset must accept \*\*kwargs"):
        Environments(NoKwargs, workers=0)

    class Nothing:
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match="neither step"):
        Environments(Nothing, workers=0)
    with pytest.raises(ValueError, match="needs an environment, tools, or both"):
        Environments(workers=0)


def test_messages_name_the_field_they_read():
    """Fault 6: a bad tools.functions entry was reported as a 'reward function', and a tool with
    no docstring against a data row (the prompt loader made the schemas)."""
    from types import SimpleNamespace

    from proximal.agents.collect import load_environment, run_tools

    with pytest.raises(ConfigError, match=r"^tools.functions\[1\] 'no_such_module:calc': cannot"):
        load_tools(["agent_support:add", "no_such_module:calc"])
    with pytest.raises(
        ConfigError, match=r"^tools.functions\[0\] 'agent_support:NOT_CALLABLE': not"
    ):
        load_tools(["agent_support:NOT_CALLABLE"])
    with pytest.raises(
        ConfigError, match=r"^tools.functions\[1\] 'agent_support:nodoc': tool 'nodoc': no schema"
    ):
        load_tools(["agent_support:add", "agent_support:nodoc"])
    with pytest.raises(ConfigError, match=r"^env.factory 'no_such_module:Env': cannot import"):
        load_environment("no_such_module:Env")
    env = SimpleNamespace(factory="agent_support:NoDocTool")
    with pytest.raises(ConfigError, match=r"^env.factory NoDocTool: tool 'poke': no schema"):
        run_tools(env, SimpleNamespace(functions=[]))
