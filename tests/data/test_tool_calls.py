"""Tool-call conversations as OpenAI and TRL write them (issue 37, item 8): an assistant turn with
``content: None`` and ``tool_calls: [{"type": "function", "function": {"name", "arguments"}}]`` is
accepted in SFT data and in prompt data, its calls rendered by the chat template (``arguments`` an
object, or OpenAI's JSON string of one — the template gets the object); a malformed call is one line
naming ``file:line``. The expected texts are written out from the test's own template."""

from __future__ import annotations

import json

import pytest

from proximal.data.jsonl import DataError
from proximal.data.prompts import load_prompts
from proximal.data.sft import load_sft_examples
from proximal.models.tiny import build_char_tokenizer

# User "U:…", tool "T:…", an assistant turn "A:" + its content + each call as "<name {json}>", one
# line per turn; the generation prompt is "A:".
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}A:{{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] -%}"
    "<{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}>"
    "{%- endfor -%}{{ '\\n' }}"
    "{%- else -%}{{ m['role'][0] | upper }}:{{ m['content'] }}{{ '\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}"
)
#: The same template without the calls: a template that does not know tool_calls.
NO_CALLS = TEMPLATE.replace(
    "{%- for c in m['tool_calls'] or [] -%}"
    "<{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}>"
    "{%- endfor -%}",
    "",
)
ALPHABET = list('abcdefghijklmnopqrstuvwxyz0123456789 :{}"<>,\nAUTS')


def call(arguments) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": arguments}}


def conversation(arguments, **assistant) -> list[dict]:
    return [
        {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments)], **assistant},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]


#: What TEMPLATE writes for conversation(...): the call's arguments as the object they stand for.
TEXT = 'U:add 2 3\nA:<add {"a": 2, "b": 3}>\nT:5\nA:5\n'


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET, chat_template=TEMPLATE)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "arguments", [{"a": 2, "b": 3}, '{"a": 2, "b": 3}'], ids=["object", "json-string"]
)
def test_an_sft_conversation_with_a_tool_call_renders_and_trains_it(tok, tmp_path, arguments):
    f = write(tmp_path / "sft.jsonl", [{"messages": conversation(arguments)}])
    (e,), _ = load_sft_examples(f, tok, max_length=128, loss_on="all_assistant")
    assert tok.decode(e.input_ids, skip_special_tokens=True) == TEXT
    trained = "".join(
        tok.decode([i]) for i, m in zip(e.input_ids, e.target_mask) if m
    )  # the call is an assistant turn's text: trained, as the final reply is
    assert trained == '<add {"a": 2, "b": 3}>5'


def test_content_may_be_left_out_beside_tool_calls(tok, tmp_path):
    turns = conversation({"a": 2, "b": 3})
    del turns[1]["content"]  # transformers' docs write the turn without it
    f = write(tmp_path / "sft.jsonl", [{"messages": turns}])
    (e,), _ = load_sft_examples(f, tok, max_length=128, loss_on="all_assistant")
    assert tok.decode(e.input_ids, skip_special_tokens=True) == TEXT


def test_a_prompt_with_a_tool_call_renders_it(tok, tmp_path):
    f = write(tmp_path / "p.jsonl", [{"messages": conversation('{"a": 2, "b": 3}')[:3]}])
    ps = load_prompts(str(f), tok, max_length=128)
    assert ps.texts == ['U:add 2 3\nA:<add {"a": 2, "b": 3}>\nT:5\nA:']
    assert ps.messages[0][1]["tool_calls"] == [call({"a": 2, "b": 3})]  # as the template got it


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"name": "add", "arguments": {}},
            'messages[1].tool_calls[0] must be {"type": "function", "function": {"name": str, '
            "\"arguments\": object or JSON string}}, got {'name': 'add', 'arguments': {}}",
        ),
        (
            call("{a: 2"),
            "messages[1].tool_calls[0].function.arguments (the call of 'add') is a string but not "
            "valid JSON (Expecting property name enclosed in double quotes at column 2): '{a: 2'",
        ),
        (
            call([2, 3]),
            "messages[1].tool_calls[0].function.arguments (the call of 'add') must be an object "
            "(or a JSON string of one), got list [2, 3]",
        ),
        (
            {"type": "function", "function": {"arguments": {}}},
            "messages[1].tool_calls[0].function.name must be a non-empty string, got NoneType None",
        ),
    ],
    ids=["no-function", "bad-json", "not-an-object", "no-name"],
)
def test_a_malformed_tool_call_is_one_line_naming_the_row(tok, tmp_path, bad, message):
    turns = conversation({})
    turns[1]["tool_calls"] = [bad]
    f = write(tmp_path / "sft.jsonl", [{"messages": conversation({})}, {"messages": turns}])
    with pytest.raises(DataError) as e:
        load_sft_examples(f, tok, max_length=128, loss_on="all_assistant")
    assert str(e.value) == f"{f}:2: {message}"


def test_content_none_without_tool_calls_is_still_refused(tok, tmp_path):
    turns = conversation({})
    del turns[1]["tool_calls"]
    f = write(tmp_path / "sft.jsonl", [{"messages": turns}])
    with pytest.raises(DataError) as e:
        load_sft_examples(f, tok, max_length=128, loss_on="all_assistant")
    assert str(e.value) == (
        f"{f}:1: messages[1].content must be a string, got NoneType None (null only beside "
        "tool_calls)"
    )


def test_a_template_that_ignores_tool_calls_is_refused(tmp_path):
    tok = build_char_tokenizer(ALPHABET, chat_template=NO_CALLS)
    f = write(tmp_path / "p.jsonl", [{"messages": conversation({})[:3]}])
    with pytest.raises(DataError, match=rf"^{f}:1: turn 1 calls the tool 'add', but the chat "):
        load_prompts(str(f), tok, max_length=128)


def test_a_reply_that_only_calls_tools_has_no_text_for_last_assistant(tok, tmp_path):
    f = write(tmp_path / "sft.jsonl", [{"messages": conversation({})[:2]}])
    with pytest.raises(DataError, match="only calls tools"):
        load_sft_examples(f, tok, max_length=128, loss_on="last_assistant")
    (e,), _ = load_sft_examples(f, tok, max_length=128, loss_on="all_assistant")
    assert tok.decode(e.input_ids, skip_special_tokens=True) == "U:add 2 3\nA:<add {}>\n"
