"""A decode step with less per-token overhead than the model's own forward, for the Llama family
(Llama, Mistral, Qwen2, Qwen3 causal LMs).

At a decode step the model sees one new token per row. Of a Hugging Face ``forward`` at that size
(the tiny benchmark policy, 16 rows, 2 CPU threads), under half is the model's arithmetic: the rest
is per-call work around it — building a 4-d attention mask from the 2-d one, a ``DynamicCache``
that concatenates every layer's keys and values into new tensors at every token, output objects,
argument checks. :class:`LeanDecoder` keeps the arithmetic and drops that work:

- the same modules do the computing: the model's embedding, its norms, its projections (LoRA
  layers and :mod:`proximal.models.kernels`' routing included), its MLPs, its rotary embedding and
  its ``apply_rotary_pos_emb``, its attention function ("sdpa" or "eager", the one its config
  names), its output layer;
- the keys and values live in one buffer per layer, sized for the whole response and written in
  place, starting from the cache of the prompt's forward (which the model's own forward computes);
- the attention mask is the rows' padding mask, a view of one (B, P + T) tensor.

So the logits are the model's own up to float round-off of a different summation order (the test
suite holds both paths to the same tokens and to logits within 2e-5; under bfloat16 autocast the
logits are bit for bit those of the model's own cached decode), and a step of the tiny
benchmark's 48-token decode costs about a quarter less (``benchmarks/README.md``).

:func:`unsupported` says why a model is not taken (then the model's own forward decodes): another
architecture (its forward may do things this one does not — Gemma scales its embeddings, GPT-2
has absolute positions), an attention implementation other than "sdpa" and "eager" (flash
attention takes its masks in another form) or attention dropout in train mode; and
:meth:`LeanDecoder.start` declines a sliding attention window narrower than the prompt and
response together, or a prompt cache in another format.
"""

from __future__ import annotations

import sys

import torch

from proximal.models import kernels
from proximal.models.loading import unwrap  # the transformers model under peft's wrapper

#: The causal-LM classes whose forward is, at a decode step, exactly :meth:`LeanDecoder.step`: the
#: embedding, then per layer ``h += attention(norm(h))`` and ``h += mlp(norm(h))``, a final norm
#: and the output layer.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


#: The attention implementations the lean step calls (the model's own attention function for each, from
#: its modeling module's ``ALL_ATTENTION_FUNCTIONS``), and the form of the padding mask each takes:
#: True = attend for "sdpa"; for "eager" 0 or the dtype's lowest value, added to the scores.
MASKS = {"sdpa": "bool", "eager": "additive"}


def _architecture(model: torch.nn.Module) -> str | None:
    """The supported class ``model`` is, or FSDP2's subclass of (``FSDPLlamaForCausalLM``); else None."""
    cls = type(model)
    for name in SUPPORTED:
        if cls.__name__ in (name, "FSDP" + name):
            for c in cls.__mro__:
                if c.__name__ == name and c.__module__.startswith("transformers.models."):
                    return name
    return None


def _layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    # Activation checkpointing (proximal.models.parallel) wraps each layer; decoding needs no gradients.
    return [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in base.model.layers]


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot decode ``model`` (a sentence), or None when it can."""
    base = unwrap(model)
    name = _architecture(base)
    if name is None:
        return f"{type(base).__name__} is not one of {', '.join(SUPPORTED)}"
    config = base.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKS:
        return f"attention implementation {impl!r} (only {', '.join(map(repr, MASKS))})"
    if getattr(config, "attention_dropout", 0.0) and any(
        layer.self_attn.training for layer in _layers(base)
    ):
        return "attention dropout in train mode"
    return None


def _window(base: torch.nn.Module) -> int | None:
    """The narrowest sliding attention window of the model's layers (None: every layer attends to all)."""
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in _layers(base)]
    if _architecture(base) == "MistralForCausalLM":  # Mistral's layers read the config's
        windows.append(getattr(base.config, "sliding_window", None))
    windows = [w for w in windows if w is not None]
    return min(windows) if windows else None


