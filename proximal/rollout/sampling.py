"""Sampling responses from the policy: the token-level MDP of Ziegler et al. (2019) and Ouyang et al.
(2022), written out in docs/formulas.md ("The MDP of autoregressive generation").

The state s_t is the prompt plus the response prefix; the action is the next token; the episode ends
at EOS (or a configured stop token / stop string) or after T = ``max_new_tokens`` tokens. Everything
after the stop is masked out: ``response_mask`` is True exactly on the tokens the policy chose up to
and including the stop, so no loss ever sees what follows. Generation itself goes through the
rollout engine (:mod:`proximal.rollout.engine`).

Notation: B = batch, P = padded prompt length, T = padded response length (≤ max_new_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from proximal.models.heads import lm_logits
from proximal.models.output import TokenScores, models_token_kl, token_logprobs
from proximal.rollout.engine import HFEngine, RolloutEngine, SamplingParams


@dataclass
class Rollout:
    """A batch of sampled responses.

    prompt_ids / prompt_mask: (B, P), left-padded. response_ids: (B, T), pad after the stop.
    response_mask: (B, T) bool, True = a real response token (the stop token included).
    ended: (B,) bool, True where the response stopped (EOS, stop token or stop string) before T.
    behaviour_logprobs: (B, T) float32 log μ(y_t | s_t), each token's log-probability under the distribution
    the engine sampled it from (tempered, before top-k/top-p: :meth:`RolloutEngine.generate`), 0
    after the stop; None unless asked for (:func:`sample`'s ``logprobs``).
    context_mask: (B, T) bool or None. A multi-turn rollout (:mod:`proximal.agents.trajectory`) has
    holes in its response: the observations (tool results, an environment's replies) written
    between the policy's turns. ``response_mask`` is then the *agent* mask — True on the policy's
    own sampled tokens only, what every loss, normaliser and advantage reads — and
    ``context_mask`` marks every real response token, agent and observation: what attention sees,
    for the later agent tokens were sampled reading the observations. None: no holes (the
    response mask is the context mask).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    ended: torch.Tensor
    behaviour_logprobs: torch.Tensor | None = None
    context_mask: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def real_mask(self) -> torch.Tensor:
        """(B, T) bool: every real response token — the context mask, or the response mask when the
        response has no holes."""
        return self.response_mask if self.context_mask is None else self.context_mask

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask.bool(), self.real_mask], dim=1).long()

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: torch.Tensor) -> Rollout:
        """The rows ``idx``, with the columns no selected row uses trimmed (left padding of the prompt,
        right padding of the response: after the last *real* token — with holes, counting the agent
        tokens would cut into the last turn)."""
        r = Rollout(
            *(
                None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                for f in fields(self)
            )
        )
        if len(r) == 0:
            return r
        p0 = int((r.prompt_mask.sum(0) > 0).long().argmax())
        real = r.real_mask
        cols = torch.arange(1, real.shape[1] + 1, device=real.device)
        t1 = max(1, int(torch.where(real, cols, 0).max())) if real.numel() else 1
        return Rollout(
            r.prompt_ids[:, p0:],
            r.prompt_mask[:, p0:],
            r.response_ids[:, :t1],
            r.response_mask[:, :t1],
            r.ended,
            None if r.behaviour_logprobs is None else r.behaviour_logprobs[:, :t1],
            None if r.context_mask is None else r.context_mask[:, :t1],
        )


