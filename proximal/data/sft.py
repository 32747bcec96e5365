"""Prompt/response pairs for supervised fine-tuning: loading, the response mask, and batching.

One example is ``prompt ids + response ids + EOS`` with a bool ``response_mask`` that is True on
exactly the response ids and the EOS — the tokens the loss is computed on
(:func:`proximal.core.sft_loss`). Record formats are described in :mod:`proximal.data.chat`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.data.chat import encode_prompt, encode_response, render_pair
from proximal.data.collate import right_padded_with_spans
from proximal.data.jsonl import DataError
from proximal.data.sources import read_rows

#: ``data.on_too_long`` and ``data.on_empty``: stop with the row's file:line, or drop and count it.
ON_TOO_LONG = ("error", "skip")
ON_EMPTY = ("error", "skip")


@dataclass
class SFTExample:
    input_ids: list[int]  # prompt ids + response ids + EOS
    prompt_len: int  # number of prompt ids at the front
    where: str  # "file:line", for messages about this row

    @property
    def n_targets(self) -> int:
        """Tokens the loss is computed on: the response ids and the EOS."""
        return len(self.input_ids) - self.prompt_len


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
) -> tuple[list[SFTExample], LoadReport]:
    """Read and tokenise a JSONL file of prompt/response records.

    Raises DataError naming ``file:line`` for a malformed row, a row longer than ``max_length`` (when
    ``on_too_long == "error"``), an empty response (when ``on_empty == "error"``), an empty file, or
    a file where every row was skipped.
    """
    if on_too_long not in ON_TOO_LONG or on_empty not in ON_EMPTY:
        raise ValueError(
            f"on_too_long = {on_too_long!r}, on_empty = {on_empty!r}: expected 'error' or 'skip'"
        )
    report = LoadReport(str(path))
    examples = []
    for where, record in read_rows(path, split=split, columns=columns):
        report.rows += 1
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
            if on_empty == "skip":
                report.skipped_empty += 1
                continue
            raise empty_error(where, "the response")
        ids = prompt_ids + response_ids
        if len(ids) > max_length:
            if on_too_long == "skip":
                report.skipped += 1
                continue
            raise too_long_error(where, "prompt + response", len(ids), len(prompt_ids), max_length)
        examples.append(SFTExample(ids, len(prompt_ids), where))
    if report.rows == 0:
        raise DataError(f"{path}: the file has no records (it is empty or blank)")
    if not examples:
        raise report.none_left(max_length)
    return examples, report


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch.

    Returns:
        input_ids: (B, L) long, padded with ``pad_token_id``.
        attention_mask: (B, L) long, 1 = real token.
        response_mask: (B, L) bool, True = a response token or its EOS (the positions with a loss).
    """
    return right_padded_with_spans(
        [e.input_ids for e in examples], [e.prompt_len for e in examples], pad_token_id
    )
