"""Prompt/response pairs for supervised fine-tuning: loading, the response mask, and batching.

One example is ``prompt ids + response ids + EOS`` with a bool ``response_mask`` that is True on
exactly the response ids and the EOS — the tokens the loss is computed on (see
:func:`proximal.trainers.sft.response_nll`). Record formats are described in :mod:`proximal.data.chat`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.data.chat import encode_prompt, encode_response, render_pair
from proximal.data.jsonl import DataError, read_jsonl

ON_TOO_LONG = ("error", "skip")


@dataclass
class SFTExample:
    input_ids: list[int]      # prompt ids + response ids + EOS
    prompt_len: int           # number of prompt ids at the front
    where: str                # "file:line", for messages about this row


@dataclass
class LoadReport:
    """What happened to the rows of one file."""
    path: str
    rows: int = 0             # rows read
    skipped: int = 0          # rows dropped for being longer than max_length (on_too_long = "skip")


def too_long_error(where: str, what: str, n: int, prompt_len: int, max_length: int) -> DataError:
    return DataError(f"{where}: {what} is {n} tokens (prompt {prompt_len} + response and EOS "
                     f"{n - prompt_len}), longer than data.max_length = {max_length}; raise "
                     "data.max_length or set data.on_too_long: skip to drop such rows")


def load_sft_examples(path: str | Path, tokenizer, *, max_length: int,
                      on_too_long: str = "error") -> tuple[list[SFTExample], LoadReport]:
    """Read and tokenise a JSONL file of prompt/response records.

    Raises DataError naming ``file:line`` for a malformed row, a row longer than ``max_length`` (when
    ``on_too_long == "error"``), an empty file, or a file where every row was skipped.
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long = {on_too_long!r} is not one of {', '.join(ON_TOO_LONG)}")
    report = LoadReport(str(path))
    examples = []
    for lineno, record in read_jsonl(path):
        where = f"{path}:{lineno}"
        report.rows += 1
        prompt, response = render_pair(record, tokenizer, where)
        prompt_ids = encode_prompt(prompt, tokenizer)
        if not prompt_ids:
            # The first response token is predicted from the last prompt token; with no prompt token
            # (and no BOS) there is nothing to predict it from.
            raise DataError(f"{where}: the prompt is empty after tokenisation (and the tokenizer adds no "
                            "BOS), so the first response token cannot be trained")
        ids = prompt_ids + encode_response(response, tokenizer)
        if len(ids) > max_length:
            if on_too_long == "skip":
                report.skipped += 1
                continue
            raise too_long_error(where, "prompt + response", len(ids), len(prompt_ids), max_length)
        examples.append(SFTExample(ids, len(prompt_ids), where))
    if report.rows == 0:
        raise DataError(f"{path}: the file has no records (it is empty or blank)")
    if not examples:
        raise DataError(f"{path}: all {report.rows} rows are longer than data.max_length = {max_length} "
                        "and were skipped; raise data.max_length")
    return examples, report


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch.

    Returns:
        input_ids: (B, L) long, padded with ``pad_token_id``.
        attention_mask: (B, L) long, 1 = real token.
        response_mask: (B, L) bool, True = a response token or its EOS (the positions with a loss).
    """
    L = max(len(e.input_ids) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        attention_mask[i, :n] = 1
        response_mask[i, e.prompt_len:n] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
