"""Preference-pair loading: every accepted record shape, margins, batching, and file:line errors."""

from __future__ import annotations

import json

import pytest

from proximal.data.jsonl import DataError
from proximal.data.preferences import collate_pairs, load_preference_pairs, render_preference
from proximal.models.tiny import build_char_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
ALPHABET = "abc=:UAS\n"
EOS = 1


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET, chat_template=TEMPLATE)


def ids(text):
    """Hand ids: the char tokenizer maps specials to 0..3 and ALPHABET[i] to 4 + i."""
    return [4 + ALPHABET.index(c) for c in text]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def msg(role, content):
    return {"role": role, "content": content}


def test_plain_pair_ids(tok, tmp_path):
    f = write(tmp_path / "p.jsonl", [{"prompt": "a=", "chosen": "bb", "rejected": "c"}])
    pairs, report = load_preference_pairs(f, tok, max_length=16)
    assert (report.rows, report.skipped) == (1, 0)
    assert pairs[0].chosen_ids == ids("a=bb") + [EOS]
    assert pairs[0].rejected_ids == ids("a=c") + [EOS]
    assert pairs[0].margin is None
    assert pairs[0].where == f"{f}:1"


@pytest.mark.parametrize(
    "record",
    [
        {"messages": [msg("user", "ab")], "chosen": "c", "rejected": "a"},
        {"prompt": [msg("user", "ab")], "chosen": "c", "rejected": "a"},
        # whole conversations sharing every turn but the last (the shared turns are the prompt)
        {
            "chosen": [msg("user", "ab"), msg("assistant", "c")],
            "rejected": [msg("user", "ab"), msg("assistant", "a")],
        },
        # a prompt list followed by assistant-only lists
        {
            "prompt": [msg("user", "ab")],
            "chosen": [msg("assistant", "c")],
            "rejected": [msg("assistant", "a")],
        },
    ],
)
def test_message_forms_render_the_same(tok, record):
    assert render_preference(record, tok, "x:1") == ("U:ab\nA:", "c", "a")


