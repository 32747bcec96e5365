"""Prompt sets for PPO and pretraining text for the PTX loss.

Prompts are rows ``{"prompt": str}`` or ``{"messages": [...]}`` (the latter rendered with the
tokenizer's chat template) in any format :func:`proximal.data.sources.read_rows` reads: JSONL, JSON,
Parquet, CSV, Arrow, a ``save_to_disk`` directory or a data set name in the local Hugging Face cache.
Prompts longer than the limit are truncated on the left (keeping the end, where the question usually
is) or skipped and counted, as configured. A row's other fields (``answer``, ``tests``, …: its
*columns*, after ``data.columns`` renamed them) are kept beside its prompt for the reward functions,
which receive them as keyword arguments (:mod:`proximal.rollout.reward_functions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proximal.config import PythonObject
from proximal.data.chat import (
    RowTools,
    apply_template,
    check_messages,
    check_tools,
    encode_prompt,
    prompt_context,
    render_prompt,
)
from proximal.data.jsonl import DataError, require_str
from proximal.data.sources import is_data_source, read_rows


@dataclass
class PromptSet:
    """Rendered prompts with their token ids (unpadded), where given their message lists, and each
    row's columns: its fields other than the prompt (``prompt`` or ``messages``) itself, values as
    read (a CSV cell is a string)."""

    texts: list[str]
    token_ids: list[list[int]]
    messages: list[list | None]
    skipped_too_long: int = 0
    truncated: int = 0
    skipped_empty: int = 0
    columns: list[dict[str, Any]] = field(default_factory=list)  # one per prompt (or none at all)

    def __len__(self) -> int:
        return len(self.texts)

    def column_names(self) -> list[str]:
        """Every column some row has, in the order they first appear."""
        return list(dict.fromkeys(k for row in self.columns for k in row))

    def columns_of(self, idx: list[int]) -> list[dict[str, Any]] | None:
        """The columns of prompts ``idx`` (repeats included: a group's prompt once per response)."""
        return [self.columns[i] for i in idx] if self.columns else None


def load_prompts(
    path: str,
    tokenizer,
    *,
    max_length: int,
    on_too_long: str = "truncate_left",
    on_empty: str = "error",
    split: str | None = None,
    columns: dict[str, str] | None = None,
    tools: RowTools | None = None,
) -> PromptSet:
    """Read, render and tokenize every prompt. Raises DataError for bad rows or an empty set.

    ``tools``: the tool schemas each row is offered (an agent run's, :func:`render_prompt`), so a
    conversational prompt is rendered, measured against ``max_length`` and truncated or skipped
    with the schemas the model will read; None reads a row's ``tools`` column as the schemas.

    A prompt that tokenizes to nothing (an empty string, or text the tokenizer drops) would have the
    model "answer" pure padding: an error naming its file:line, or with ``on_empty='skip'`` dropped
    and counted.
    """
    texts, ids, messages, row_columns = [], [], [], []
    skipped = truncated = empty = 0
    for where, record in read_rows(path, split=split, columns=columns):
        text = render_prompt(record, tokenizer, where, tools)
        tok = encode_prompt(text, tokenizer)
        if not tok:
            if on_empty == "skip":
                empty += 1
                continue
            raise DataError(
                f"{where}: the prompt {text!r:.60} has no tokens after tokenisation; give it some text "
                "or set data.on_empty_prompt: skip"
            )
        if len(tok) > max_length:
            if on_too_long == "skip":
                skipped += 1
                continue
            tok = tok[-max_length:]
            text = tokenizer.decode(tok, skip_special_tokens=False)
            truncated += 1
        texts.append(text)
        ids.append(tok)
        # The messages, as 'messages' or as a conversational 'prompt': a reward model with another
        # tokenizer renders them with its own chat template (rollout/scoring.py).
        context = prompt_context(record, where)
        messages.append(context if isinstance(context, list) else None)
        prompt_key = "prompt" if "prompt" in record else "messages"
        row_columns.append({k: v for k, v in record.items() if k != prompt_key})
    if not texts:
        why = []
        if skipped:
            why.append(
                f"{skipped} {'was' if skipped == 1 else 'were'} longer than data.max_prompt_length = "
                f"{max_length} and skipped"
            )
        if empty:
            why.append(f"{empty} {'was' if empty == 1 else 'were'} empty and skipped")
        raise DataError(f"{path}: no prompts" + (f" ({'; '.join(why)})" if why else ""))
    return PromptSet(
        texts,
        ids,
        messages,
        skipped_too_long=skipped,
        truncated=truncated,
        skipped_empty=empty,
        columns=row_columns,
    )


def load_texts(
    path: str,
    *,
    key: str = "text",
    split: str | None = None,
    columns: dict[str, str] | None = None,
    tokenizer=None,
) -> list[str]:
    """Pretraining texts for the PTX loss: rows with a ``text`` field, or conversations
    (``messages``, optionally with ``tools``), in any format :func:`~proximal.data.sources.read_rows`
    reads, or a plain text file (one text per line; any other suffix, such as ``.txt``).

    A conversation becomes the text of ``tokenizer``'s chat template over all its turns (no
    generation prompt), and PTX trains every token of it, as of a ``text`` row: the PTX loss is
    language modelling of a whole text, not supervision of one speaker. A BOS string the template
    writes is taken off the front when the tokenizer adds its own BOS on tokenising (it does, in the
    PTX step), so a text has one. From Python, rows given in the config (``data.ptx_file``).
    """
    p = path if isinstance(path, PythonObject) else Path(path)
    if is_data_source(p):
        texts = [
            _ptx_text(r, key, where, tokenizer)
            for where, r in read_rows(p, split=split, columns=columns)
        ]
    else:
        texts = []
        for lineno, raw in enumerate(p.read_bytes().splitlines(), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if line.strip():
                texts.append(line)
    if not texts:
        raise DataError(f"{p}: no pretraining texts")
    return texts


def _ptx_text(record: dict, key: str, where: str, tokenizer) -> str:
    """A PTX row's text: its ``key`` field, or its conversation rendered whole (see load_texts)."""
    if key in record:
        return require_str(record, key, where)
    if "messages" not in record:
        raise DataError(
            f"{where}: missing field {key!r} (fields present: {', '.join(sorted(record)) or 'none'}); "
            f"a PTX row is {{{key!r}: str}} or a conversation {{'messages': [...]}}"
        )
    messages = check_messages(record["messages"], where)
    if tokenizer is None:
        raise DataError(f"{where}: a conversation row needs a tokenizer to render it")
    text = apply_template(
        messages,
        tokenizer,
        where,
        tools=check_tools(record, where),
        add_generation_prompt=False,
        check_calls=True,
    )
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos) :]
    return text
