"""Log-probabilities without the logits tensor: a causal LM's output layer as tensors, the hidden
states that enter it, and the one place every loss and scoring path chooses how its
log-probabilities are computed (docs/logprobs.md).

At a real vocabulary (V = 128k–152k) the largest tensors of an RL step are the logits, (B, T, V),
and their gradient. The fused path (:mod:`proximal.core.fused`) computes log π(y_t | s_t), the
entropy and the token KL from the hidden states h (B, T, H) and the head's weight W (V, H) a chunk of
tokens at a time, recomputing each chunk's logits in backward, so no (B, T, V) tensor exists. This
module hands it those tensors:

- :func:`output_head`: the head as an :class:`OutputHead` — W with autograd to the trained
  parameters (tied embeddings, a bias, peft LoRA adapters folded in as W + Σ s·B A), Gemma's
  ``final_logit_softcapping``, and the autocast dtype of the product — or the reason it cannot be.
- :func:`lm_hidden`: the hidden states at positions ``start … stop − 1`` (the prompt's logits are
  never computed), from the model's own forward with its output layer swapped for a capture for the
  duration: FSDP2's hooks, autocast, the final norm and ``logits_to_keep`` behave as in
  :func:`proximal.models.heads.lm_logits`, and soft-capping never touches the hidden states.
- :func:`token_logprobs` and :func:`token_kl`: the decision between the fused path and the logits
  path (``train.logprobs``), taken here and nowhere else. The fused computation runs *inside* the
  model's forward, where an FSDP2-sharded head's weight is the gathered tensor and its gradient
  reaches FSDP's reduce-scatter like any other parameter's.

When the fused path cannot serve a model it falls back to the logits path and prints one line with
the reason, once per model (docs/logprobs.md lists the cases).

Notation: B rows, L input length, T = stop − start scored positions, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from proximal import dist
from proximal.core import (
    filtered_logprobs_from_logits,
    logprobs_from_logits,
    token_entropy,
    truncates,
)
from proximal.core import token_kl as logits_token_kl
from proximal.core.fused import linear_logprobs, linear_token_kl
from proximal.models.compiled import eager_blocks
from proximal.models.heads import lm_logits, position_ids_from_mask
from proximal.models.loading import accepts_logits_to_keep, unwrap
from proximal.models.parallel import autocast, is_sharded

#: ``train.logprobs``: from the hidden states chunk by chunk (the default), or through the logits.
LOGPROBS_PATHS = ("fused", "logits")

#: Config fields of architectures whose forward transforms the logits after the output layer in a
#: way the fused path does not reproduce (Cohere's ``logit_scale``, Granite's ``logits_scaling``),
#: with the value at which the transform is the identity. Soft-capping is reproduced; anything
#: else not listed here is caught by the probe of :func:`fused_problem`.
_POSTPROCESSING = {"logit_scale": 1.0, "logits_scaling": 1.0}


@dataclass(frozen=True)
class OutputHead:
    """A causal LM's output layer as tensors: logits = softcap·tanh((h Wᵀ + b) / softcap).

    weight: (V, H), with autograd to the trained parameters (for LoRA on the head, W + Σ s·B A built
    from them). bias: (V,) or None. softcap: the model's ``final_logit_softcapping`` or None.
    matmul_dtype: the dtype the product runs in (bfloat16 for a model under bf16-mixed autocast),
    None for the tensors' own.
    """

    weight: Tensor
    bias: Tensor | None = None
    softcap: float | None = None
    matmul_dtype: torch.dtype | None = None

    def detached(self, copy: bool = False) -> OutputHead:
        """The same head without autograd; ``copy``: its own storage (a sharded model's gathered
        weight is freed when the model shards it again)."""

        def d(t):
            if t is None:
                return None
            t = t.detach()
            return t.clone() if copy else t

        return replace(self, weight=d(self.weight), bias=d(self.bias))


# ----------------------------------------------------------------------------------------------
# The head as tensors
# ----------------------------------------------------------------------------------------------


def _is_plain_linear(module) -> bool:
    """An ``nn.Linear`` whose forward is Linear's own (oneDNN's routing of the same product counts:
    :func:`proximal.models.kernels.use_onednn_linears` patches the instance, not the class)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _peft_active(module):
    """The module a peft ``ModulesToSaveWrapper`` (a fully trained copy of the head) runs now."""
    if module.disable_adapters:
        return module.original_module
    for name in module.active_adapters:
        if name in module.modules_to_save:
            return module.modules_to_save[name]
    return module.original_module


