"""The rollout engine: the one place responses are generated, behind a small interface.

Every online method (PPO, GRPO, RLOO) and the evaluations call :meth:`RolloutEngine.generate`
with left-padded prompts, one seed per row and :class:`SamplingParams`, and get token ids back;
nothing else in the algorithm knows how. :class:`HFEngine` decodes with the Hugging Face model's
KV cache: the prompt through the model's own forward, then each token through the model's forward
or, for the Llama family, :class:`~proximal.rollout.decode.LeanDecoder` (the same modules with
less per-token work around them; the same tokens). Which of the two is decided when the engine is
built — the lean step's every dependency on transformers' internals checked then — and said by
:meth:`HFEngine.decode_path`; a rollout the lean step declines or fails in goes on with the model's
own forward, with one line saying why, never an error. A serving engine (vLLM, SGLang) fits
behind the same two methods: it generates from its own copy of the weights and refreshes that copy
in :meth:`after_update`.

**Sampling does not depend on how the batch is laid out.** Row b draws its tokens with its own
generator seeded by ``seeds[b]`` — the trainers derive it from (run seed, step, position in the
global batch), :func:`row_seed` — by inverse-CDF sampling: the next token is the first v whose
cumulative probability F(v) = Σ_{w ≤ v} softmax(z)_w exceeds u·F(V), with u ~ U[0, 1) the row's
next draw and z the tempered, filtered logits — an exact sample of softmax(z) from one random
number per row per token. So a row gets the same tokens whichever other rows share its batch or its
process, and a run gives the same rollouts on 1 process or on 8 (up to float32 round-off in the
logits).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.core.logprobs import filter_logits
from proximal.models.compiled import eager_blocks
from proximal.models.heads import position_ids_from_mask
from proximal.models.kernels import packed_weights
from proximal.models.loading import accepts_logits_to_keep, cache_argument, unwrap
from proximal.models.parallel import autocast, gathered, is_sharded
from proximal.rollout.decode import LeanDecoder, declined, unsupported


@dataclass(frozen=True)
class SamplingParams:
    """What to sample: at most ``max_new_tokens`` tokens from softmax(logits / temperature), restricted
    to the ``top_k`` most likely (0 = all) and to the smallest set of probability ≥ ``top_p`` (1 = all);
    a row stops after any of ``stop_token_ids``."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def row_seed(*parts: int) -> int:
    """A 63-bit seed from integers (e.g. run seed, step, row): equal parts, equal seed; nothing else shared."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class RolloutEngine(Protocol):
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        seeds: list[int],
        params: SamplingParams,
        *,
        logprobs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, T) sampled ids for (B, P) left-padded prompts; T ≤ max_new_tokens; after a row's stop
        token the ids are meaningless (the caller masks them).

        With ``logprobs=True``: ``(ids, logprobs)``, logprobs (B, T) float32 the log-probability μ of
        each sampled token under the distribution the engine actually drew it from — the processed
        log-probability: log softmax(filter(z / τ))[y], z the very logits it was drawn with and
        filter top-k / top-p (:func:`proximal.core.filter_logits`: the truncated distribution,
        renormalised over the kept set). Without top-k / top-p that is log softmax(z / τ)[y], what the
        trainer computes as π_old; with them, the trainer computes π_old on the same truncated
        support only under ``rollout.replay_filter`` (else π_old/μ also carries the truncation,
        −log(kept mass)). vLLM's ``logprobs_mode="processed_logprobs"`` is this same quantity
        (docs/rollout-correction.md). After a row's
        stop the values are meaningless (masked), like the ids."""

    def after_update(self) -> None:
        """Called after every policy update: an engine holding its own weights refreshes them here."""

    def close(self) -> None:
        """Called when the run ends: an engine holding resources of its own releases them."""


