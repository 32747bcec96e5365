"""Prompt sets for PPO and pretraining text for the PTX loss.

Prompts come from JSONL (``{"prompt": str}`` or ``{"messages": [...]}``, the latter rendered with the
tokenizer's chat template) or from a ``datasets`` dataset saved with ``save_to_disk`` (same columns).
Prompts longer than the limit are truncated on the left (keeping the end, where the question usually
is) or skipped and counted, as configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

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

    def __len__(self) -> int:
        return len(self.texts)


def _records(path: str):
    p = Path(path)
    if p.is_dir():
        try:
            import datasets
        except ImportError as e:
            raise DataError(f"{p}: a dataset directory needs the `datasets` package "
                            "(pip install 'proximal-rlhf[datasets]')") from e
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
            ds = ds["train"]
        for i, row in enumerate(ds):
            yield f"{p}[row {i}]", dict(row)
    else:
        for lineno, record in read_jsonl(p):
            yield f"{p}:{lineno}", record


def load_prompts(path: str, tokenizer, *, max_length: int, on_too_long: str = "truncate_left") -> PromptSet:
    """Read, render and tokenize every prompt. Raises DataError for bad rows or an empty set."""
    texts, ids, messages = [], [], []
    skipped = truncated = 0
    for where, record in _records(path):
        text = render_prompt(record, tokenizer, where)
        tok = encode_prompt(text, tokenizer)
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
        extra = f" ({skipped} prompts were longer than data.max_prompt_length={max_length} and skipped)" if skipped else ""
        raise DataError(f"{path}: no prompts{extra}")
    return PromptSet(texts, ids, messages, skipped_too_long=skipped, truncated=truncated)


def load_texts(path: str, *, key: str = "text") -> list[str]:
    """Pretraining texts for the PTX loss: JSONL with a ``text`` field, or a plain text file (one per line)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        texts = [require_str(r, key, f"{p}:{n}") for n, r in read_jsonl(p)]
    else:
        if not p.is_file():
            raise DataError(f"{p}: file not found")
        texts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise DataError(f"{p}: no pretraining texts")
    return texts


@dataclass
class PromptSampler:
    """Shuffled passes over ``n`` items in batches; its state (epoch, position) resumes exactly.

    Each epoch's order is a permutation drawn from a generator seeded with ``seed + epoch``, so the
    order depends on nothing but the seed and the position.
    """

    n: int
    batch_size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _perm(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            if not self._order:
                self._order = self._perm()
            if self.position >= self.n:
                self.epoch += 1
                self.position = 0
                self._order = self._perm()
            take = min(self.batch_size - len(out), self.n - self.position)
            out.extend(self._order[self.position: self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._perm()