def stop_mask(
    response_ids: torch.Tensor,
    stop_token_ids: list[int],
    generated_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask everything after the first stop token of each row. Returns (response_mask, ended), (B, T) and (B,).

    ``generated_len`` (B,) optionally caps each row's valid length (used for stop strings).
    """
    B, T = response_ids.shape
    is_stop = torch.zeros_like(response_ids, dtype=torch.bool)
    for s in stop_token_ids:
        is_stop |= response_ids == s
    idx = torch.arange(T, device=response_ids.device).expand(B, T)
    first_stop = torch.where(is_stop, idx, T).min(dim=1).values  # T where none
    length = torch.where(first_stop < T, first_stop + 1, T)
    ended = first_stop < T
    if generated_len is not None:
        ended = ended | (generated_len < length)
        length = torch.minimum(length, generated_len)
    return idx < length.unsqueeze(1), ended


def _stop_string_lengths(
    tokenizer, response_ids: torch.Tensor, mask: torch.Tensor, stop_strings: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
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


def sample(
    engine: RolloutEngine | torch.nn.Module,
    tokenizer,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    seeds: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    stop_strings: list[str] | None = None,
    logprobs: bool = False,
) -> Rollout:
    """One response per prompt from the engine (or, given a model, :class:`HFEngine` over it), masked
    after the stop: EOS, any of ``stop_token_ids``, or the token that completes a stop string.

    ``seeds`` holds one seed per row (:func:`proximal.rollout.engine.row_seed`); a row's tokens depend
    on its seed and prompt only. ``logprobs``: the engine's log μ of each token in
    :attr:`Rollout.behaviour_logprobs` (0 after the stop).
    """
    if isinstance(engine, torch.nn.Module):
        engine = HFEngine(engine, tokenizer.pad_token_id)
    eos = [tokenizer.eos_token_id] + list(stop_token_ids or [])
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(eos),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    mu = None
    if logprobs:
        response_ids, mu = engine.generate(
            prompt_ids, prompt_mask, list(seeds), params, logprobs=True
        )
    else:
        response_ids = engine.generate(prompt_ids, prompt_mask, list(seeds), params)
    mask, ended = stop_mask(response_ids, eos)
    if stop_strings:
        lengths, found = _stop_string_lengths(tokenizer, response_ids, mask, stop_strings)
        mask, ended = stop_mask(response_ids, eos, generated_len=lengths)
        ended = ended | found  # a stop string completed in the last slot still ended the response
    response_ids = torch.where(mask, response_ids, tokenizer.pad_token_id)
    if mu is not None:
        mu = torch.where(mask, mu, 0.0)
    return Rollout(prompt_ids, prompt_mask, response_ids, mask, ended, mu)


def response_logits(
    model, rollout_or_ids, attention_mask: torch.Tensor | None = None, prompt_len: int | None = None
) -> torch.Tensor:
    """Logits predicting each response token: positions P-1 … P+T-2 of the full sequence. Shape (B, T, V).

    Only those positions go through the output layer (:func:`proximal.models.heads.lm_logits`): the
    vocabulary-sized logits of the prompt are never computed."""
    if attention_mask is None:
        r = rollout_or_ids
        input_ids, attention_mask, prompt_len = r.input_ids, r.attention_mask, r.prompt_ids.shape[1]
    else:
        input_ids = rollout_or_ids
    return lm_logits(model, input_ids, attention_mask, prompt_len - 1, input_ids.shape[1] - 1)


def response_logprobs(
    model,
    rollout: Rollout,
    temperature: float = 1.0,
    *,
    mask: torch.Tensor | None = None,
    entropy: str | None = None,
    path: str = "fused",
    filter: tuple[int, float] | None = None,
) -> TokenScores:
    """log π(y_t | s_t) of each response token under ``model`` (and, with ``entropy``, the entropy of
    π(·|s_t)), (B, T), 0 where ``mask`` (default: the response mask) is False: from positions
    P-1 … P+T-2, as :func:`response_logits`, through
    :func:`proximal.models.output.token_logprobs` — the fused path unless ``path`` is "logits" or
    the model needs the logits. ``filter``: (top_k, top_p) replayed (``rollout.replay_filter``):
    the log-probabilities of the truncated distribution, the full ones in ``full_logprobs``."""
    P = rollout.prompt_ids.shape[1]
    input_ids = rollout.input_ids
    return token_logprobs(
        model,
        input_ids,
        rollout.attention_mask,
        P - 1,
        input_ids.shape[1] - 1,
        rollout.response_ids,
        mask=rollout.response_mask if mask is None else mask,
        temperature=temperature,
        entropy=entropy,
        path=path,
        filter=filter,
    )


def response_kl(model, ref_model, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """The exact KL(π(·|s_t) ‖ π_ref(·|s_t)) over the whole vocabulary at each response position,
    (B, T), 0 after the stop: from both models' hidden states (no (B, T, V) tensor) where their heads
    allow it (:func:`proximal.models.output.models_token_kl`). No gradient."""
    P = rollout.prompt_ids.shape[1]
    input_ids = rollout.input_ids
    return models_token_kl(
        model,
        ref_model,
        input_ids,
        rollout.attention_mask,
        P - 1,
        input_ids.shape[1] - 1,
        mask=rollout.response_mask,
        temperature=temperature,
    )