def test_margins_and_collate(tok, tmp_path):
    f = write(
        tmp_path / "m.jsonl",
        [
            {"prompt": "a", "chosen": "bb", "rejected": "c", "margin": 1},
            {"prompt": "a", "chosen": "c", "rejected": "ccc", "margin": 0.5},
        ],
    )
    pairs, _ = load_preference_pairs(f, tok, max_length=16)
    assert [p.margin for p in pairs] == [1.0, 0.5]
    batch = collate_pairs(pairs, pad_token_id=0)
    # chosen sides first, then rejected; right padding
    assert batch["input_ids"].tolist() == [
        ids("abb") + [EOS, 0],
        ids("ac") + [EOS, 0, 0],
        ids("ac") + [EOS, 0, 0],
        ids("accc") + [EOS],
    ]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [1] * 5,
    ]
    assert batch["margin"].tolist() == [1.0, 0.5]
    assert "margin" not in collate_pairs(
        load_preference_pairs(
            write(tmp_path / "n.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}]),
            tok,
            max_length=8,
        )[0],
        0,
    )


@pytest.mark.parametrize(
    "rows, line, message",
    [
        (
            [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "rejected": "c"}],
            2,
            "missing field 'chosen' (fields present: prompt, rejected)",
        ),
        ([{"prompt": "a", "chosen": "b"}], 1, "missing field 'rejected'"),
        ([{"chosen": "b", "rejected": "c"}], 1, "missing field 'prompt' (or 'messages')"),
        (
            [{"prompt": "a", "chosen": 5, "rejected": "c"}],
            1,
            "field 'chosen' must be a string or a list of messages, got int",
        ),
        (
            [{"prompt": 7, "chosen": "b", "rejected": "c"}],
            1,
            "field 'prompt' must be a string or a list of messages",
        ),
        (
            [{"prompt": "a", "chosen": "b", "rejected": "c"}, "[1, 2]"],
            2,
            "expected a JSON object, got list",
        ),
        (["{'prompt': 'a'}"], 1, "not valid JSON"),
        (
            [{"prompt": "a", "chosen": "b", "rejected": [msg("assistant", "c")]}],
            1,
            "must both be strings or both",
        ),
        (
            [
                {
                    "chosen": [msg("user", "a"), msg("assistant", "b")],
                    "rejected": [msg("user", "b"), msg("assistant", "c")],
                }
            ],
            1,
            "must share every turn but the last",
        ),
        (
            [{"chosen": [msg("user", "a")], "rejected": [msg("user", "a")]}],
            1,
            "last message of 'chosen' must be",
        ),
        (
            [
                {
                    "prompt": "a",
                    "chosen": [msg("user", "a"), msg("assistant", "b")],
                    "rejected": [msg("user", "a"), msg("assistant", "c")],
                }
            ],
            1,
            "a string 'prompt' cannot be followed",
        ),
        (
            [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}],
            1,
            "field 'margin' must be a finite number",
        ),
        (
            [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": True}],
            1,
            "field 'margin' must be a finite number",
        ),
        (
            [
                {"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1},
                {"prompt": "a", "chosen": "b", "rejected": "c"},
            ],
            2,
            "this row has no 'margin' but",
        ),
        (
            [
                {"prompt": "a", "chosen": "b", "rejected": "c"},
                {"prompt": "a=", "chosen": "b", "rejected": "cccccc"},
            ],
            2,
            "prompt + rejected is 9 tokens (prompt 2 + response and EOS 7), longer than data.max_length = 8",
        ),
        (
            [{"prompt": "a=", "chosen": "bbbbbbb", "rejected": "c"}],
            1,
            "prompt + chosen is 10 tokens",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tok, tmp_path, rows, line, message):
    f = write(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_preference_pairs(f, tok, max_length=8)
    assert f"{f}:{line}: " in str(e.value)
    assert message in str(e.value)


def test_empty_file(tok, tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no records"):
        load_preference_pairs(f, tok, max_length=8)


def test_skip_pairs_with_a_long_side(tok, tmp_path):
    f = write(
        tmp_path / "s.jsonl",
        [
            {"prompt": "a", "chosen": "b", "rejected": "cccccc"},
            {"prompt": "a", "chosen": "bbbbbb", "rejected": "c"},
            {"prompt": "a", "chosen": "b", "rejected": "c"},
        ],
    )
    pairs, report = load_preference_pairs(f, tok, max_length=4, on_too_long="skip")
    assert [p.where for p in pairs] == [f"{f}:3"]
    assert (report.rows, report.skipped) == (3, 2)


def test_truncate_keeps_the_prompt_and_the_start_of_each_response(tok, tmp_path):
    f = write(
        tmp_path / "t.jsonl",
        [
            {"prompt": "a=", "chosen": "bbbbbb", "rejected": "cc"},
            {"prompt": "a=", "chosen": "b", "rejected": "c"},
            {"prompt": "ab=", "chosen": "bbbbbb", "rejected": "bbbbba"},
        ],
    )
    pairs, report = load_preference_pairs(
        f, tok, max_length=5, on_too_long="truncate", on_empty="skip"
    )
    # row 1: the chosen side is cut after 5 tokens (its EOS is lost), the short rejected side is whole
    assert pairs[0].chosen_ids == ids("a=bbb") and pairs[0].rejected_ids == ids("a=cc") + [EOS]
    assert pairs[0].prompt_len == 2
    assert pairs[1].chosen_ids == ids("a=b") + [EOS]
    # row 3: the responses differ only after max_length: the same response once cut, so dropped
    assert [p.where for p in pairs] == [f"{f}:1", f"{f}:2"]
    assert (report.rows, report.truncated, report.skipped, report.skipped_empty) == (3, 1, 0, 1)
    batch = collate_pairs(pairs, pad_token_id=0)
    assert batch["response_mask"][0].tolist() == [False, False, True, True, True]


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "aaaa=", "chosen": "b", "rejected": "c"}],
            "the prompt is 5 tokens, which leaves no room for a response within data.max_length = 5",
        ),
        (
            [{"prompt": "a=", "chosen": "bbbbbb", "rejected": "bbbbbc"}],
            "'chosen' and 'rejected' are the same response once cut to data.max_length = 5, "
            "so the pair teaches nothing",
        ),
    ],
)
def test_truncation_errors_name_the_row(tok, tmp_path, rows, message):
    f = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_preference_pairs(f, tok, max_length=5, on_too_long="truncate")
    assert str(e.value).startswith(f"{f}:1: {message}")


def test_a_template_that_writes_bos_gets_no_second_one(tmp_path):
    from tokenizers import processors

    tok = build_char_tokenizer(ALPHABET, chat_template="<bos>" + TEMPLATE)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    f = write(
        tmp_path / "b.jsonl",
        [
            {"messages": [msg("user", "ab")], "chosen": "c", "rejected": "a"},
            {"prompt": "ab", "chosen": "c", "rejected": "a"},
        ],
    )
    pairs, _ = load_preference_pairs(f, tok, max_length=16)
    assert pairs[0].chosen_ids == [2] + ids("U:ab\nA:c") + [EOS]  # the template's BOS, once
    assert pairs[1].chosen_ids == [2] + ids("abc") + [EOS]  # a plain prompt: the tokenizer's BOS
