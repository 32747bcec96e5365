"""Prompt sets for PPO and pretraining text for the PTX loss.

Prompts come from JSONL (``{"prompt": str}`` or ``{"messages": [...]}``, the latter rendered with the
tokenizer's chat template) or from a ``datasets`` dataset saved with ``save_to_disk`` (same columns).
Prompts longer than the limit are truncated on the left (keeping the end, where the question usually
is) or skipped and counted, as configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proximal.data.chat import encode_prompt, render_prompt
from proximal.data.jsonl import DataError, read_jsonl, require_str


@dataclass
class PromptSet:
    """Rendered prompts with their token ids (unpadded) and, where given, their message lists."""

    texts: list[str]
    token_ids: list[list[int]]
    messages: list[list | None]
    skipped_too_long: int = 0
    truncated: int = 0
    skipped_empty: int = 0

    def __len__(self) -> int:
        return len(self.texts)


def _records(path: str):
    p = Path(path)
    if p.is_dir():
        try:
            # lazy: the optional `datasets` extra, only for a hub or Arrow prompt set
            import datasets
        except ImportError as e:
            raise DataError(
                f"{p}: a dataset directory needs the `datasets` package "
                "(pip install 'proximal-rlhf[datasets]')"
            ) from e
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(
                    f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})"
                )
            ds = ds["train"]
        for i, row in enumerate(ds):
            yield f"{p}[row {i}]", dict(row)
    else:
        for lineno, record in read_jsonl(p):
            yield f"{p}:{lineno}", record


def load_prompts(
    path: str,
    tokenizer,
    *,
    max_length: int,
    on_too_long: str = "truncate_left",
    on_empty: str = "error",
) -> PromptSet:
    """Read, render and tokenize every prompt. Raises DataError for bad rows or an empty set.

    A prompt that tokenizes to nothing (an empty string, or text the tokenizer drops) would have the
    model "answer" pure padding: an error naming its file:line, or with ``on_empty='skip'`` dropped
    and counted.
    """
    texts, ids, messages = [], [], []
    skipped = truncated = empty = 0
    for where, record in _records(path):
        text = render_prompt(record, tokenizer, where)
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
        messages.append(record.get("messages"))
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
        texts, ids, messages, skipped_too_long=skipped, truncated=truncated, skipped_empty=empty
    )


def load_texts(path: str, *, key: str = "text") -> list[str]:
    """Pretraining texts for the PTX loss: JSONL with a ``text`` field, or a plain text file (one per line)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        texts = [require_str(r, key, f"{p}:{n}") for n, r in read_jsonl(p)]
    else:
        if not p.is_file():
            raise DataError(f"{p}: file not found")
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