def categorical_sample(
    logits: torch.Tensor,
    generators: list[torch.Generator],
    params: SamplingParams,
    *,
    logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(filter(logits / τ)), row b's randomness from ``generators[b]``. (B,).
    With ``logprobs``, ``(token, μ)``: μ (B,) float32 the token's log-probability under that very
    distribution, log softmax(filter(z / τ))[y] — the filter's truncated, renormalised distribution
    (:func:`proximal.core.filter_logits`; without top-k / top-p, log softmax(z / τ)[y]), from the
    filtered logits the token was drawn with (the filter runs once).

    Inverse-CDF sampling: the cumulative sum (in float64, so that rounding cannot move a boundary
    by more than ~1e-16) is searched for u·F(V), u ~ U[0, 1) — one draw per row, where the
    Gumbel-max trick needs V. A filtered token (probability 0) spans an empty interval and is never
    chosen.
    """
    z = logits.float()
    if params.temperature != 1.0:
        z = z / params.temperature
    z = filter_logits(z, params.top_k, params.top_p)  # (B, V); z itself without a filter
    cdf = torch.softmax(z, dim=-1).double().cumsum_(-1)
    u = torch.cat(
        [torch.rand(1, generator=g, dtype=torch.float64, device=cdf.device) for g in generators]
    )
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    token = token.clamp_max_(cdf.shape[-1] - 1)
    if not logprobs:
        return token
    return token, z.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


class HFEngine:
    """KV-cached decoding with a Hugging Face causal LM (sharded or not; LoRA or not).

    A sharded (FSDP2) model's full weights are gathered once around the whole decode
    (:func:`proximal.models.parallel.gathered`), so ranks decode without collectives and stop at
    their own lengths. With ``gather_weights=False`` (a policy too large for one device) the weights
    stay sharded and every forward gathers one block at a time, as in training; then every rank must
    run every decode step, so the ranks decode until all of them are done (one small all-reduce per
    token). The checkpoint's ``generation_config`` (repetition penalties, suppressed tokens, …) is
    never consulted: the tokens come from exactly softmax(logits / τ), the policy whose
    log-probabilities the losses recompute.

    ``precision`` (``rollout.precision``, when it differs from ``train.precision``) samples as a
    serving engine in another precision would: ``"bf16-mixed"`` decodes under
    ``torch.autocast(bfloat16)``; ``"bf16-true"`` decodes with an engine-held copy of the policy
    whose parameters are bfloat16 (buffers such as the rotary frequencies stay as loaded, as in a
    model loaded in bfloat16), refreshed from the policy in :meth:`after_update` — one process only
    (a sharded policy has no whole copy to hold: ConfigError). None decodes the policy as it trains.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        *,
        gather_weights: bool = True,
        lean_decode: bool = True,
        precision: str | None = None,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"HFEngine: precision {precision!r} is not one of {PRECISIONS}")
        self.model = model  # the policy (what the run records); ``decoder`` is what decodes
        self.pad_token_id = pad_token_id
        self.gather_weights = gather_weights
        self.lean_decode = lean_decode
        self.precision = precision
        self.decoder = bfloat16_copy(model) if precision == "bf16-true" else model
        # the copy takes the policy's weights before each rollout that follows a change: the first
        # (the policy may have been restored from a checkpoint since) and every one after an update
        self._stale = True
        self._keep_last = accepts_logits_to_keep(model)
        self._cache_kw = cache_argument(model)
        # Once, before any rollout (never per token): whether the lean step can decode this model.
        self._lean_reason = self._why_not_lean()
        self._said: set[str] = set()  # the kinds of reason a rollout fell back for, each said once

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        seeds: list[int],
        params: SamplingParams,
        *,
        logprobs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RolloutEngine.generate`: the ids, and with ``logprobs`` each sampled token's
        log softmax(filter(z / τ)) from the logits z it was drawn with (0 after a row's stop)."""
        if self._stale and self.decoder is not self.model:
            self._refresh()
        self._stale = False
        B = prompt_ids.shape[0]
        if len(seeds) != B:
            raise ValueError(f"generate: {len(seeds)} seeds for {B} prompts")
        device = prompt_ids.device
        generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        stop = torch.tensor(sorted(set(params.stop_token_ids)), device=device, dtype=torch.long)
        extra = {"logits_to_keep": 1} if self._keep_last else {}
        model, T = self.decoder, params.max_new_tokens
        sharded_steps = not self.gather_weights and is_sharded(model)
        with (
            gathered(model) if self.gather_weights else contextlib.nullcontext(),
            self._autocast(),
        ):
            prompt = prompt_mask.long()
            cache, logits = self._forward(prompt_ids, prompt, extra)
            mask = prompt
            # (B, 1): the next token's position counts real tokens only
            position = prompt.sum(1, keepdim=True)
            done = torch.zeros(B, dtype=torch.bool, device=device)
            tokens, lps = [], []
            # The prompt's pass has many rows (oneDNN's per-call reordering costs little there); the decode
            # steps have B rows each and multiply by weights reordered once (packed_weights).
            with packed_weights(model, rows=B):
                lean = None
                if self._lean_reason is None:
                    reason = declined(model, cache, prompt, T)
                    if reason is not None:
                        self._say(reason)
                    else:
                        try:
                            lean = LeanDecoder.start(model, cache, prompt, T)
                        except Exception as e:  # what the checks at start-up did not foresee
                            self._give_up(f"starting it failed ({type(e).__name__}: {e})")
                            cache, logits, mask = self._restart(prompt_ids, prompt, tokens, extra)
                if lean is not None:
                    cache = None  # its keys and values were moved into the decoder's buffers
                for t in range(T):
                    if logprobs:  # from the logits just sampled, before the pad replaces the token
                        token, lp = categorical_sample(logits, generators, params, logprobs=True)
                        lps.append(torch.where(done, 0.0, lp))
                    else:
                        token = categorical_sample(logits, generators, params)
                    token = torch.where(done, self.pad_token_id, token)
                    tokens.append(token)
                    done = done | torch.isin(token, stop)
                    finished = (
                        not dist.any_rank(not bool(done.all()), device)
                        if sharded_steps
                        else bool(done.all())
                    )
                    if t + 1 == T or finished:
                        break
                    if lean is not None:
                        try:
                            logits = lean.step(token, position)
                        except Exception as e:  # the same: this rollout goes on the model's own way
                            lean = None
                            self._give_up(
                                f"its step failed at token {t + 2} ({type(e).__name__}: {e})"
                            )
                            cache, logits, mask = self._restart(prompt_ids, prompt, tokens, extra)
                    else:
                        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                        with eager_blocks():
                            out = model(
                                input_ids=token[:, None],
                                attention_mask=mask,
                                position_ids=position,
                                use_cache=True,
                                **{self._cache_kw: cache},
                                **extra,
                            )
                        cache, logits = getattr(out, self._cache_kw), out.logits[:, -1]
                    position = position + 1
        ids = torch.stack(tokens, dim=1)
        return (ids, torch.stack(lps, dim=1)) if logprobs else ids

    def _autocast(self):
        """bf16-mixed sampling's ``torch.autocast(bfloat16)``; else the policy's own (its
        train.precision's: :func:`proximal.models.parallel.autocast`)."""
        if self.precision == "bf16-mixed":
            device = next(self.decoder.parameters()).device.type
            return torch.autocast(device_type=device, dtype=torch.bfloat16)
        return autocast(self.decoder)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, extra: dict):
        """The model's own forward over (B, L) ``ids`` with its cache: (the cache, the (B, V) next
        logits)."""
        with eager_blocks():  # compiled blocks would compile a graph per layer here
            out = self.decoder(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                use_cache=True,
                **extra,
            )
        return getattr(out, self._cache_kw), out.logits[:, -1]

    def _restart(self, prompt_ids, prompt_mask, tokens: list[torch.Tensor], extra: dict):
        """Where the lean step stopped, the model's own forward over the prompt and the ``tokens``
        sampled so far (each (B,)): (its cache, the next logits, the (B, P + len(tokens)) mask) to go
        on from. The cache is computed again because the lean step took the prompt's."""
        ids = torch.cat([prompt_ids, *(t[:, None] for t in tokens)], dim=1)
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_mask), len(tokens))], dim=1)
        return (*self._forward(ids, mask, extra), mask)

    def _why_not_lean(self) -> str | None:
        if not self.lean_decode:
            return "rollout.lean_decode is false"
        if not self.gather_weights and is_sharded(self.decoder):
            # Weights gathered block by block need the model's own forward (its FSDP hooks) at every step.
            return "rollout.gather_weights is false: the sharded weights are gathered at every step"
        return unsupported(self.decoder)

    def lean_reason(self) -> str | None:
        """Why the decode steps use the model's own forward instead of
        :class:`~proximal.rollout.decode.LeanDecoder` (a sentence), or None when they don't: decided
        when the engine was built (:func:`~proximal.rollout.decode.unsupported`), or since, if a
        lean step failed."""
        return self._lean_reason

    def decode_path(self) -> dict:
        """``{"path": "lean" | "generate", "reason": why not lean, or None}``, for the run's
        ``models.json``; "generate" is the model's own forward at every token. With a sampling
        precision of its own, also ``"precision"`` (``rollout.precision``) and, for bf16-true,
        ``"copy_bytes"``: the bytes of the engine's bfloat16 copy."""
        reason = self._lean_reason
        out = {"path": "lean" if reason is None else "generate", "reason": reason}
        if self.precision is not None:
            out["precision"] = self.precision
        if self.decoder is not self.model:
            out["copy_bytes"] = sum(p.numel() * p.element_size() for p in self.decoder.parameters())
        return out

    def follow_recorded(self, recorded: dict) -> str | None:
        """Take the decode path a resumed run's ``models.json`` recorded (``{"path", "reason"}``, as
        :meth:`decode_path` wrote it), so that its numbers continue the run's: where that run decoded
        with the model's own forward and this engine would take the lean step, it decodes the
        model's own way too (the same tokens; the logits, and so the rollouts' log-probabilities,
        may differ by float32 round-off). Where that run took the lean step and this engine cannot,
        returns a line saying so; None otherwise."""
        path = recorded.get("path")
        if path == "generate" and self._lean_reason is None:
            self._lean_reason = f"the run being resumed decoded so ({recorded.get('reason') or 'no reason recorded'})"
        elif path == "lean" and self._lean_reason is not None:
            return (
                "decode: the run being resumed took the lean step, which this process cannot "
                f"({self._lean_reason}): from here its numbers differ from an uninterrupted run's "
                "in the last digits"
            )
        return None

    def describe_decode(self) -> str:
        """The decode path in words, for the line a run prints at its start."""
        if self._lean_reason is None:
            text = "lean (proximal.rollout.decode's step; rollout.lean_decode)"
        else:
            text = f"the model's own forward at every token (lean decode: {self._lean_reason})"
        if self.precision == "bf16-mixed":
            text += "; sampling under bfloat16 autocast (rollout.precision bf16-mixed)"
        elif self.precision == "bf16-true":
            text += (
                "; sampling with the engine's bfloat16 copy of the policy "
                "(rollout.precision bf16-true)"
            )
        return text

    def _say(self, reason: str) -> None:
        """One line (rank 0, once per reason) when a rollout decodes the model's own way; reasons that
        differ only in their numbers (a cache's shape at each prompt length) count as one."""
        kind = re.sub(r"\d+", "N", reason)
        if kind not in self._said:
            self._said.add(kind)
            if dist.is_main():
                print(
                    f"proximal: decode: the model's own forward (lean decode: {reason})", flush=True
                )

    def _give_up(self, reason: str) -> None:
        """A lean step that failed is not tried again: the model's own forward from now on."""
        self._lean_reason = reason
        self._say(reason)

    def after_update(self) -> None:
        """With bf16-true sampling, the engine's bfloat16 copy is refreshed from the updated policy
        before the next rollout; otherwise nothing to do: this engine decodes with the live model."""
        self._stale = True

    def close(self) -> None:
        """Nothing to release: this engine decodes with the policy (or holds a copy the collector
        frees)."""

    @torch.no_grad()
    def _refresh(self) -> None:
        """The bfloat16 copy takes the policy's trained weights (rounded to bfloat16): a frozen
        parameter (LoRA's base weights) never changes, so its copy is left as it is."""
        for held, live in zip(self.decoder.parameters(), self.model.parameters(), strict=True):
            if live.requires_grad:
                held.copy_(live)


#: ``rollout.precision`` values an engine takes (None: the policy's own, train.precision).
PRECISIONS = (None, "bf16-mixed", "bf16-true")


def build_engine(
    kind: str,
    model: torch.nn.Module,
    pad_token_id: int,
    *,
    gather_weights: bool = True,
    lean_decode: bool = True,
    precision: str | None = None,
    kv_cache_bytes: int = 1 << 30,
    max_model_len: int = 2048,
    seed: int = 0,
    kv_field: str = "rollout.kv_cache_gib",
) -> RolloutEngine:
    """The ``rollout.engine`` named ``kind`` over the policy ``model``: :class:`HFEngine` ("hf"), or
    :class:`~proximal.rollout.vllm.VLLMEngine` ("vllm"), whose dtype is bfloat16 under a bf16
    ``precision`` (``rollout.precision``) or a bfloat16 policy, else float32; ``lean_decode`` does not
    apply to it. ``kv_cache_bytes``, ``max_model_len`` (the longest prompt plus response) and ``seed``
    are vLLM's."""
    if kind == "hf":
        return HFEngine(
            model,
            pad_token_id,
            gather_weights=gather_weights,
            lean_decode=lean_decode,
            precision=precision,
        )
    if kind != "vllm":
        raise ValueError(f"build_engine: unknown engine {kind!r} (hf or vllm)")
    from proximal.rollout.vllm import VLLMEngine  # lazy: vLLM is an optional engine

    weights = next(model.parameters()).dtype
    bf16 = precision in ("bf16-mixed", "bf16-true") or weights == torch.bfloat16
    return VLLMEngine(
        model,
        pad_token_id,
        dtype="bfloat16" if bf16 else "float32",
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        seed=seed,
        gather_weights=gather_weights,
        kv_field=kv_field,
    )


def bfloat16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (LoRA layers and all) whose parameters are bfloat16 tensors without
    gradients, its buffers as they are — what loading the checkpoint in bfloat16 gives, as a serving
    engine would hold it. Built parameter by parameter (never a whole float32 copy first); tied
    parameters stay tied. ConfigError for a sharded (FSDP2) model."""
    if is_sharded(model):
        raise ConfigError(
            "rollout.precision = bf16-true needs one process: a sharded (FSDP2) policy has no whole "
            "copy for the engine to hold (use rollout.precision: bf16-mixed)"
        )
    memo = {
        id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
        for p in model.parameters()
    }
    held = copy.deepcopy(model, memo)
    for m in (held, unwrap(held)):
        m.__dict__.pop("_proximal_autocast", None)  # computes in bfloat16 itself, no autocast
    for m in held.modules():  # a compiled block's copy would call the original's (float32) forward
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return held
