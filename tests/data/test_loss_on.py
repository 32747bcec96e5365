"""Which SFT tokens are trained (``data.loss_on``): every assistant turn's tokens, found in the whole
conversation's tokens, checked against positions written out by hand for small templates."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from proximal.data.chat import conversation_tokens, encode_prompt
from proximal.data.jsonl import DataError
from proximal.data.sft import collate_sft, load_sft_examples
from proximal.models.tiny import build_char_tokenizer

# One line per turn, "U:" / "A:" for user / assistant; the generation prompt is "A:".
PLAIN = (
    "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
ALPHABET = "abc=:UAS\n|"
EOS = 1


def ids(text):
    """Hand ids: specials are 0..3 and ALPHABET[i] is 4 + i."""
    return [4 + ALPHABET.index(c) for c in text]


def msg(role, content):
    return {"role": role, "content": content}


THREE_TURNS = [
    msg("user", "a"),
    msg("assistant", "bb"),
    msg("user", "c"),
    msg("assistant", "b"),
    msg("user", "ab"),
    msg("assistant", "cab"),
]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET, chat_template=PLAIN)


def test_three_assistant_turns_train_exactly_their_tokens(tok, tmp_path):
    f = write(tmp_path / "chat.jsonl", [{"messages": THREE_TURNS}])
    (e,), _ = load_sft_examples(f, tok, max_length=64, loss_on="all_assistant")
    text = "U:a\nA:bb\nU:c\nA:b\nU:ab\nA:cab\n"
    assert e.input_ids == ids(text)
    # Positions by hand: "bb" at 6-7, "b" at 15, "cab" at 24-26; the newline after each turn is the
    # template's separator, not the assistant's.
    trained = [i for i, m in enumerate(e.target_mask) if m]
    assert trained == [6, 7, 15, 24, 25, 26]
    assert e.n_targets == 6
    batch = collate_sft([e], pad_token_id=0)
    assert batch["response_mask"][0].nonzero().flatten().tolist() == trained


def test_last_assistant_is_the_old_layout_bit_for_bit(tok, tmp_path):
    f = write(
        tmp_path / "chat.jsonl", [{"messages": THREE_TURNS}, {"prompt": "ab=", "response": "c"}]
    )
    examples, _ = load_sft_examples(f, tok, max_length=64, loss_on="last_assistant")
    # The layout before data.loss_on: template over the earlier turns + "A:", then the last content
    # tokenised on its own, then EOS; the mask from the prompt length.
    prompt = "U:a\nA:bb\nU:c\nA:b\nU:ab\nA:"
    assert examples[0].input_ids == ids(prompt) + ids("cab") + [EOS]
    assert (examples[0].prompt_len, examples[0].target_mask) == (len(prompt), None)
    batch = collate_sft(examples, pad_token_id=0)
    L = len(prompt) + 4
    expected_mask = [[i >= len(prompt) for i in range(L)], [3 <= i < 5 for i in range(L)]]
    assert batch["response_mask"].tolist() == expected_mask
    assert batch["input_ids"][1].tolist() == ids("ab=c") + [EOS] + [0] * (L - 5)


def test_completion_only_and_all_tokens(tok, tmp_path):
    row = {"prompt": THREE_TURNS[:4], "completion": THREE_TURNS[4:]}
    f = write(tmp_path / "c.jsonl", [row])
    (e,), _ = load_sft_examples(f, tok, max_length=64, loss_on="completion_only")
    assert [i for i, m in enumerate(e.target_mask) if m] == [24, 25, 26]
    (e,), _ = load_sft_examples(f, tok, max_length=64, loss_on="all_assistant")
    assert [i for i, m in enumerate(e.target_mask) if m] == [6, 7, 15, 24, 25, 26]
    (e,), _ = load_sft_examples(f, tok, max_length=64, loss_on="all_tokens")
    assert e.target_mask == [False] + [True] * 27
    t = write(tmp_path / "t.jsonl", [{"text": "abc"}])
    (e,), _ = load_sft_examples(t, tok, max_length=64, loss_on="all_assistant")
    assert (e.input_ids, e.target_mask) == (ids("abc") + [EOS], [False, True, True, True])


def test_a_conversation_ending_with_a_user_turn_is_refused(tok, tmp_path):
    f = write(tmp_path / "u.jsonl", [{"messages": THREE_TURNS[:5]}])
    with pytest.raises(DataError, match=rf"{f}:1: the last message .* must be the assistant's"):
        load_sft_examples(f, tok, max_length=64, loss_on="all_assistant")


# Templates in the style of three model families, their turn markers as special tokens.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN2 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FAMILIES = {
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "qwen2": (QWEN2, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
}
WORDS = "abcdefghijklmnopqrstuvwxyz\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_templates_train_content_and_end_of_turn(family):
    template, markers, end = FAMILIES[family]
    tok = build_char_tokenizer(WORDS, chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": markers})
    turns = [msg("user", "hi"), msg("assistant", "yo"), msg("user", "ok"), msg("assistant", "bye")]
    ids_, mask = conversation_tokens(turns, tok, "x:1", turns=[1, 3])
    pieces = tok.convert_ids_to_tokens(ids_)
    trained = [p for p, m in zip(pieces, mask) if m]
    # Each assistant turn: its characters and its end-of-turn token; nothing of the user turns.
    assert trained == ["y", "o", end, "b", "y", "e", end]


def merging_tokenizer():
    """The char tokenizer plus two BPE merges that cross turn boundaries: 'b' + '|' -> 'b|' (the
    template's end-of-turn '|' with a content's last 'b') and ':' + 'c' -> ':c' (the role prefix,
    the generation prompt's end for an assistant turn, with a content's first 'c')."""
    base = build_char_tokenizer(ALPHABET, chat_template=PLAIN.replace("}}\n{%", "}}|\n{%"))
    spec = json.loads(base.backend_tokenizer.to_str())
    spec["model"]["vocab"]["b|"] = len(spec["model"]["vocab"])
    spec["model"]["vocab"][":c"] = len(spec["model"]["vocab"])
    spec["model"]["merges"] = [["b", "|"], [":", "c"]]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    tok.chat_template = base.chat_template
    return tok


def test_a_token_merged_across_the_turn_boundary_is_trained():
    tok = merging_tokenizer()
    assert "}}|\n{%" in tok.chat_template
    turns = [msg("user", "a"), msg("assistant", "ab"), msg("user", "c"), msg("assistant", "ca")]
    ids_, mask = conversation_tokens(turns, tok, "x:1", turns=[1, 3])
    pieces = tok.convert_ids_to_tokens(ids_)
    # "U:a|\nA:ab|\nU:c|\nA:ca|\n": 'b|' and ':c' are single tokens. A token with any assistant
    # character is trained: 'b|' (the content's 'b', the end-of-turn '|') and the second ':c' (the
    # generation prompt's ':', the content's 'c'); the user turn's ':c' is not.
    assert pieces == (
        list("U:a|")
        + ["Ċ"]
        + list("A:a")
        + ["b|", "Ċ"]
        + ["U", ":c", "|", "Ċ"]
        + ["A", ":c", "a", "|", "Ċ"]
    )
    assert [p for p, m in zip(pieces, mask) if m] == ["a", "b|", ":c", "a", "|"]
    # Tokenising the turn's content on its own would give 'a', 'b' — a token the whole text never has.
    assert tok.convert_ids_to_tokens(encode_prompt("ab", tok)) == ["a", "b"]


def test_generation_markers_give_the_same_mask_as_prefixes(tok):
    marked = PLAIN.replace(
        "{{ m['content'] }}\n",
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}",  # (a newline after a tag is trimmed)
    )
    tok_m = build_char_tokenizer(ALPHABET, chat_template=marked)
    every = [1, 3, 5]
    assert conversation_tokens(THREE_TURNS, tok_m, "x", turns=every) == conversation_tokens(
        THREE_TURNS, tok, "x", turns=every
    )
    assert conversation_tokens(THREE_TURNS, tok_m, "x", turns=[5]) == conversation_tokens(
        THREE_TURNS, tok, "x", turns=[5]
    )


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # Drops every assistant turn but the last: a prefix's rendering is not a prefix of the whole.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}\n{% endif %}{% endfor %}"
    )
    tok = build_char_tokenizer(ALPHABET, chat_template=template)
    with pytest.raises(DataError, match=r"x:1: turn 1 \(assistant\): the chat template renders"):
        conversation_tokens(THREE_TURNS, tok, "x:1", turns=[1, 3, 5])
