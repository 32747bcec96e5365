"""Preference pairs ``(x, y_w, y_l)`` for Bradley–Terry reward-model training (Christiano et al. 2017;
Ouyang et al. 2022).

Accepted JSONL records (see docs/rm.md for examples):

* ``{"prompt": str, "chosen": str, "rejected": str}`` — plain text, the prompt used verbatim;
* ``{"chosen": str, "rejected": str}`` — an *implicit* prompt: both sides are whole texts that start
  with the same prompt (:func:`implicit_prompt` cuts it off at a word boundary);
* ``{"messages": [...], "chosen": str, "rejected": str}`` — the messages are the conversation so
  far, rendered with the chat template and the generation prompt;
* ``{"chosen": [...messages], "rejected": [...messages]}`` — two whole conversations that share all
  turns but the last assistant one (the shared turns are the prompt: the implicit prompt of message
  lists); a ``prompt``/``messages`` list may hold the first turns — with ``prompt`` as messages and
  ``chosen``/``rejected`` as one assistant message each, this is TRL's conversational preference row.

An optional ``tools`` list is handed to the chat template with the messages.

An optional numeric ``margin`` (how much better ``chosen`` is, Llama 2 style) is passed to the loss.

Each side is tokenised as ``prompt ids + response ids + EOS`` — the layout a PPO rollout has when it
is scored (see :mod:`proximal.data.chat`).

A side longer than ``max_length`` is an error, or the pair is skipped, or (``on_too_long="truncate"``,
for DPO and SimPO, which score responses by their log-likelihood, token by token) each side keeps its
first ``max_length`` tokens: the whole prompt and the start of the response. Truncation never drops a
whole response: a prompt that leaves no room for one is an error naming the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.data.chat import (
    apply_template,
    check_messages,
    check_reply_text,
    check_tools,
    encode_prompt,
    encode_response,
    prompt_context,
)
from proximal.data.collate import right_padded_with_spans
from proximal.data.jsonl import DataError
from proximal.data.sft import ON_EMPTY, ON_TOO_LONG, LoadReport, empty_error, too_long_error
from proximal.data.sources import no_records, read_rows

#: ``on_too_long`` for preference pairs: the SFT choices, and truncating both sides to max_length.
ON_TOO_LONG_PAIRS = ON_TOO_LONG + ("truncate",)


@dataclass
class PreferencePair:
    chosen_ids: list[int]  # prompt ids + chosen response ids + EOS
    rejected_ids: list[int]  # prompt ids + rejected response ids + EOS
    margin: float | None  # the row's 'margin', if it has one
    where: str  # "file:line"
    prompt_len: int = 0  # prompt ids at the front of both sides


def implicit_prompt(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """``(prompt, chosen_response, rejected_response)`` of two texts that start with the same prompt.

    The prompt is their longest common prefix, cut back to a word boundary: to the start of the last
    run of whitespace in that prefix, so the whitespace opens both responses (as in TRL's
    ``extract_prompt``, which moves one space to the response) and no word is split between prompt
    and response (``"Q: 2+2? A: 4"`` / ``"Q: 2+2? A: 5"`` → ``"Q: 2+2? A:"``, ``" 4"``, ``" 5"``;
    ``"It is four"`` / ``"It is fine"`` → ``"It is"``, ``" four"``, ``" fine"``, where the first
    difference alone would give ``"It is f"``). A common prefix with no whitespace is cut where the
    texts first differ. DataError when no non-blank prompt is left.
    """
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    cut = n
    spaces = [i for i in range(n) if chosen[i].isspace()]
    if spaces:
        cut = spaces[-1]
        while cut > 0 and chosen[cut - 1].isspace():
            cut -= 1
    prompt = chosen[:cut]
    if not prompt.strip():
        raise DataError(
            f"{where}: missing field 'prompt' (or 'messages'), and 'chosen' and 'rejected' share no "
            f"implicit prompt (their common start {chosen[:n]!r:.60} holds no word before a word "
            "boundary); give the prompt as 'prompt'"
        )
    return prompt, chosen[cut:], rejected[cut:]


def render_preference(record: dict, tokenizer, where: str) -> tuple[str, str, str]:
    """``(prompt_text, chosen_text, rejected_text)`` of one preference record."""
    sides = {}
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(
                f"{where}: missing field {key!r} (fields present: {', '.join(sorted(record)) or 'none'})"
            )
        value = record[key]
        if not isinstance(value, (str, list)):
            raise DataError(
                f"{where}: field {key!r} must be a string or a list of messages, got "
                f"{type(value).__name__} {value!r:.60}"
            )
        sides[key] = value
    chosen, rejected = sides["chosen"], sides["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError(
            f"{where}: 'chosen' and 'rejected' must both be strings or both be message lists"
        )

    has_context = "prompt" in record or "messages" in record
    if not has_context and isinstance(chosen, str):
        return implicit_prompt(chosen, rejected, where)
    context = prompt_context(record, where) if has_context else []
    if isinstance(chosen, list):
        for key, turns in sides.items():
            sides[key] = turns = check_messages(turns, where, key)
            if turns[-1]["role"] != "assistant":
                raise DataError(
                    f"{where}: the last message of {key!r} must be the assistant's response, "
                    f"got role {turns[-1]['role']!r}"
                )
            check_reply_text(turns[-1], where, f"the last message of {key!r}")
        chosen, rejected = sides["chosen"], sides["rejected"]
        if chosen[:-1] != rejected[:-1]:
            raise DataError(
                f"{where}: 'chosen' and 'rejected' must share every turn but the last "
                "(the shared turns are the prompt)"
            )
        if chosen[:-1]:
            if isinstance(context, str):
                raise DataError(
                    f"{where}: a string 'prompt' cannot be followed by shared message turns "
                    "in 'chosen'/'rejected'; give the prompt as messages"
                )
            context = context + chosen[:-1]
        chosen, rejected = chosen[-1]["content"], rejected[-1]["content"]
    if isinstance(context, list):
        if not context:
            raise DataError(
                f"{where}: missing field 'prompt' (or 'messages') "
                f"(fields present: {', '.join(sorted(record))})"
            )
        context = apply_template(
            context, tokenizer, where, tools=check_tools(record, where), check_calls=True
        )
    return context, chosen, rejected


def same_response_error(where: str, detail: str = "") -> DataError:
    return DataError(
        f"{where}: 'chosen' and 'rejected' are the same response{detail}, so the pair teaches nothing; "
        "fix the row or set data.on_empty: skip to drop such rows"
    )


def _margin(record: dict, where: str) -> float | None:
    if "margin" not in record or record["margin"] is None:
        return None
    m = record["margin"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
        raise DataError(
            f"{where}: field 'margin' must be a finite number, got {type(m).__name__} {m!r:.60}"
        )
    return float(m)


def load_preference_pairs(
    path: str | Path,
    tokenizer,
    *,
    max_length: int,
    on_too_long: str = "error",
    on_empty: str = "error",
    split: str | None = None,
    columns: dict[str, str] | None = None,
) -> tuple[list[PreferencePair], LoadReport]:
    """Read and tokenise a JSONL file of preference pairs.

    Raises DataError naming ``file:line`` for a malformed row, a side longer than ``max_length`` (when
    ``on_too_long == "error"``), a prompt that leaves no room for a response (when it is
    ``"truncate"``), an empty ``chosen`` or ``rejected`` or a pair whose two sides are the same response
    — before truncation or after it (when ``on_empty == "error"``: nothing to learn from either), an
    empty file, a file where every row was skipped, or a file where only some rows have a margin (the
    loss would mean different things for different rows). ``report.truncated`` counts truncated pairs.
    """
    if on_too_long not in ON_TOO_LONG_PAIRS or on_empty not in ON_EMPTY:
        raise ValueError(
            f"on_too_long = {on_too_long!r}, on_empty = {on_empty!r}: expected one of "
            f"{ON_TOO_LONG_PAIRS} and one of {ON_EMPTY}"
        )
    report = LoadReport(str(path))
    pairs: list[PreferencePair] = []
    first_margin: tuple[str, bool] | None = None  # (where, has margin) of the first row
    for where, record in read_rows(path, split=split, columns=columns):
        report.rows += 1
        prompt, chosen, rejected = render_preference(record, tokenizer, where)
        margin = _margin(record, where)
        if first_margin is None:
            first_margin = (where, margin is not None)
        elif first_margin[1] != (margin is not None):
            raise DataError(
                f"{where}: this row {'has' if margin is not None else 'has no'} 'margin' but "
                f"{first_margin[0]} {'has' if first_margin[1] else 'has none'}; give a margin on "
                "every row or on none"
            )
        prompt_ids = encode_prompt(prompt, tokenizer)
        if not prompt_ids:
            raise DataError(
                f"{where}: the prompt is empty after tokenisation (and the tokenizer adds no BOS), so "
                "the first response token has nothing to be predicted from"
            )
        responses = {
            name: encode_response(text, tokenizer)
            for name, text in (("chosen", chosen), ("rejected", rejected))
        }
        empty = next((f"'{name}'" for name, ids in responses.items() if len(ids) <= 1), None)
        if empty is not None or responses["chosen"] == responses["rejected"]:
            if on_empty == "skip":
                report.skipped_empty += 1
                continue
            raise empty_error(where, empty) if empty else same_response_error(where)
        if on_too_long == "truncate" and len(prompt_ids) >= max_length:
            raise DataError(
                f"{where}: the prompt is {len(prompt_ids)} tokens, which leaves no room for a response "
                f"within data.max_length = {max_length}; raise data.max_length, shorten the prompt, or "
                "set data.on_too_long: skip to drop such rows"
            )
        sides = []
        for name, ids in responses.items():
            full = prompt_ids + ids
            if len(full) > max_length:
                if on_too_long == "skip":
                    break
                if on_too_long == "error":
                    raise too_long_error(
                        where, f"prompt + {name}", len(full), len(prompt_ids), max_length
                    )
                full = full[:max_length]  # the whole prompt and the response's first tokens
            sides.append(full)
        if len(sides) < 2:
            report.skipped += 1
            continue
        if sides[0] == sides[1]:  # the responses differed only after max_length
            if on_empty == "skip":
                report.skipped_empty += 1
                continue
            raise same_response_error(where, f" once cut to data.max_length = {max_length}")
        if any(
            len(side) < len(prompt_ids) + len(ids) for side, ids in zip(sides, responses.values())
        ):
            report.truncated += 1
        pairs.append(PreferencePair(sides[0], sides[1], margin, where, len(prompt_ids)))
    if report.rows == 0:
        raise DataError(no_records(path))
    if not pairs:
        raise report.none_left(max_length)
    return pairs, report


def collate_pairs(pairs: list[PreferencePair], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch holding the chosen sides (rows 0..B-1) then the rejected ones (B..2B-1).

    Chosen and rejected go through the model in one forward pass, so both see the same weights and
    the same dropout mode.

    Returns:
        input_ids: (2B, L) long, padded with ``pad_token_id`` on the right.
        attention_mask: (2B, L) long, 1 = real token.
        response_mask: (2B, L) bool, True on each side's response tokens and its EOS.
        margin: (B,) float, only when the pairs have margins.
    """
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    starts = [p.prompt_len for p in pairs] * 2
    batch = right_padded_with_spans(seqs, starts, pad_token_id)
    if pairs[0].margin is not None:
        batch["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return batch
