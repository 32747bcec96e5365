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

**It leans on transformers' internals**, which any release may rename or change: the decoder
layers' parts (``self_attn.q_proj`` … ``mlp.down_proj``, ``head_dim``, the norms), the modeling
module's ``apply_rotary_pos_emb``, ``ALL_ATTENTION_FUNCTIONS`` and ``eager_attention_forward``,
the mask form each attention function takes, ``DynamicCache.layers[i].keys`` (which it empties).
So :func:`unsupported`, run once when an engine is built (never per token), accepts a model only
when it is one of :data:`SUPPORTED` — the architectures whose forward is known to be the lean
step's arithmetic, which no attribute check can tell — *and* every part is there, *and* each
function called on a small input answers as the lean step expects (the attention against one
computed here, with a padded position in the mask's form). Anything else is a sentence saying
why, and the engine decodes with the model's own forward. Per rollout, :func:`declined` checks what
can change in between: attention dropout in train mode, a sliding attention window narrower than
prompt and response, a prompt cache in another format.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import transformers

from proximal.models import kernels
from proximal.models.compiled import compiled_blocks
from proximal.models.loading import unwrap  # the transformers model under peft's wrapper

#: The causal-LM classes whose forward is, at a decode step, exactly :meth:`LeanDecoder.step`: the
#: embedding, then per layer ``h += attention(norm(h))`` and ``h += mlp(norm(h))``, a final norm
#: and the output layer.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: The supported architectures whose attention normalises each head's query and key before the
#: rotation (``q_norm``, ``k_norm``): without them the step would silently skip it.
HEAD_NORMS = ("Qwen3ForCausalLM",)

#: The attention implementations the lean step calls (the model's own attention function for each, from
#: its modeling module's ``ALL_ATTENTION_FUNCTIONS``), and the form of the padding mask each takes:
#: True = attend for "sdpa"; for "eager" 0 or the dtype's lowest value, added to the scores.
MASKS = {"sdpa": "bool", "eager": "additive"}

#: What the step uses of the causal LM, of its inner model, of each decoder layer, of a layer's
#: attention and MLP, and of the modeling module (``transformers.models.<arch>.modeling_<arch>``).
MODEL_PARTS = ("model", "lm_head", "config")
INNER_PARTS = ("embed_tokens", "rotary_emb", "norm", "layers")
LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
MODULE_PARTS = ("apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")


class Unsupported(Exception):
    """The lean step cannot decode a model; the message says why (a sentence)."""


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


def _require(obj, names: tuple[str, ...], owner: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise Unsupported(f"{owner} has no {name}")


def _check_parts(base: torch.nn.Module, name: str) -> None:
    """Every attribute the step reads, on the model and on each layer (Unsupported naming the first missing)."""
    _require(base, MODEL_PARTS, name)
    _require(base.model, INNER_PARTS, f"{name}.model")
    if not isinstance(getattr(base.model.embed_tokens, "weight", None), torch.Tensor):
        raise Unsupported(f"{name}.model.embed_tokens has no weight")
    layers = _layers(base)
    if not layers:
        raise Unsupported(f"{name}.model.layers is empty")
    for i, layer in enumerate(layers):
        _require(layer, LAYER_PARTS, f"layer {i}")
        a = layer.self_attn
        _require(a, ATTENTION_PARTS, f"layer {i}'s self_attn")
        if not isinstance(a.head_dim, int) or a.head_dim < 1:
            raise Unsupported(f"layer {i}'s self_attn.head_dim is {a.head_dim!r}, not a size")
        for proj in ("q_proj", "k_proj", "v_proj"):
            out = getattr(getattr(a, proj), "out_features", None)
            if not isinstance(out, int) or out % a.head_dim:
                raise Unsupported(
                    f"layer {i}'s self_attn.{proj}.out_features ({out!r}) is not a number of "
                    f"heads of head_dim {a.head_dim}"
                )
        if hasattr(a, "q_norm") != hasattr(a, "k_norm"):
            raise Unsupported(f"layer {i}'s self_attn has only one of q_norm and k_norm")
        if name in HEAD_NORMS and not hasattr(a, "q_norm"):
            raise Unsupported(f"layer {i}'s self_attn has no q_norm ({name} normalises q and k)")
        _require(layer.mlp, MLP_PARTS, f"layer {i}'s mlp")


def _mode(base: torch.nn.Module) -> str | None:
    """What can change between rollouts and rules the step out: the attention implementation, and
    attention dropout in train mode."""
    config = base.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKS:
        return f"attention implementation {impl!r} (only {', '.join(map(repr, MASKS))})"
    if getattr(config, "attention_dropout", 0.0) and any(
        layer.self_attn.training for layer in _layers(base)
    ):
        return "attention dropout in train mode"
    return None


def _functions(base: torch.nn.Module) -> tuple[Callable, Callable]:
    """The model's own ``apply_rotary_pos_emb`` and attention function (the one its config names),
    from the module its attention class is defined in."""
    where = type(_layers(base)[0].self_attn).__module__
    module = sys.modules.get(where)
    if module is None:
        raise Unsupported(f"the attention's module {where} is not loaded")
    _require(module, MODULE_PARTS, where)
    impl = base.config._attn_implementation
    try:
        attend = module.ALL_ATTENTION_FUNCTIONS.get_interface(impl, module.eager_attention_forward)
    except Exception as e:  # a changed registry: any exception means "not this way"
        raise Unsupported(
            f"{where}.ALL_ATTENTION_FUNCTIONS gives no {impl!r} function ({type(e).__name__}: {e})"
        ) from None
    if not callable(attend) or not callable(module.apply_rotary_pos_emb):
        raise Unsupported(f"{where}'s rotary or {impl!r} attention function is not callable")
    return module.apply_rotary_pos_emb, attend


def _mask_form(mask: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """The padding mask (B, 1, 1, L), True = attend, in the form ``impl``'s attention function takes:
    itself for "sdpa"; for "eager" the model's own eager mask, 0 or the lowest value of ``dtype`` (the
    hidden states'), added to the scores."""
    if MASKS[impl] == "bool":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


def cache_problem(cache, rows: int, prompt: int, layers: int) -> str | None:
    """Why ``cache`` is not the prompt's cache the step continues from (per layer ``keys`` and
    ``values`` tensors of shape (``rows``, H_kv, ``prompt``, D), one per layer), or None."""
    held = getattr(cache, "layers", None)
    if held is None:
        return f"the prompt's cache ({type(cache).__name__}) has no layers"
    if len(held) != layers:
        return f"the prompt's cache has {len(held)} layers for the model's {layers}"
    for i, layer in enumerate(held):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return f"the prompt's cache's layer {i} ({type(layer).__name__}) has no keys and values"
        if not (k.dim() == 4 and k.shape[0] == rows and k.shape[2] == prompt):
            return (
                f"the prompt's cache holds keys of shape {tuple(k.shape)}, not ({rows}, heads, "
                f"{prompt}, head_dim)"
            )
        if v.shape[:3] != k.shape[:3]:
            return (
                f"the prompt's cache holds values of shape {tuple(v.shape)}, keys {tuple(k.shape)}"
            )
    return None


@torch.no_grad()
def _probe(base: torch.nn.Module, rotate: Callable, attend: Callable) -> None:
    """Call what the step calls, as it calls it, on two rows of a few positions, and check the answers:
    the rotary embedding and ``apply_rotary_pos_emb`` keep the shapes the step reshapes; the
    attention function, with one position padded in the mask's form, gives the attention computed
    here in float64 in the (B, 1, H, D) layout the step reshapes; a ``DynamicCache`` fed one
    layer at a time holds ``layers[i].keys`` and ``.values`` as :func:`cache_problem` expects, and
    lets them go. A release that changed a signature, the mask convention or a layout is caught
    here, not only one that renamed something."""
    inner, a = base.model, _layers(base)[0].self_attn
    weight = inner.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    D = a.head_dim
    H, H_kv = a.q_proj.out_features // D, a.k_proj.out_features // D
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def failed(what: str, e: Exception) -> Unsupported:
        return Unsupported(f"{what} failed on a test input ({type(e).__name__}: {e})")

    q, k, v = randn(2, H, 1, D), randn(2, H_kv, 3, D), randn(2, H_kv, 3, D)
    try:
        h = torch.zeros(2, 1, weight.shape[1], device=device, dtype=dtype)
        cos, sin = inner.rotary_emb(h, torch.tensor([[0], [5]], device=device))
        q_rot, k_rot = rotate(q, k[:, :, :1], cos, sin)
    except Exception as e:  # whatever a changed function raises, the model's own forward decodes
        raise failed("the rotary embedding (rotary_emb, apply_rotary_pos_emb)", e) from None
    if q_rot.shape != q.shape or k_rot.shape != (2, H_kv, 1, D):
        raise Unsupported(
            f"apply_rotary_pos_emb turned q {tuple(q.shape)} and k {(2, H_kv, 1, D)} into "
            f"{tuple(q_rot.shape)} and {tuple(k_rot.shape)}"
        )

    impl = base.config._attn_implementation
    mask = torch.ones(2, 1, 1, 3, dtype=torch.bool, device=device)
    mask[1, ..., 0] = False  # row 1's first position is padding
    try:
        out, _ = attend(a, q, k, v, _mask_form(mask, impl, dtype), dropout=0.0, scaling=a.scaling)
    except Exception as e:
        raise failed(f"the {impl!r} attention function", e) from None
    n_rep = H // H_kv  # query head j reads key/value head j // n_rep (transformers' repeat_kv)
    k64, v64 = (t.double().repeat_interleave(n_rep, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(2, 3) * a.scaling).masked_fill(~mask, -torch.inf)
    want = (scores.softmax(-1) @ v64).transpose(1, 2)  # (2, 1, H, D)
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    if not (
        isinstance(out, torch.Tensor)
        and out.shape == want.shape
        and torch.allclose(out.double(), want, rtol=0, atol=tol)
    ):
        raise Unsupported(
            f"the {impl!r} attention function does not attend as expected with the padding mask "
            f"in {MASKS[impl]} form (its output {tuple(getattr(out, 'shape', ()))}, expected "
            f"{tuple(want.shape)})"
        )

    layers = len(_layers(base))
    # The class the model's own forward builds its cache from: its modeling module's (looked up
    # there, not on the ``transformers`` module object, which importing peft replaces).
    modeling = sys.modules.get(type(a).__module__)
    cache_class = getattr(modeling, "DynamicCache", None) or getattr(
        transformers, "DynamicCache", None
    )
    if cache_class is None:
        raise Unsupported("transformers has no DynamicCache")
    try:
        cache = cache_class(config=base.config)
        for i in range(layers):
            cache.update(k[:1, :, :2], v[:1, :, :2], i)
        problem = cache_problem(cache, 1, 2, layers)
        if problem is None:
            cache.layers[0].keys = cache.layers[0].values = None  # what start() does
    except Exception as e:
        raise failed("a DynamicCache", e) from None
    if problem is not None:
        raise Unsupported(problem.replace("the prompt's cache", "a DynamicCache"))


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot decode ``model`` (a sentence), or None when it can: another
    architecture (its forward may do things the step does not — Gemma scales its embeddings, GPT-2
    has absolute positions), a part or function the step uses that is missing or answers otherwise
    (the module docstring), an attention implementation other than "sdpa" and "eager" (flash
    attention takes its masks in another form), attention dropout in train mode. Called once per
    engine: it runs the model's rotary embedding and attention function on a few numbers."""
    base = unwrap(model)
    name = _architecture(base)
    if name is None:
        return f"{type(base).__name__} is not one of {', '.join(SUPPORTED)}"
    try:
        _check_parts(base, name)
        reason = _mode(base)
        if reason is not None:
            return reason
        _probe(base, *_functions(base))
    except Unsupported as e:
        return str(e)
    return None


def _window(base: torch.nn.Module) -> int | None:
    """The narrowest sliding attention window of the model's layers (None: every layer attends to all)."""
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in _layers(base)]
    if _architecture(base) == "MistralForCausalLM":  # Mistral's layers read the config's
        windows.append(getattr(base.config, "sliding_window", None))
    windows = [w for w in windows if w is not None]
    return min(windows) if windows else None


def declined(
    model: torch.nn.Module, cache, prompt_mask: torch.Tensor, new_tokens: int
) -> str | None:
    """Why this rollout's decode steps cannot go the lean way, for a model :func:`unsupported`
    accepted (a sentence), or None: what may have changed since (attention dropout in train mode,
    the attention implementation), a sliding attention window narrower than the prompt's P and
    ``new_tokens`` positions (a wider one never acts, so it is full attention), or a prompt cache
    not in the form :func:`cache_problem` expects. Cheap: once per rollout."""
    base = unwrap(model)
    reason = _mode(base)
    if reason is not None:
        return reason
    B, P = prompt_mask.shape
    window = _window(base)
    if window is not None and P + new_tokens > window:
        return f"a sliding attention window ({window} positions) narrower than prompt and response"
    return cache_problem(cache, B, P, len(_layers(base)))


class LeanDecoder:
    """Decode steps after the prompt's forward: ``step(tokens, positions)`` → the next logits.

    Built by :meth:`start` from the prompt's cache (the model's own ``DynamicCache``), the prompt's
    (B, P) padding mask and the number of tokens to come. Call it inside the same context as the
    prompt's forward (no gradients, gathered weights, autocast)."""

    def __init__(self, model: torch.nn.Module, mask: torch.Tensor, length: int):
        """Everything but the keys and values (:meth:`start` moves them in after): the model's parts
        and functions, the (B, P + T) padding ``mask`` (True = attend) in the attention's form,
        the stacked weights; ``length`` positions filled."""
        base = unwrap(model)
        self.base, self.inner, self.layers = base, base.model, _layers(base)
        # the model's own rotary arithmetic and attention
        self.rotate, self.attend = _functions(base)
        self.keys: list[torch.Tensor] = []  # per layer (B, H_kv, P + T, D), from start()
        self.values: list[torch.Tensor] = []
        self.length = length  # filled positions
        # The padding mask (B, 1, 1, P + T); for "eager" in the hidden states' dtype (no autocast on
        # embeddings).
        self.attn_mask = _mask_form(
            mask[:, None, None, :],
            base.config._attn_implementation,
            self.inner.embed_tokens.weight.dtype,
        )
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
        # The step compiles with the blocks (train.compile), unless oneDNN's packed weights are in it.
        self.compiled = compiled_blocks(base) > 0 and not any(
            p is not None for p in (*self.qkv, *self.gate_up)
        )

    @classmethod
    def start(
        cls, model: torch.nn.Module, cache, prompt_mask: torch.Tensor, new_tokens: int
    ) -> LeanDecoder | None:
        """A decoder continuing from ``cache``, or None where :func:`declined` gives a reason (the
        cache is then untouched). ``cache`` is emptied when a decoder is returned (its tensors moved
        into the decoder's buffers)."""
        if declined(model, cache, prompt_mask, new_tokens) is not None:
            return None
        B, P = prompt_mask.shape
        mask = torch.ones(B, P + new_tokens, dtype=torch.bool, device=prompt_mask.device)
        mask[:, :P] = prompt_mask.bool()
        decoder = cls(model, mask, P)  # every look-up before the cache is touched
        # Layer by layer, the prompt's keys and values move into buffers for all P + T positions and
        # leave the prompt's cache (the caller's, emptied here), so the two are never held in full together.
        # Under autocast the buffers hold its dtype: both attention functions ("eager"'s matmuls, "sdpa")
        # are autocast operators, which cast the whole cache to it at every step otherwise — once per
        # position instead, the same rounding.
        layers = cache.layers
        dtype = kernels.autocast_dtype(layers[0].keys.device.type)
        for layer in layers:
            for src, dst in ((layer.keys, decoder.keys), (layer.values, decoder.values)):
                buf = src.new_empty(
                    B, src.shape[1], P + new_tokens, src.shape[3], dtype=dtype or src.dtype
                )
                buf[:, :, :P] = src
                dst.append(buf)
            layer.keys = layer.values = None
        return decoder

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the next token after feeding ``tokens`` (B,) at ``positions`` (B, 1).

        Where the model's blocks run compiled (``train.compile``, :mod:`proximal.models.compiled`) and
        no weight is packed for oneDNN, the step itself runs compiled too — one graph for every
        position and batch (dynamic shapes), so a token costs its products and a few fused loops
        instead of some hundred small operators and the Python around them (the tiny benchmark work's
        48-token decode: 0.164 → 0.135 s). Its logits differ from eager mode's by float32 round-off."""
        n = self.length + 1
        capacity = self.attn_mask.shape[-1]
        if n > capacity:
            raise RuntimeError(
                f"LeanDecoder: more tokens than the {capacity} positions it was started for"
            )
        step = _compiled_step() if self.compiled else LeanDecoder._step
        logits = step(self, tokens, positions, n)
        self.length = n
        return logits

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`step`'s arithmetic, the ``n``-th filled position."""
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
            # the model's MLP, down(act(gate(x)) · up(x)), with gate and up in one product
            if gate_up is not None:
                gate, up = kernels.packed_linear(x, *gate_up).chunk(2, dim=-1)
                h = h + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                h = h + mlp(x)
        return self.base.lm_head(self.inner.norm(h)[:, -1])


_STEP = []  # LeanDecoder._step compiled with dynamic shapes: made once, at the first compiled decoder


def _compiled_step():
    if not _STEP:
        _STEP.append(torch.compile(LeanDecoder._step, dynamic=True))
    return _STEP[0]