def _lora_head(module) -> tuple[Tensor, Tensor | None] | str:
    """(W, b) of a peft LoRA layer on the head: W + Σ_active s_a·B_a A_a (and b + s_a·bias of B_a
    with ``lora_bias``), differentiable in A, B and the base; the base alone with the adapters
    disabled or merged into it."""
    base = module.base_layer
    if not _is_plain_linear(base):
        return f"its LoRA output layer wraps a {type(base).__name__}, not a Linear layer"
    weight, bias = base.weight, base.bias
    if module.disable_adapters:
        if module.merged:
            return "its output layer's LoRA adapters are merged into the weight but disabled"
        return weight, bias
    if module.merged:
        return weight, bias
    variants = getattr(module, "lora_variant", {}) or {}
    dora = getattr(module, "use_dora", {}) or {}
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in variants or dora.get(name, False):
            kind = type(variants.get(name)).__name__ if name in variants else "DoRA"
            return f"its output layer's LoRA adapter {name!r} is a {kind} variant"
        drop = module.lora_dropout[name]
        if not isinstance(drop, torch.nn.Identity) and getattr(drop, "p", 0.0) > 0:
            return f"its output layer's LoRA adapter {name!r} has dropout p = {drop.p}"
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if not (_is_plain_linear(lora_a) and _is_plain_linear(lora_b)):
            return f"its output layer's LoRA adapter {name!r} is not made of Linear layers"
        s = module.scaling[name]
        delta = (lora_b.weight @ lora_a.weight) * s  # (V, r)·(r, H): the same (V, H) as W
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        weight = weight + delta.to(weight.dtype)
        if lora_b.bias is not None:
            extra = (lora_b.bias * s).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return weight, bias


def _head_tensors(module) -> tuple[Tensor, Tensor | None] | str:
    if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
        module = _peft_active(module)
    if hasattr(module, "base_layer"):
        if hasattr(module, "lora_A") and hasattr(module, "scaling"):
            return _lora_head(module)
        return f"its output layer is a peft {type(module).__name__}, which the fused path does not fold"
    if not _is_plain_linear(module):
        return f"its output layer is a {type(module).__name__}, not a Linear layer"
    return module.weight, module.bias


def _text_config(inner):
    cfg = inner.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _matmul_dtype(model, device_type: str) -> torch.dtype | None:
    """The product's dtype: the autocast dtype where the model runs under autocast (bf16-mixed in one
    process, :func:`proximal.models.parallel.autocast`), else None (the tensors' own)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return getattr(model, "_proximal_autocast", None)


def output_head(model) -> OutputHead | str:
    """The output layer of causal LM ``model`` (peft-wrapped or not) as an :class:`OutputHead`, or
    a one-line reason why the fused path cannot use it.

    Read inside the model's forward (as :func:`lm_hidden` does) for an FSDP2-sharded model: there
    its weight is the gathered tensor; outside it is this rank's shard (a DTensor)."""
    inner = unwrap(model)
    try:
        module = inner.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        module = None
    if module is None:
        return f"{type(inner).__name__} has no output embeddings (get_output_embeddings() is None)"
    cfg = _text_config(inner)
    for name, identity in _POSTPROCESSING.items():
        value = getattr(cfg, name, None)
        if value is not None and value != identity:
            return f"its config's {name} = {value} transforms the logits after the output layer"
    got = _head_tensors(module)
    if isinstance(got, str):
        return got
    weight, bias = got
    if weight.dim() != 2:
        return f"its output layer's weight has shape {tuple(weight.shape)}, not (V, H)"
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return OutputHead(
        weight,
        bias,
        float(softcap) if softcap else None,
        _matmul_dtype(model, weight.device.type),
    )


# ----------------------------------------------------------------------------------------------
# The hidden states, from the model's own forward
# ----------------------------------------------------------------------------------------------


