"""Row formats at the data layer: preference pairs with an implicit prompt (plain strings, message
lists), TRL's conversational preference rows, and PTX texts from conversations. Expected values are
written out by hand; the command-line runs of every format are in tests/trainers/test_formats_cli.py."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import processors

from proximal.data.jsonl import DataError
from proximal.data.preferences import implicit_prompt, load_preference_pairs, render_preference
from proximal.data.prompts import load_prompts, load_texts
from proximal.models.tiny import build_char_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
ALPHABET = "abcdefxyz =:?+24UAS\n"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET, chat_template=TEMPLATE)


def ids(text):
    """Hand ids: the char tokenizer maps specials to 0..3 and ALPHABET[i] to 4 + i."""
    return [4 + ALPHABET.index(c) for c in text]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def msg(role, content):
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    "chosen, rejected, expected",
    [
        # the first difference is after a space: the space opens both responses
        ("x=2+2? A: 4", "x=2+2? A: 2", ("x=2+2? A:", " 4", " 2")),
        # the first difference is inside a word: cut back to the word's start, not "ab c" + "d"/"f"
        ("ab cde", "ab cfe", ("ab", " cde", " cfe")),
        # a run of whitespace goes to the responses whole
        ("ab  c", "ab  d", ("ab", "  c", "  d")),
        ("ab\n\nc", "ab\n\nde", ("ab", "\n\nc", "\n\nde")),
        # one side extends the other
        ("ab c", "ab cd", ("ab", " c", " cd")),
        # no whitespace in the common start: cut where the texts differ
        ("abc", "abd", ("ab", "c", "d")),
    ],
)
def test_implicit_prompt_cuts_at_a_word_boundary(chosen, rejected, expected):
    assert implicit_prompt(chosen, rejected, "x:1") == expected


@pytest.mark.parametrize("chosen, rejected", [("a", "b"), (" ab", " ac"), ("\nx", "\ny")])
def test_implicit_prompt_needs_a_shared_word(chosen, rejected):
    with pytest.raises(
        DataError, match=r"^x:1: missing field 'prompt' .* share no implicit prompt"
    ):
        implicit_prompt(chosen, rejected, "x:1")


def test_implicit_rows_give_the_tokens_of_explicit_ones(tok, tmp_path):
    implicit = write(
        tmp_path / "i.jsonl", [{"chosen": "x=2+2? A: 4", "rejected": "x=2+2? A: 2", "margin": 1}]
    )
    explicit = write(
        tmp_path / "e.jsonl",
        [{"prompt": "x=2+2? A:", "chosen": " 4", "rejected": " 2", "margin": 1}],
    )
    (a,), _ = load_preference_pairs(implicit, tok, max_length=32)
    (b,), _ = load_preference_pairs(explicit, tok, max_length=32)
    assert a.chosen_ids == ids("x=2+2? A: 4") + [1]
    assert a.rejected_ids == ids("x=2+2? A: 2") + [1]
    assert a.prompt_len == len("x=2+2? A:")
    assert (a.chosen_ids, a.rejected_ids, a.prompt_len, a.margin) == (
        b.chosen_ids,
        b.rejected_ids,
        b.prompt_len,
        b.margin,
    )


def test_identical_implicit_sides_are_the_same_response(tok, tmp_path):
    f = write(tmp_path / "i.jsonl", [{"chosen": "ab cd", "rejected": "ab cd"}])
    with pytest.raises(DataError, match="are the same response"):
        load_preference_pairs(f, tok, max_length=32)


@pytest.mark.parametrize(
    "record",
    [
        # TRL's conversational preference row: prompt messages, one assistant message each side
        {
            "prompt": [msg("system", "z"), msg("user", "ab")],
            "chosen": [msg("assistant", "c")],
            "rejected": [msg("assistant", "d")],
        },
        # the implicit prompt of message lists: the shared leading turns
        {
            "chosen": [msg("system", "z"), msg("user", "ab"), msg("assistant", "c")],
            "rejected": [msg("system", "z"), msg("user", "ab"), msg("assistant", "d")],
        },
        # part of the prompt in 'prompt', the rest shared in both sides
        {
            "prompt": [msg("system", "z")],
            "chosen": [msg("user", "ab"), msg("assistant", "c")],
            "rejected": [msg("user", "ab"), msg("assistant", "d")],
        },
    ],
)
def test_conversational_rows(tok, record):
    assert render_preference(record, tok, "x:1") == ("S:z\nU:ab\nA:", "c", "d")


def test_conversational_rows_hand_tools_to_the_template(tmp_path):
    template = "{% if tools %}T:{{ tools[0]['name'] }}\n{% endif %}" + TEMPLATE
    tok = build_char_tokenizer(ALPHABET + "T", chat_template=template)
    record = {
        "prompt": [msg("user", "ab")],
        "chosen": [msg("assistant", "c")],
        "rejected": [msg("assistant", "d")],
        "tools": [{"name": "xyz"}],
    }
    assert render_preference(record, tok, "x:1") == ("T:xyz\nU:ab\nA:", "c", "d")


def test_conversational_sides_that_differ_earlier_are_refused(tok):
    record = {
        "chosen": [msg("user", "ab"), msg("assistant", "c")],
        "rejected": [msg("user", "ac"), msg("assistant", "d")],
    }
    with pytest.raises(DataError, match="must share every turn but the last"):
        render_preference(record, tok, "x:1")


def test_ptx_texts_from_text_rows_and_conversations(tok, tmp_path):
    f = write(
        tmp_path / "ptx.jsonl",
        [
            {"text": "ab cd"},
            {"messages": [msg("user", "ab"), msg("assistant", "c"), msg("user", "d")]},
            {"messages": [msg("user", "a")], "tools": [{"name": "x"}]},
        ],
    )
    # a conversation is the template's text over every turn, with no generation prompt
    assert load_texts(str(f), tokenizer=tok) == ["ab cd", "U:ab\nA:c\nU:d\n", "U:a\n"]


def test_ptx_conversations_keep_one_bos(tmp_path):
    f = write(tmp_path / "ptx.jsonl", [{"messages": [msg("user", "ab")]}])
    writes_bos = build_char_tokenizer(ALPHABET, chat_template="<bos>" + TEMPLATE)
    # the tokenizer adds no BOS of its own: the template's stays
    assert load_texts(str(f), tokenizer=writes_bos) == ["<bos>U:ab\n"]
    # it adds one (as the PTX step tokenises with special tokens): the template's is taken off
    writes_bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    (text,) = load_texts(str(f), tokenizer=writes_bos)
    assert text == "U:ab\n"
    assert writes_bos(text).input_ids == [2] + ids("U:ab\n")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "ab"}, "missing field 'text' (fields present: prompt); a PTX row is"),
        ({"messages": [msg("user", 5)]}, "content"),
    ],
)
def test_ptx_rows_of_other_shapes_are_refused(tok, tmp_path, row, message):
    f = write(tmp_path / "ptx.jsonl", [{"text": "a"}, row])
    with pytest.raises(DataError, match=f"^{re.escape(str(f))}:2: .*{re.escape(message)}"):
        load_texts(str(f), tokenizer=tok)


def test_conversational_prompts_keep_their_messages(tok, tmp_path):
    """A conversational prompt-only row (TRL's {'prompt': [messages]}) keeps its messages, as a
    'messages' row does: a reward model with its own chat template renders them (rollout/scoring.py)."""
    f = write(
        tmp_path / "p.jsonl",
        [{"prompt": [msg("user", "ab")]}, {"messages": [msg("user", "cd")]}, {"prompt": "ab"}],
    )
    prompts = load_prompts(str(f), tok, max_length=16)
    assert prompts.texts == ["U:ab\nA:", "U:cd\nA:", "ab"]
    assert prompts.messages == [[msg("user", "ab")], [msg("user", "cd")], None]
