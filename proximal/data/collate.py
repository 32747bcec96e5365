"""The one padder: token-id lists to padded id and attention-mask tensors.

Prompts for generation are padded on the **left** (every row's next token goes in the same column);
whole sequences for scoring and training on the **right** (every row starts in column 0). Masks
say which positions are real; nothing ever reads the pad id itself.
"""

from __future__ import annotations

import torch


def pad_left(
    rows: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (long), shape (B, L) with L = ``length`` or the longest row."""
    L = max([len(r) for r in rows] + [length or 0])
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, L - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, L - len(r) :] = 1
    return ids.to(device), mask.to(device)


def pad_right(
    rows: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask (long), shape (B, L) with L = ``length`` or the longest row."""
    L = max([len(r) for r in rows] + [length or 0])
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def right_padded_with_spans(
    rows: list[list[int]], starts: list[int], pad_id: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Right-padded sequences with a bool mask over each row's tokens from ``starts[i]`` to its end.

    Used for prompt + response rows (SFT, preference pairs): ``starts[i]`` is the prompt length, so
    ``response_mask`` is True on exactly the response tokens and their EOS.

    Returns ``input_ids`` (B, L), ``attention_mask`` (B, L) long and ``response_mask`` (B, L) bool.
    """
    ids, att = pad_right(rows, pad_id, device)
    cols = torch.arange(ids.shape[1], device=ids.device)
    start = torch.tensor(starts, device=ids.device)[:, None]
    response_mask = (cols[None, :] >= start) & att.bool()
    return {"input_ids": ids, "attention_mask": att, "response_mask": response_mask}
