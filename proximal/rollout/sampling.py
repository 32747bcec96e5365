"""Sampling responses from the policy: the token-level MDP of seed §1.

The state s_t is the prompt plus the response prefix; the action is the next token; the episode ends
at EOS (or a configured stop token / stop string) or after T = ``max_new_tokens`` tokens. Everything
after the stop is masked out: ``response_mask`` is True exactly on the tokens the policy chose up to
and including the stop, so no loss ever sees what follows.

Notation: B = batch, P = padded prompt length, T = padded response length (≤ max_new_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from proximal.models.heads import position_ids_from_mask
from proximal.models.loading import unwrap


@dataclass
class Rollout:
    """A batch of sampled responses.

    prompt_ids / prompt_mask: (B, P), left-padded. response_ids: (B, T), pad after the stop.
    response_mask: (B, T) bool, True = a real response token (the stop token included).
    ended: (B,) bool, True where the response stopped (EOS, stop token or stop string) before T.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ended: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask.bool(), self.response_mask], dim=1).long()

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Rollout":
        return Rollout(*(getattr(self, f)[idx] for f in ("prompt_ids", "prompt_mask", "response_ids",
                                                          "response_mask", "ended")))


def pad_left(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu"):
    """Left-padded prompt ids and attention mask, shape (B, P), from token id lists."""
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, P - len(r):] = 1
    return ids.to(device), mask.to(device)


def stop_mask(response_ids: torch.Tensor, stop_token_ids: list[int], generated_len: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask everything after the first stop token of each row. Returns (response_mask, ended), (B, T) and (B,).

    ``generated_len`` (B,) optionally caps each row's valid length (used for stop strings).
    """
    B, T = response_ids.shape
    is_stop = torch.zeros_like(response_ids, dtype=torch.bool)
    for s in stop_token_ids:
        is_stop |= response_ids == s
    idx = torch.arange(T, device=response_ids.device).expand(B, T)
    first_stop = torch.where(is_stop, idx, T).min(dim=1).values          # T where none
    length = torch.where(first_stop < T, first_stop + 1, T)
    ended = first_stop < T
    if generated_len is not None:
        ended = ended | (generated_len < length)
        length = torch.minimum(length, generated_len)
    return idx < length.unsqueeze(1), ended


def _stop_string_lengths(tokenizer, response_ids: torch.Tensor, mask: torch.Tensor,
                         stop_strings: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row, the number of tokens up to and including the first stop string (or its current
    length), and whether a stop string was found. Shapes (B,), (B,) bool."""
    lengths = mask.sum(1).clone()
    found = torch.zeros(len(lengths), dtype=torch.bool, device=lengths.device)
    for b in range(response_ids.shape[0]):
        ids = response_ids[b, : int(lengths[b])].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if not any(s in text for s in stop_strings):
            continue
        # The shortest prefix whose text contains a stop string.
        for n in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:n], skip_special_tokens=False)
            if any(s in prefix for s in stop_strings):
                lengths[b] = n
                found[b] = True
                break
    return lengths, found


def pad_right(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu"):
    """Right-padded ids and attention mask, shape (B, L), from token id lists (full sequences for scoring)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample(policy, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop_token_ids: list[int] | None = None,
           stop_strings: list[str] | None = None) -> Rollout:
    """Sample one response per prompt with Hugging Face ``generate`` (KV-cached) and mask after the stop."""
    eos = [tokenizer.eos_token_id] + list(stop_token_ids or [])
    # generate() fills every argument not passed from the checkpoint's generation_config.json
    # (repetition_penalty, suppress_tokens, ...), which would sample from a distribution other than
    # softmax(logits / T) — the one whose log-probabilities PPO uses. Sample under a neutral config.
    model = unwrap(policy)
    saved = getattr(model, "generation_config", None)
    if saved is not None:
        model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                                                   bos_token_id=tokenizer.bos_token_id)
    try:
        out = policy.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=temperature,
            top_p=top_p, top_k=top_k if top_k > 0 else 0, max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, min_new_tokens=0,
        )
    finally:
        if saved is not None:
            model.generation_config = saved
    response_ids = out[:, prompt_ids.shape[1]:]
    if response_ids.shape[1] == 0:  # every row stopped at once cannot happen (≥ 1 token), but be safe
        response_ids = torch.full((len(prompt_ids), 1), tokenizer.pad_token_id, device=prompt_ids.device)
    mask, ended = stop_mask(response_ids, eos)
    if stop_strings:
        lengths, found = _stop_string_lengths(tokenizer, response_ids, mask, stop_strings)
        mask, ended = stop_mask(response_ids, eos, generated_len=lengths)
        ended = ended | found  # a stop string completed in the last slot still ended the response
    response_ids = torch.where(mask, response_ids, tokenizer.pad_token_id)
    return Rollout(prompt_ids, prompt_mask, response_ids, mask, ended)


def response_logits(model, rollout_or_ids, attention_mask: torch.Tensor | None = None,
                    prompt_len: int | None = None) -> torch.Tensor:
    """Logits predicting each response token: positions P-1 … P+T-2 of the full sequence. Shape (B, T, V)."""
    if attention_mask is None:
        r = rollout_or_ids
        input_ids, attention_mask, prompt_len = r.input_ids, r.attention_mask, r.prompt_ids.shape[1]
    else:
        input_ids = rollout_or_ids
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), use_cache=False).logits  # no KV cache to keep
    return logits[:, prompt_len - 1: -1]
