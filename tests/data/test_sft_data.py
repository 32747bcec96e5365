"""Prompt/response loading, chat rendering and the response mask, checked against hand-written ids."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import processors

from proximal.data.chat import encode_prompt, render_pair, render_prompt
from proximal.data.jsonl import DataError
from proximal.data.sft import collate_sft, load_sft_examples
from proximal.models.tiny import build_char_tokenizer

# One line per turn, "U:" / "A:" / "S:" for user / assistant / system; the generation prompt is "A:".
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
ALPHABET = "abc=:UAS\n"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET, chat_template=TEMPLATE)


def ids(tok, text):
    """Hand ids: the char tokenizer maps specials to 0..3 and ALPHABET[i] to 4 + i."""
    return [4 + ALPHABET.index(c) for c in text]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


EOS = 1


def test_prompt_response_ids_and_mask(tok, tmp_path):
    f = write(
        tmp_path / "sft.jsonl",
        [{"prompt": "ab=", "response": "cc"}, {"prompt": "a=", "response": "b"}],
    )
    examples, report = load_sft_examples(f, tok, max_length=16)
    assert (report.rows, report.skipped) == (2, 0)
    assert examples[0].input_ids == ids(tok, "ab=") + ids(tok, "cc") + [EOS]
    assert examples[0].prompt_len == 3
    assert examples[0].where == f"{f}:1"
    batch = collate_sft(examples, pad_token_id=tok.pad_token_id)
    assert batch["input_ids"].tolist() == [ids(tok, "ab=cc") + [EOS], ids(tok, "a=b") + [EOS, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    # True exactly on the response tokens and their EOS; never on the prompt or on padding.
    assert batch["response_mask"].tolist() == [
        [False, False, False, True, True, True],
        [False, False, True, True, False, False],
    ]
    assert batch["response_mask"].dtype == torch.bool


def test_messages_render_prompt_with_template_and_response_as_content(tok, tmp_path):
    record = {
        "messages": [
            {"role": "system", "content": "c"},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "ba"},
        ]
    }
    prompt, response = render_pair(record, tok, "x:1")
    assert prompt == "S:c\nU:ab\nA:"
    assert response == "ba"
    examples, _ = load_sft_examples(write(tmp_path / "m.jsonl", [record]), tok, max_length=32)
    assert examples[0].input_ids == ids(tok, "S:c\nU:ab\nA:") + ids(tok, "ba") + [EOS]
    assert examples[0].prompt_len == len("S:c\nU:ab\nA:")


def test_render_prompt_for_ppo(tok):
    # A string is used verbatim (no template); with messages every turn is context.
    assert render_prompt({"prompt": "ab="}, tok, "x:1") == "ab="
    msgs = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "a"},
    ]
    assert render_prompt({"messages": msgs}, tok, "x:1") == "U:ab\nA:c\nU:a\nA:"
    assert render_prompt({"prompt": msgs}, tok, "x:1") == "U:ab\nA:c\nU:a\nA:"


def test_messages_plus_response_field(tok):
    prompt, response = render_pair(
        {"messages": [{"role": "user", "content": "a"}], "response": "b"}, tok, "x:1"
    )
    assert (prompt, response) == ("U:a\nA:", "b")


def test_encode_prompt_adds_bos_once():
    tok = build_char_tokenizer("ab")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    assert encode_prompt("ab", tok) == [2, 4, 5]
    assert encode_prompt("<bos>ab", tok) == [
        2,
        4,
        5,
    ]  # a template that writes BOS itself: not doubled


@pytest.mark.parametrize(
    "rows, line, message",
    [
        ([{"prompt": "a", "response": "b"}, '{"prompt": "a", "response": '], 2, "not valid JSON"),
        ([{"prompt": "a", "response": 3}], 1, "field 'response' must be a string, got int"),
        ([{"prompt": ["a"], "response": "b"}], 1, "prompt[0] must be an object"),
        ([{"prompt": "a", "response": "b"}, {"prompt": "a"}], 2, "missing field 'response'"),
        ([{"response": "b"}], 1, "missing field 'prompt' (or 'messages')"),
        ([{"prompt": "a", "messages": [], "response": "b"}], 1, "either 'prompt' or 'messages'"),
        ([{"messages": [{"role": "user", "content": "a"}]}], 1, "must be the assistant's response"),
        ([{"messages": [{"role": "assistant", "content": "a"}]}], 1, "at least one earlier turn"),
        (
            [{"messages": [{"role": "user", "content": 1}, {"role": "assistant", "content": "a"}]}],
            1,
            "messages[0].content must be a string",
        ),
        (
            [
                {
                    "messages": [
                        {"role": "robot", "content": "a"},
                        {"role": "assistant", "content": "a"},
                    ]
                }
            ],
            1,
            "messages[0].role is 'robot'",
        ),
        (
            [{"prompt": "a", "response": "b"}, {"prompt": "ab", "response": "abcab"}],
            2,
            "prompt + response is 8 tokens (prompt 2 + response and EOS 6), longer than data.max_length = 7",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tok, tmp_path, rows, line, message):
    f = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_sft_examples(f, tok, max_length=7)
    assert f"{f}:{line}: " in str(e.value)
    assert message in str(e.value)


def test_empty_file(tok, tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n  \n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no records"):
        load_sft_examples(f, tok, max_length=8)


def test_missing_file(tok, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_sft_examples(tmp_path / "nope.jsonl", tok, max_length=8)


def test_skip_too_long_rows(tok, tmp_path):
    f = write(
        tmp_path / "s.jsonl",
        [{"prompt": "a", "response": "bbbbbbbb"}, {"prompt": "a", "response": "b"}],
    )
    examples, report = load_sft_examples(f, tok, max_length=4, on_too_long="skip")
    assert [e.where for e in examples] == [f"{f}:2"]
    assert (report.rows, report.skipped) == (2, 1)
    with pytest.raises(DataError, match=r"all 2 rows are longer than data.max_length = 2"):
        load_sft_examples(f, tok, max_length=2, on_too_long="skip")


def test_messages_need_a_chat_template(tmp_path):
    tok = build_char_tokenizer("ab")
    f = write(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    with pytest.raises(DataError, match=rf"{f}:1: .*has no chat template"):
        load_sft_examples(f, tok, max_length=8)