def _run_with_head(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    start: int,
    stop: int,
    fn: Callable[[Tensor, OutputHead], object],
    *,
    position_ids: Tensor | None = None,
):
    """``fn(hidden (B, stop − start, H), head)``, called inside ``model``'s forward in place of its
    output layer; returns what ``fn`` returns.

    The output layer's ``forward`` is swapped for a capture for the duration of one call of the
    model's own forward (its hooks, an FSDP2 unit's included, still run), which returns a (B, T, 1)
    dummy for the forward to finish on — whatever the model then does to its "logits" (Gemma's
    soft-cap) acts on the dummy. ``fn`` runs with autocast off: the product's dtype is the head's
    ``matmul_dtype``, explicitly. Positions as in :func:`proximal.models.heads.lm_logits`."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    inner = unwrap(model)
    module = inner.get_output_embeddings()
    keep = accepts_logits_to_keep(model)
    extra = {"logits_to_keep": torch.arange(start, stop, device=input_ids.device)} if keep else {}
    result = []

    def capture(hidden, *args, **kwargs):
        if not keep:
            hidden = hidden[:, start:stop]
        head = output_head(model)
        if isinstance(head, str):
            raise RuntimeError(f"the fused log-probabilities cannot use this model: {head}")
        with torch.autocast(hidden.device.type, enabled=False):
            result.append(fn(hidden, head))
        return hidden.new_zeros((*hidden.shape[:-1], 1))

    saved = module.__dict__.get("forward")
    module.forward = capture
    try:
        with autocast(model):
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **extra,
            )
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved
    if len(result) != 1:
        raise RuntimeError(
            f"{type(inner).__name__}'s forward called its output layer {len(result)} times, not once"
        )
    return result[0]


def lm_hidden(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    start: int,
    stop: int,
    *,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, OutputHead]:
    """The hidden states that enter the output layer at positions ``start … stop − 1``,
    (B, stop − start, H), and the head (:func:`output_head`) — :func:`proximal.models.heads.lm_logits`
    without the logits: the logits of the prompt are never computed, nor are these.

    For an FSDP2-sharded model without gradients the head's tensors are copies (the gathered weight
    is freed when the model shards again); with gradients they are the gathered parameters, alive
    until backward (a trained model's root keeps them: :func:`proximal.models.parallel.shard`).
    """
    copy = is_sharded(model) and not torch.is_grad_enabled()
    return _run_with_head(
        model,
        input_ids,
        attention_mask,
        start,
        stop,
        lambda h, head: (h, head.detached(copy=True) if copy else head),
        position_ids=position_ids,
    )


# ----------------------------------------------------------------------------------------------
# Whether the fused path serves a model
# ----------------------------------------------------------------------------------------------


def _probe_logits(hidden: Tensor, head: OutputHead) -> Tensor:
    """The logits the fused path computes (core.fused's formula), for the probe's handful of tokens."""
    dt = head.matmul_dtype or torch.promote_types(hidden.dtype, head.weight.dtype)
    bias = None if head.bias is None else head.bias.to(dt)
    z = torch.nn.functional.linear(hidden.to(dt), head.weight.to(dt), bias).float()
    return z if head.softcap is None else head.softcap * torch.tanh(z / head.softcap)


def _probe(model) -> str | None:
    """Run four tokens through the model both ways: its own logits against the fused path's
    formula on the captured hidden states. A forward that post-processes the logits some other way,
    or does not call its output layer once, shows here."""
    inner = unwrap(model)
    device = next(model.parameters()).device
    n = 4
    ids = (torch.arange(n, device=device) % _text_config(inner).vocab_size)[None]
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), eager_blocks():  # four tokens: compiling would not repay
            own = lm_logits(model, ids, mask, 0, n).float()
            try:
                ours = _run_with_head(model, ids, mask, 0, n, _probe_logits)
            except RuntimeError as e:
                return str(e).removeprefix("the fused log-probabilities cannot use this model: ")
    finally:
        model.train(was_training)
    if ours.shape != own.shape:
        return (
            f"its logits have shape {tuple(own.shape)}, its output layer gives {tuple(ours.shape)}"
        )
    low = own.dtype != torch.float32 or next(model.parameters()).dtype != torch.float32
    low = low or getattr(model, "_proximal_autocast", None) is not None
    scale = float(own.abs().max().clamp(min=1e-6))
    err = float((ours - own).abs().max()) / scale
    if not err <= (5e-2 if low else 1e-3):
        return (
            f"its forward's logits differ from its output layer's product (relative {err:.2g}): "
            "it transforms them"
        )
    return None


def fused_problem(model) -> str | None:
    """Why the fused path cannot compute ``model``'s log-probabilities, or None when it can.

    :func:`output_head`'s reason, else the probe's (a few tokens through the model both ways, once
    per model: ``model._proximal_fused_problem`` keeps the answer). Every rank of a sharded model
    calls it at the same point (the probe is a forward pass)."""
    head = output_head(model)
    if isinstance(head, str):
        return head
    cached = model.__dict__.get("_proximal_fused_problem", False)
    if cached is False:
        cached = model.__dict__["_proximal_fused_problem"] = _probe(model)
    return cached


def _uses_fused(model, path: str) -> bool:
    """The decision: ``path`` (``train.logprobs``) is "fused" and the model allows it. A fallback
    prints its reason on the first process, once per model."""
    if path not in LOGPROBS_PATHS:
        raise ValueError(f"logprobs path {path!r} is not one of {', '.join(LOGPROBS_PATHS)}")
    if path == "logits":
        return False
    problem = fused_problem(model)
    if problem is None:
        return True
    if not model.__dict__.get("_proximal_fused_noted") and dist.is_main():
        print(
            f"proximal: log-probabilities of {type(unwrap(model)).__name__} through the logits "
            f"(train.logprobs: fused cannot be used: {problem})",
            flush=True,
        )
    model.__dict__["_proximal_fused_noted"] = True
    return False


# ----------------------------------------------------------------------------------------------
# The one decision: log-probabilities, entropies and the token KL of a model at given positions
# ----------------------------------------------------------------------------------------------

#: ``entropy`` of :func:`token_logprobs`: none, computed for logging (no gradient), or trained on.
ENTROPY = (None, "logged", "trained")


@dataclass
class TokenScores:
    """What :func:`token_logprobs` returns. logprobs: (B, T) float32, 0 where the mask is False;
    entropy: (B, T) or None; kept: the policy's side of a later :func:`token_kl` (detached: the
    hidden states and head on the fused path, the logits on the other), or None. full_logprobs:
    with a replayed filter, log softmax(logits_t / τ)[y_t] over the whole vocabulary (what the KL
    terms read), ``logprobs`` being the filtered ones; None without one (they are ``logprobs``)."""

    logprobs: Tensor
    entropy: Tensor | None = None
    kept: tuple[Tensor, OutputHead] | Tensor | None = None
    full_logprobs: Tensor | None = None

    @property
    def unfiltered(self) -> Tensor:
        """log softmax(logits_t / τ)[y_t] on the full vocabulary: :attr:`full_logprobs` where a
        filter was replayed, else :attr:`logprobs`."""
        return self.logprobs if self.full_logprobs is None else self.full_logprobs


def token_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    start: int,
    stop: int,
    tokens: Tensor,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    position_ids: Tensor | None = None,
    entropy: str | None = None,
    keep: bool = False,
    path: str = "fused",
    filter: tuple[int, float] | None = None,
) -> TokenScores:
    """log π(y_t | s_t) = log softmax(logits_t / τ)[y_t] of ``tokens`` (B, T = stop − start) at
    positions ``start … stop − 1`` of the input (the caller aligns: position i predicts token i + 1),
    through the fused path (:mod:`proximal.core.fused`, no (B, T, V) tensor) or the logits
    (:func:`proximal.core.logprobs_from_logits` on :func:`proximal.models.heads.lm_logits`).

    Args:
        mask: bool (B, T), True = a position that counts; 0 elsewhere, where nothing is read.
        entropy: None; ``"logged"``: also the entropy of softmax(logits_t / τ), no gradient, from the
            same pass; ``"trained"``: with its gradient (the entropy bonus).
        keep: also keep what a later :func:`token_kl` against another model needs (evaluation).
        path: ``train.logprobs``; "fused" falls back to "logits" where the model needs it
            (:func:`fused_problem`), with a one-line note.
        filter: ``(top_k, top_p)`` to replay the engine's filter (``rollout.replay_filter``):
            ``logprobs`` are then those of the truncated, renormalised distribution
            (:func:`proximal.core.filtered_logprobs_from_logits`) and ``full_logprobs`` the full
            softmax's; the entropy stays the full softmax's. It needs whole vocabulary rows, so it
            takes the logits path (a one-line note where "fused" was asked). None, or a filter
            that keeps everything (0, 1.0): as without.
    """
    if entropy not in ENTROPY:
        raise ValueError(f"entropy {entropy!r} is not one of {ENTROPY}")
    if filter is not None and truncates(*filter):
        return _filtered_logprobs(
            model,
            input_ids,
            attention_mask,
            start,
            stop,
            tokens,
            mask=mask,
            temperature=temperature,
            position_ids=position_ids,
            entropy=entropy,
            keep=keep,
            path=path,
            filter=filter,
        )
    if _uses_fused(model, path):

        def fn(hidden, head):
            out = linear_logprobs(
                hidden,
                head.weight,
                tokens,
                temperature,
                bias=head.bias,
                mask=mask,
                softcap=head.softcap,
                matmul_dtype=head.matmul_dtype,
                with_entropy=entropy is not None,
                entropy_grad=entropy == "trained",
            )
            lp, ent = out if entropy is not None else (out, None)
            kept = None
            if keep:
                kept = (hidden.detach(), head.detached(copy=is_sharded(model)))
            return TokenScores(lp, ent, kept)

        return _run_with_head(
            model, input_ids, attention_mask, start, stop, fn, position_ids=position_ids
        )

    logits = lm_logits(model, input_ids, attention_mask, start, stop, position_ids=position_ids)
    kept = logits.detach() if keep else None
    if entropy == "trained":
        lp = logprobs_from_logits(logits, tokens, temperature, mask=mask)
        return TokenScores(lp, token_entropy(logits, temperature, mask=mask), kept)
    if entropy == "logged":
        lp, ent = logprobs_from_logits(logits, tokens, temperature, mask=mask, with_entropy=True)
        return TokenScores(lp, ent, kept)
    return TokenScores(logprobs_from_logits(logits, tokens, temperature, mask=mask), None, kept)


def _filtered_logprobs(
    model,
    input_ids,
    attention_mask,
    start,
    stop,
    tokens,
    *,
    mask,
    temperature,
    position_ids,
    entropy,
    keep,
    path,
    filter,
) -> TokenScores:
    """:func:`token_logprobs` with a replayed filter, through the logits: the fused path never holds
    a whole vocabulary row, which the filter (a sort over V) needs."""
    if path not in LOGPROBS_PATHS:
        raise ValueError(f"logprobs path {path!r} is not one of {', '.join(LOGPROBS_PATHS)}")
    if path == "fused" and not model.__dict__.get("_proximal_replay_noted"):
        model.__dict__["_proximal_replay_noted"] = True
        if dist.is_main():
            print(
                f"proximal: log-probabilities of {type(unwrap(model)).__name__} through the logits "
                "(train.logprobs: fused cannot be used: rollout.replay_filter needs whole "
                "vocabulary rows for top-k/top-p)",
                flush=True,
            )
    top_k, top_p = filter
    logits = lm_logits(model, input_ids, attention_mask, start, stop, position_ids=position_ids)
    kept = logits.detach() if keep else None
    lp, full, *ent = filtered_logprobs_from_logits(
        logits,
        tokens,
        temperature,
        top_k=top_k,
        top_p=top_p,
        mask=mask,
        with_entropy=entropy == "logged",
    )
    ent = ent[0] if ent else None
    if entropy == "trained":  # the entropy bonus of the full softmax, with its gradient
        ent = token_entropy(logits, temperature, mask=mask)
    return TokenScores(lp, ent, kept, full)


@torch.no_grad()
def token_kl(
    kept: tuple[Tensor, OutputHead] | Tensor,
    ref_model,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    start: int,
    stop: int,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    position_ids: Tensor | None = None,
    path: str = "fused",
) -> Tensor:
    """The exact KL(π(·|s_t) ‖ π_ref(·|s_t)) over the whole vocabulary at each position, (B, T),
    0 where ``mask`` is False: π from ``kept`` (:attr:`TokenScores.kept` of the policy's pass over
    the same positions), π_ref from ``ref_model``'s forward. Fused (:func:`proximal.core.fused.
    linear_token_kl`) when both sides allow it, else through the logits
    (:func:`proximal.core.token_kl`). No gradient: a monitor."""
    if isinstance(kept, tuple) and _uses_fused(ref_model, path):
        hidden, head = kept

        def fn(ref_hidden, ref_head):
            return linear_token_kl(
                hidden,
                head.weight,
                ref_hidden,
                ref_head.weight,
                temperature,
                bias=head.bias,
                ref_bias=ref_head.bias,
                mask=mask,
                softcap=head.softcap,
                ref_softcap=ref_head.softcap,
                matmul_dtype=head.matmul_dtype or ref_head.matmul_dtype,
            )

        return _run_with_head(
            ref_model, input_ids, attention_mask, start, stop, fn, position_ids=position_ids
        )
    logits = kept
    if isinstance(kept, tuple):  # the policy's hidden states, the reference through its logits
        hidden, head = kept
        logits = _probe_logits(hidden, head)
    ref_logits = lm_logits(
        ref_model, input_ids, attention_mask, start, stop, position_ids=position_ids
    )
    return logits_token_kl(logits, ref_logits, temperature, mask=mask)


def models_token_kl(
    model,
    ref_model,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    start: int,
    stop: int,
    *,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    path: str = "fused",
) -> Tensor:
    """KL(π ‖ π_ref) per position (B, T) of two models over the same positions (:func:`token_kl`),
    the policy's side kept from a pass of its own."""
    with torch.no_grad():
        if _uses_fused(model, path):
            kept = lm_hidden(model, input_ids, attention_mask, start, stop)
        else:
            kept = lm_logits(model, input_ids, attention_mask, start, stop)
    return token_kl(
        kept,
        ref_model,
        input_ids,
        attention_mask,
        start,
        stop,
        mask=mask,
        temperature=temperature,
        path=path,
    )
