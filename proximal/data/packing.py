"""Packing: several encoded sequences in one row, and micro-batches cut by a token budget.

A padded batch holds one sequence per row, every row as long as the longest; on a length-skewed set
most of its positions are padding. A packed row holds sequences one after another, with position ids
restarting at 0 for each: ``transformers`` (≥ 5.1, sdpa/eager/flex attention — see docs/data.md,
"Packing") reads the restarts from ``position_ids`` when no attention mask is given and keeps each
token's attention inside its own sequence (``masking_utils.find_packed_sequence_indices``). A
sequence is never split across rows.

Notation: N sequences, R packed rows, L the row length, B items (rows of the data set: an SFT example
is one sequence, a preference pair two).

Everything here is a pure function of token-id lists and masks; the model call is
:mod:`proximal.models.heads`, the per-sequence sums :func:`per_sequence`.
"""

from __future__ import annotations

import torch


def pack_rows(lengths: list[int], row_length: int | None = None) -> list[list[int]]:
    """Which sequences share a row: first fit, in the given order, each row's lengths summing to at
    most ``row_length`` (None: all in one row). A list of rows, each the indices of its sequences in
    order. ValueError for a sequence longer than ``row_length`` (it is never split)."""
    if row_length is None:
        return [list(range(len(lengths)))] if lengths else []
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > row_length:
            raise ValueError(f"sequence {i} has {n} tokens, more than the row length {row_length}")
        r = next((j for j, left in enumerate(room) if left >= n), None)
        if r is None:
            rows.append([])
            room.append(row_length)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    return rows


def collate_packed(
    seqs: list[list[int]],
    masks: list[list[bool]],
    pad_id: int,
    row_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Sequences packed into rows (:func:`pack_rows`), padded on the right to the longest row.

    ``masks[i]`` is True on the tokens of ``seqs[i]`` with a loss (the response mask of the padded
    layout). The first token of every sequence is made False: nothing in its own sequence predicts it,
    and in a packed row the position before it is the previous sequence's last token (the padded
    layout drops it the same way, by shifting).

    Returns:
        input_ids: (R, L) long, ``pad_id`` after each row's last sequence.
        position_ids: (R, L) long, 0, 1, … within each sequence; the padding tail counts from 0 too,
            so it is a sequence of its own that nothing real attends to.
        response_mask: (R, L) bool, as described.
        segment_ids: (R, L) long, the sequence's index i at its tokens, −1 on padding.
        last: (N,) long, the flat index ``r · L + column`` of each sequence's last token.
    """
    if len(seqs) != len(masks) or any(len(s) != len(m) for s, m in zip(seqs, masks)):
        raise ValueError("collate_packed: every sequence needs a mask of its length")
    rows = pack_rows([len(s) for s in seqs], row_length)
    L = max(sum(len(seqs[i]) for i in row) for row in rows)
    R = len(rows)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    mask = torch.zeros((R, L), dtype=torch.bool)
    seg = torch.full((R, L), -1, dtype=torch.long)
    last = torch.zeros(len(seqs), dtype=torch.long)
    for r, row in enumerate(rows):
        c = 0
        for i in row:
            n = len(seqs[i])
            ids[r, c : c + n] = torch.tensor(seqs[i], dtype=torch.long)
            pos[r, c : c + n] = torch.arange(n)
            mask[r, c + 1 : c + n] = torch.tensor(masks[i][1:], dtype=torch.bool)
            seg[r, c : c + n] = i
            last[i] = r * L + c + n - 1
            c += n
        pos[r, c:] = torch.arange(L - c)
    return {
        "input_ids": ids,
        "position_ids": pos,
        "response_mask": mask,
        "segment_ids": seg,
        "last": last,
    }


def per_sequence(values: torch.Tensor, segment_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Σ of ``values`` over each sequence's positions: (n,) from (R, T) values and (R, T) segment ids
    (−1 = none). Zero the positions that must not count in ``values`` first (a log-probability off
    the response mask). Differentiable in ``values``."""
    keep = segment_ids >= 0
    out = values.new_zeros(n)
    return out.index_add(0, segment_ids[keep], values[keep])


def plan_micro_batches(lengths: list[list[int]], budget: int, *, packed: bool) -> list[list[int]]:
    """Micro-batches of items by a token budget instead of a row count.

    ``lengths[b]`` are the sequence lengths of item b (one for an SFT example, chosen and rejected for
    a pair). The cost of a micro-batch is the tokens its forward pass holds: packed, the sum of all
    its sequences' lengths; padded, its number of sequences × the longest. Items are taken longest
    first (padded, similar lengths then share a batch; the loss is a sum over items, so order does
    not change it) and a micro-batch is closed when the next item would exceed ``budget``; an item
    costing more than ``budget`` alone forms a micro-batch of its own. Returns lists of indices into
    ``lengths``, every item in exactly one.
    """
    if budget < 1:
        raise ValueError(f"budget = {budget} must be ≥ 1")
    order = sorted(range(len(lengths)), key=lambda b: -sum(lengths[b]))
    groups: list[list[int]] = []
    group: list[int] = []
    total = longest = count = 0
    for b in order:
        t, m, k = total + sum(lengths[b]), max(longest, *lengths[b]), count + len(lengths[b])
        if group and (t if packed else k * m) > budget:
            groups.append(group)
            group, t, m, k = [], sum(lengths[b]), max(lengths[b]), len(lengths[b])
        group.append(b)
        total, longest, count = t, m, k
    if group:
        groups.append(group)
    return groups


def split_to(groups: list[list[int]], n: int) -> list[list[int]]:
    """``groups`` cut into exactly ``n`` micro-batches by halving the largest one until there are
    ``n`` (every process of a sharded model must run the same number of forward passes, and token
    budgets give the processes different counts). ValueError when ``n`` exceeds the items."""
    out = [list(g) for g in groups]
    if n > sum(len(g) for g in out) or n < len(out):
        raise ValueError(f"cannot cut {len(out)} micro-batches into {n}")
    while len(out) < n:
        big = max(range(len(out)), key=lambda j: len(out[j]))
        g = out.pop(big)
        out[big:big] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return out


def collate_packed_sft(examples: list, pad_id: int) -> dict[str, torch.Tensor]:
    """SFT examples (:class:`proximal.data.sft.SFTExample`) packed into one row: the keys of
    :func:`collate_packed`, ``response_mask`` the padded layout's (the examples' ``mask()``)."""
    return collate_packed([e.input_ids for e in examples], [e.mask() for e in examples], pad_id)


def collate_packed_pairs(pairs: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs (:class:`proximal.data.preferences.PreferencePair`) packed into one row,
    the chosen sides as sequences 0 … B−1 and the rejected ones as B … 2B−1 (the order of
    :func:`proximal.data.preferences.collate_pairs`), each with its response mask (True after the
    prompt). The keys of :func:`collate_packed`, and ``margin`` (B,) float when the pairs have one."""
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    starts = [p.prompt_len for p in pairs] * 2
    masks = [[False] * s + [True] * (len(q) - s) for q, s in zip(seqs, starts)]
    batch = collate_packed(seqs, masks, pad_id)
    if pairs[0].margin is not None:
        batch["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return batch
