"""Prompt/response pairs for supervised fine-tuning: loading, the response mask, and batching.

One example is ``prompt ids + response ids + EOS`` with a bool ``response_mask`` that is True on
exactly the response ids and the EOS — the tokens the loss is computed on
(:func:`proximal.core.sft_loss`). Record formats are described in :mod:`proximal.data.chat`.

Which tokens are trained is ``loss_on`` (``data.loss_on``; docs/data.md, "Which tokens are trained"):

* ``all_assistant`` (default) — a conversation is rendered and tokenised whole and every assistant
  turn's tokens are trained (:func:`proximal.data.chat.conversation_tokens`); a prompt/completion
  row in strings keeps the layout above (its completion trained); a ``text`` row trains every token;
* ``last_assistant`` — the layout above for every row, conversations included: the earlier turns
  are prompt, the last assistant turn's content is tokenised on its own and followed by EOS (the
  behaviour before ``data.loss_on`` existed, kept bit for bit);
* ``completion_only`` — only the completion: a conversational prompt/completion row trains the
  assistant turns of its completion (assistant turns in its prompt are context), a ``messages`` row
  its last turn, from the whole conversation's tokens;
* ``all_tokens`` — every token of the row (but the first, which nothing predicts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.data.chat import (
    LOSS_ON,
    check_ends_with_reply,
    conversation_tokens,
    encode_prompt,
    encode_response,
    render_pair,
    sft_parts,
)
from proximal.data.collate import right_padded_with_spans
from proximal.data.jsonl import DataError
from proximal.data.sources import no_records, read_rows

#: ``data.on_too_long`` and ``data.on_empty``: stop with the row's file:line, or drop and count it.
ON_TOO_LONG = ("error", "skip")
ON_EMPTY = ("error", "skip")


@dataclass
class SFTExample:
    input_ids: list[int]  # prompt ids + response ids + EOS, or a whole conversation's ids
    prompt_len: int  # number of prompt ids at the front (0 with a target_mask)
    where: str  # "file:line", for messages about this row
    # True on the tokens with a loss, when they are not simply everything after the prompt
    # (every assistant turn of a conversation, a whole text); None = input_ids[prompt_len:].
    target_mask: list[bool] | None = None

    @property
    def n_targets(self) -> int:
        """Tokens the loss is computed on: the response ids and the EOS (or the masked tokens)."""
        if self.target_mask is not None:
            return sum(self.target_mask)
        return len(self.input_ids) - self.prompt_len

    def mask(self) -> list[bool]:
        """``target_mask``, or the same as a list: False on the prompt, True after it."""
        if self.target_mask is not None:
            return self.target_mask
        return [False] * self.prompt_len + [True] * (len(self.input_ids) - self.prompt_len)


@dataclass
class LoadReport:
    """What happened to the rows of one file."""

    path: str
    rows: int = 0  # rows read
    skipped: int = 0  # rows dropped for being longer than max_length (on_too_long = "skip")
    skipped_empty: int = 0  # rows dropped for an empty response (on_empty = "skip")
    truncated: int = (
        0  # rows kept with their end cut at max_length (preference pairs, on_too_long = "truncate")
    )

    @property
    def kept(self) -> int:
        return self.rows - self.skipped - self.skipped_empty

    def metrics(self, split: str) -> dict:
        return {
            f"data/{split}_rows": self.kept,
            f"data/{split}_skipped": self.skipped,
            f"data/{split}_skipped_empty": self.skipped_empty,
        }

    def none_left(self, max_length: int) -> DataError:
        if not self.skipped_empty:
            every = "the only row is" if self.rows == 1 else f"all {self.rows} rows are"
            return DataError(
                f"{self.path}: {every} longer than data.max_length = {max_length} "
                "and skipped; raise data.max_length"
            )
        why = []
        if self.skipped:
            why.append(f"{self.skipped} longer than data.max_length = {max_length}")
        if self.skipped_empty:
            why.append(
                f"{self.skipped_empty} with an empty response (or, for pairs, two identical ones)"
            )
        every = "the only row was" if self.rows == 1 else f"all {self.rows} rows were"
        return DataError(f"{self.path}: {every} skipped ({'; '.join(why)})")


def too_long_error(where: str, what: str, n: int, prompt_len: int, max_length: int) -> DataError:
    return DataError(
        f"{where}: {what} is {n} tokens (prompt {prompt_len} + response and EOS "
        f"{n - prompt_len}), longer than data.max_length = {max_length}; raise "
        "data.max_length or set data.on_too_long: skip to drop such rows"
    )


def empty_error(where: str, what: str) -> DataError:
    return DataError(
        f"{where}: {what} is empty, so there is nothing to learn from this row; fix the row or set "
        "data.on_empty: skip to drop such rows"
    )


def load_sft_examples(
    path: str | Path,
    tokenizer,
    *,
    max_length: int,
    on_too_long: str = "error",
    on_empty: str = "error",
    split: str | None = None,
    columns: dict[str, str] | None = None,
    loss_on: str = "last_assistant",
) -> tuple[list[SFTExample], LoadReport]:
    """Read and tokenise a JSONL file of SFT records (text, prompt/completion or conversation rows).

    ``loss_on`` chooses the trained tokens (module docstring); this function's default is the layout it
    always had, the config field's (``data.loss_on``) is ``all_assistant``. Raises DataError naming ``file:line``
    for a malformed row, a row longer than ``max_length`` (when ``on_too_long == "error"``), an empty
    response (when ``on_empty == "error"``), an empty file, or a file where every row was skipped.
    """
    if on_too_long not in ON_TOO_LONG or on_empty not in ON_EMPTY or loss_on not in LOSS_ON:
        raise ValueError(
            f"on_too_long = {on_too_long!r}, on_empty = {on_empty!r}, loss_on = {loss_on!r}: expected "
            f"'error' or 'skip', and one of {', '.join(LOSS_ON)}"
        )
    report = LoadReport(str(path))
    examples = []
    for where, record in read_rows(path, split=split, columns=columns):
        report.rows += 1
        kind, a, b, start = sft_parts(record, where)
        if kind == "pair" or loss_on == "last_assistant":
            example = _pair_example(record, tokenizer, where, all_tokens=loss_on == "all_tokens")
        else:
            example = _masked_example(kind, a, b, start, tokenizer, where, loss_on)
        if example is None:
            if on_empty == "skip":
                report.skipped_empty += 1
                continue
            raise empty_error(where, "the response")
        if len(example.input_ids) > max_length:
            if on_too_long == "skip":
                report.skipped += 1
                continue
            if example.target_mask is None:
                what = "prompt + response"
                raise too_long_error(
                    where, what, len(example.input_ids), example.prompt_len, max_length
                )
            raise DataError(
                f"{where}: the row is {len(example.input_ids)} tokens, longer than data.max_length "
                f"= {max_length}; raise data.max_length or set data.on_too_long: skip to drop such "
                "rows"
            )
        examples.append(example)
    if report.rows == 0:
        raise DataError(no_records(path))
    if not examples:
        raise report.none_left(max_length)
    return examples, report


def _pair_example(record: dict, tokenizer, where: str, *, all_tokens: bool) -> SFTExample | None:
    """Prompt ids + separately tokenised response ids + EOS (None: the response is empty)."""
    prompt, response = render_pair(record, tokenizer, where)
    prompt_ids = encode_prompt(prompt, tokenizer)
    if not prompt_ids:
        # The first response token is predicted from the last prompt token; with no prompt token
        # (and no BOS) there is nothing to predict it from.
        raise DataError(
            f"{where}: the prompt is empty after tokenisation (and the tokenizer adds no "
            "BOS), so the first response token cannot be trained"
        )
    response_ids = encode_response(response, tokenizer)
    if len(response_ids) <= 1:  # the EOS alone
        return None
    ids = prompt_ids + response_ids
    if all_tokens:
        return SFTExample(ids, 0, where, [False] + [True] * (len(ids) - 1))
    return SFTExample(ids, len(prompt_ids), where)


def _masked_example(
    kind: str, a, b, start: int, tokenizer, where: str, loss_on: str
) -> SFTExample | None:
    """A text row or a whole conversation with the mask of ``loss_on`` (None: nothing to train)."""
    if kind == "text":
        if loss_on == "completion_only":
            raise DataError(
                f"{where}: a 'text' row has no completion; data.loss_on: completion_only needs "
                "prompt/completion or messages rows (all_tokens or all_assistant train a text row whole)"
            )
        ids = encode_prompt(a, tokenizer)
        if not ids:
            return None
        ids = ids + encode_response("", tokenizer)  # + EOS: the text ends there
        return SFTExample(ids, 0, where, [False] + [True] * (len(ids) - 1))
    messages, tools = a, b
    check_ends_with_reply(
        messages, where, "the last message of the conversation", "the conversation"
    )
    first = 0 if loss_on == "all_assistant" else start
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    # nothing to train: every chosen turn empty (a turn that calls tools is not)
    if loss_on != "all_tokens" and not any(
        messages[i].get("content") or messages[i].get("tool_calls") for i in turns
    ):
        return None
    ids, mask = conversation_tokens(
        messages, tokenizer, where, turns=None if loss_on == "all_tokens" else turns, tools=tools
    )
    return SFTExample(ids, 0, where, mask)


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch.

    Returns:
        input_ids: (B, L) long, padded with ``pad_token_id``.
        attention_mask: (B, L) long, 1 = real token.
        response_mask: (B, L) bool, True = a response token or its EOS (the positions with a loss).
    """
    if all(e.target_mask is None for e in examples):
        return right_padded_with_spans(
            [e.input_ids for e in examples], [e.prompt_len for e in examples], pad_token_id
        )
    batch = right_padded_with_spans(
        [e.input_ids for e in examples], [0] * len(examples), pad_token_id
    )
    mask = torch.zeros_like(batch["response_mask"])
    for i, e in enumerate(examples):
        mask[i, : len(e.input_ids)] = torch.tensor(e.mask(), dtype=torch.bool)
    batch["response_mask"] = mask
    return batch