class LeanDecoder:
    """Decode steps after the prompt's forward: ``step(tokens, positions)`` → the next logits.

    Built by :meth:`start` from the prompt's cache (the model's own ``DynamicCache``), the prompt's
    (B, P) padding mask and the number of tokens to come. Call it inside the same context as the
    prompt's forward (no gradients, gathered weights, autocast)."""

    def __init__(
        self,
        model: torch.nn.Module,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
        length: int,
    ):
        base = unwrap(model)
        self.base, self.inner, self.layers = base, base.model, _layers(base)
        module = sys.modules[type(self.layers[0].self_attn).__module__]
        self.rotate = module.apply_rotary_pos_emb  # the model's own rotary arithmetic
        impl = base.config._attn_implementation  # and its own attention function
        self.attend = module.ALL_ATTENTION_FUNCTIONS.get_interface(
            impl, module.eager_attention_forward
        )
        self.keys, self.values = keys, values  # per layer (B, H_kv, P + T, D)
        self.length = length  # filled positions
        # The padding mask (B, P + T), True = attend, in the form the attention function takes, (B, 1, 1, P + T):
        # for "eager" as the model's own eager mask, 0 or the lowest value of the hidden states' dtype, added.
        self.attn_mask = mask[:, None, None, :]
        if MASKS[impl] == "additive":
            dtype = (
                self.inner.embed_tokens.weight.dtype
            )  # the hidden states' dtype (no autocast on embeddings)
            self.attn_mask = torch.zeros(
                self.attn_mask.shape, dtype=dtype, device=mask.device
            ).masked_fill_(~self.attn_mask, torch.finfo(dtype).min)
        # On CPU inside kernels.packed_weights (float32, or bfloat16 under autocast): one product for a
        # layer's q, k, v projections (with each one's number of heads, to split its output) and one for
        # its gate and up projections; else None.
        self.qkv = []
        for layer in self.layers:
            a = layer.self_attn
            fused = kernels.fused_packed([a.q_proj, a.k_proj, a.v_proj])
            heads = [p.out_features // a.head_dim for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.qkv.append(None if fused is None else (*fused, heads))
        self.gate_up = [
            kernels.fused_packed([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.layers
        ]

    @classmethod
    def start(
        cls, model: torch.nn.Module, cache, prompt_mask: torch.Tensor, new_tokens: int
    ) -> LeanDecoder | None:
        """A decoder continuing from ``cache``, or None if the cache is not the expected one (per
        layer ``keys`` and ``values`` of shape (B, H_kv, P, D)) or a sliding attention window is
        narrower than the P + ``new_tokens`` positions (a wider one never acts, so it is full attention).
        ``cache`` is emptied when a decoder is returned (its tensors moved into the decoder's buffers)."""
        layers = getattr(cache, "layers", None)
        B, P = prompt_mask.shape
        base = unwrap(model)
        window = _window(base)
        if (
            window is not None and P + new_tokens > window
        ):  # a window narrower than the sequence acts
            return None
        if layers is None or len(layers) != len(_layers(base)):
            return None
        for layer in layers:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not (
                isinstance(k, torch.Tensor)
                and isinstance(v, torch.Tensor)
                and k.dim() == 4
                and k.shape[0] == B
                and k.shape[2] == P
                and v.shape[:3] == k.shape[:3]
            ):
                return None
        # Layer by layer, the prompt's keys and values move into buffers for all P + T positions and
        # leave the prompt's cache (the caller's, emptied here), so the two are never held in full together.
        # Under autocast the buffers hold its dtype: both attention functions ("eager"'s matmuls, "sdpa")
        # are autocast operators, which cast the whole cache to it at every step otherwise — once per
        # position instead, the same rounding.
        dtype = kernels.autocast_dtype(layers[0].keys.device.type)
        keys, values = [], []
        for layer in layers:
            for src, dst in ((layer.keys, keys), (layer.values, values)):
                buf = src.new_empty(
                    B, src.shape[1], P + new_tokens, src.shape[3], dtype=dtype or src.dtype
                )
                buf[:, :, :P] = src
                dst.append(buf)
            layer.keys = layer.values = None
        mask = torch.ones(B, P + new_tokens, dtype=torch.bool, device=prompt_mask.device)
        mask[:, :P] = prompt_mask.bool()
        return cls(model, keys, values, mask, P)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the next token after feeding ``tokens`` (B,) at ``positions`` (B, 1)."""
        n = self.length + 1
        capacity = self.attn_mask.shape[-1]
        if n > capacity:
            raise RuntimeError(
                f"LeanDecoder: more tokens than the {capacity} positions it was started for"
            )
        B = tokens.shape[0]
        h = self.inner.embed_tokens(tokens[:, None])  # (B, 1, C)
        cos, sin = self.inner.rotary_emb(h, positions)
        mask = self.attn_mask[..., :n]  # (B, 1, 1, n)
        for layer, kb, vb, qkv, gate_up in zip(
            self.layers, self.keys, self.values, self.qkv, self.gate_up
        ):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            if qkv is not None:
                weight, bias, heads = qkv
                q, k, v = (
                    kernels.packed_linear(x, weight, bias)
                    .view(B, 1, -1, a.head_dim)
                    .split(heads, dim=2)
                )
            else:
                shape = (B, 1, -1, a.head_dim)
                q, k, v = a.q_proj(x).view(shape), a.k_proj(x).view(shape), a.v_proj(x).view(shape)
            if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head's vector before the rotation
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            kb[:, :, n - 1 : n] = k
            vb[:, :, n - 1 : n] = v.transpose(1, 2)
            o, _ = self.attend(
                a, q, kb[:, :, :n], vb[:, :, :n], mask, dropout=0.0, scaling=a.scaling
            )
            h = h + a.o_proj(o.reshape(B, 1, -1))  # o: (B, 1, H, D)
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            if (
                gate_up is not None
            ):  # the model's MLP, down(act(gate(x)) · up(x)), with gate and up in one product
                gate, up = kernels.packed_linear(x, *gate_up).chunk(2, dim=-1)
                h = h + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                h = h + mlp(x)
        self.length = n
        return self.base.lm_head(self.inner.norm(h)[:, -1])
