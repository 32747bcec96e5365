"""A prompt set carries each row's other columns (issue 24): from every format the prompt loader reads,
renamed by ``data.columns``, the prompt itself left out — what the reward functions receive as
keywords. Expected rows are written out by hand."""

from __future__ import annotations

import json

import pytest
from ppo_support import ALPHABET
from test_sources import FORMATS, hf_home, write_all  # noqa: F401  (hf_home: a fixture)

from proximal.data.prompts import load_prompts
from proximal.models.tiny import build_char_tokenizer

ROWS = [
    {"question": "ab ", "solution": "12", "source": "x"},
    {"question": "dc ", "solution": "7", "source": "y"},
]


@pytest.mark.usefixtures("hf_home")  # a cached data set among the formats
def test_every_format_keeps_the_other_columns_renamed(assets, tmp_path):
    files = write_all(tmp_path / "prompts", ROWS, "someone/tiny-prompts")
    split = {"saved_dict": "test"}  # its test split holds the rows in order
    for fmt in FORMATS:
        kw = {"split": split[fmt]} if fmt in split else {}
        ps = load_prompts(
            files[fmt],
            assets.tokenizer,
            max_length=8,
            columns={"prompt": "question", "answer": "solution"},
            **kw,
        )
        assert ps.texts == ["ab ", "dc "], fmt
        assert ps.columns == [
            {"source": "x", "answer": "12"},
            {"source": "y", "answer": "7"},
        ], fmt
        assert ps.column_names() == ["source", "answer"], fmt
        assert ps.columns_of([1, 1, 0]) == [ps.columns[1], ps.columns[1], ps.columns[0]], fmt


def test_values_keep_their_type_and_a_conversation_is_the_prompt(tmp_path):
    """JSON keeps an integer and a list; with messages as the prompt, 'messages' is not a column (but
    'tools' and the rest are); rows may differ in their columns."""
    path = tmp_path / "p.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    rows = [
        {"prompt": "ab", "answer": 12, "tests": ["a", "b"]},
        {"messages": [{"role": "user", "content": "cd"}], "tools": tools, "answer": 3},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_char_tokenizer(
        list(ALPHABET), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    ps = load_prompts(str(path), tok, max_length=8)
    assert ps.columns == [{"answer": 12, "tests": ["a", "b"]}, {"tools": tools, "answer": 3}]
    assert ps.column_names() == ["answer", "tests", "tools"]
