"""Token log-probabilities and entropies from logits, a slice of the sequence at a time.

Notation: B batch size, T positions (response length), V vocabulary size.

Alignment: ``logits[:, t]`` is the model's distribution for ``tokens[:, t]``. A causal LM's output
at position i predicts input i + 1, so the caller shifts once (``logits[:, :-1]`` against
``input_ids[:, 1:]``, then keeps the response columns); nothing here shifts.

Why custom autograd: with plain autograd, a chunked ``log_softmax(logits.float())`` still saves each
chunk's float32 copy for backward, so a bf16 (B, T, V) batch ends up with a float32 (B, T, V) alive
until backward — 2× the logits again, the largest tensor of a PPO step. These functions save only the
input logits (already alive, same storage) and (B, T) per-token statistics, and recompute each
chunk's softmax in backward. Peak extra memory is a few float32 chunks of about ``chunk_tokens × V``.
Double backward is not supported (nothing in PPO needs it).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from proximal.core.ranges import check
from proximal.core.stats import check_mask, masked_mean, masked_sum

DEFAULT_CHUNK_TOKENS = 1024
#: :func:`filtered_logprobs_from_logits`' blocks: the filter's sort (values and int64 indices),
#: cumulative sums and masks hold about seven floats per logit of a block at their peak (measured:
#: 665 MB over a 98 MB block), so its blocks are an eighth of the plain log-softmax's, to keep the
#: peak about the same.
REPLAY_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS // 8


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _chunks(logits: Tensor, chunk_tokens: int):
    """Slices of the sequence dimension holding about ``chunk_tokens`` (row, position) pairs each.
    Slicing dim 1 gives views, so non-contiguous logits (``out.logits[:, p:-1]``) are never copied whole."""
    B, T = logits.shape[:2]
    step = max(1, chunk_tokens // max(B, 1))
    for start in range(0, T, step):
        yield slice(start, min(start + step, T))


def _scaled(logits: Tensor, sl: slice, mask: Tensor | None, temperature: float) -> Tensor:
    """One chunk as z = logits / τ in the compute dtype, with masked rows set to 0 so garbage there
    (NaN, inf) cannot produce NaN through ``0 · NaN``."""
    z = logits[:, sl].to(_compute_dtype(logits))
    if mask is not None:
        z = torch.where(mask[:, sl, None], z, 0.0)
    return z / temperature if temperature != 1.0 else z


def _blocks(shape, chunk_tokens: int):
    """Index tuples of (rows, positions) blocks of about ``chunk_tokens`` pairs, covering (B, T).

    Each block is several whole rows ``[b0:b1]`` or a run of positions of one row ``[b, t0:t1]``, so
    its part of a contiguous (B, T, V) tensor is itself contiguous: the gradient is written into
    place, never assembled from copies."""
    B, T = shape
    if T <= chunk_tokens:
        rows = max(1, chunk_tokens // max(T, 1))
        for b0 in range(0, B, rows):
            yield (slice(b0, min(b0 + rows, B)),)
    else:
        for b in range(B):
            for t0 in range(0, T, chunk_tokens):
                yield (slice(b, b + 1), slice(t0, min(t0 + chunk_tokens, T)))


def _z(logits: Tensor, block, temperature: float) -> Tensor:
    """A block of logits / τ: the view itself at τ = 1 (in the logits' dtype: the softmax kernels
    read bfloat16 and accumulate in float32 themselves, so nothing is converted beforehand), else a
    float32 copy divided by τ. Never modified in place."""
    z = logits[block]
    if temperature == 1.0:
        return z
    return z.to(_compute_dtype(logits)) / temperature


class _Workspace:
    """Scratch tensors reused by every block of one call (a fresh large tensor per block costs page
    faults that take longer than the arithmetic)."""

    def __init__(self, like: Tensor, shape, chunk_tokens: int):
        B, T = shape
        # largest block
        pairs = min(max(1, chunk_tokens // max(T, 1)), B) * T if T <= chunk_tokens else chunk_tokens
        self.numel, self.like, self.buffers = pairs * like.shape[-1], like, {}

    def get(self, name: str, shape) -> Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = self.like.new_empty(
                self.numel, dtype=_compute_dtype(self.like)
            )
        n = 1
        for d in shape:
            n *= d
        return buf[:n].view(shape)


def _zero_masked(g: Tensor, mask: Tensor | None, block) -> None:
    """Zero the gradient rows of masked positions, in place — whatever sat there (NaN, inf) never
    reaches the result. Skipped when the block has no masked position."""
    if mask is not None:
        m = mask[block]
        if not bool(m.all()):
            g.masked_fill_(~m[..., None], 0.0)


def _log_softmax(z: Tensor, ws: _Workspace) -> Tensor:
    """log softmax(z) over the vocabulary in the compute dtype, in a workspace buffer. A bfloat16
    block is first copied into the workspace (``log_softmax(dtype=float32)`` would convert into a
    fresh tensor every time), then transformed in place."""
    out = ws.get("logp", z.shape)
    if z.dtype != out.dtype:
        return torch.log_softmax(out.copy_(z), dim=-1, out=out)
    return torch.log_softmax(z, dim=-1, out=out)


def _add_at(g: Tensor, tokens: Tensor, values: Tensor) -> None:
    """g[..., tokens] += values for a contiguous (b, t, V) block, through flat indices: one element per
    position (``scatter_add_`` on bfloat16 converts the whole block to float32 and back)."""
    V = g.shape[-1]
    pos = torch.arange(tokens.numel(), device=g.device) * V + tokens.reshape(-1)
    g.view(-1).index_put_((pos,), values.reshape(-1).to(g.dtype), accumulate=True)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z)[y] a block at a time; optionally also the entropy of softmax(z) (not
    differentiated: for logging), from the same pass over the logits.

    Masked positions are computed like the others (their rows may hold garbage) and then discarded:
    the outputs there are set to 0 and their gradient rows zeroed, so nothing read there can leak,
    and no pass over the logits is spent on masking them beforehand."""

    @staticmethod
    def forward(ctx, logits, tokens, mask, temperature, chunk_tokens, with_entropy):
        shape = logits.shape[:2]
        lp = logits.new_empty(shape, dtype=_compute_dtype(logits))
        ent = torch.empty_like(lp) if with_entropy else None
        # -100 etc. never indexes
        safe_tokens = tokens if mask is None else torch.where(mask, tokens, 0)
        ws = _Workspace(logits, shape, chunk_tokens)
        floor = torch.finfo(lp.dtype).min
        for block in _blocks(shape, chunk_tokens):
            z = _z(logits, block, temperature)  # (b, t, V)
            logp = _log_softmax(z, ws)  # one fused kernel (torch.logsumexp is slower)
            lp[block] = logp.gather(-1, safe_tokens[block][..., None]).squeeze(-1)
            if with_entropy:  # H = −Σ p log p, with 0·log 0 = 0 for banned (−inf) tokens
                logp.clamp_(min=floor)
                p = torch.exp(logp, out=ws.get("p", z.shape))
                ent[block] = -torch.einsum("btv,btv->bt", p, logp)
        ctx.save_for_backward(logits, safe_tokens, mask)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if mask is not None:
            lp = torch.where(mask, lp, 0.0)
            ent = torch.where(mask, ent, 0.0) if with_entropy else None
        if not with_entropy:
            return lp, None
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        logits, tokens, mask = ctx.saved_tensors
        tau = ctx.temperature
        g_out = grad_out if mask is None else torch.where(mask, grad_out, 0.0)
        # The gradient is in the logits' dtype; softmax is computed in float32 and written into it
        # block by block (for bfloat16 logits the products below then run in bfloat16, whose
        # resolution the gradient has anyway).
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # contiguous
        ws = _Workspace(logits, logits.shape[:2], ctx.chunk_tokens)
        for block in _blocks(logits.shape[:2], ctx.chunk_tokens):
            z = _z(logits, block, tau)
            # else (bfloat16 logits at τ ≠ 1) through a float32 workspace
            direct = z.dtype == grad.dtype
            # d(z_y − lse)/dz = onehot(y) − softmax(z); then d/dlogits = d/dz / τ.
            g = torch.softmax(z, dim=-1, out=grad[block] if direct else ws.get("g", z.shape))
            _zero_masked(g, mask, block)
            go = g_out[block]
            g.mul_(-go[..., None].to(g.dtype))
            _add_at(g, tokens[block], go)
            if tau != 1.0:
                g.div_(tau)
            if not direct:
                grad[block] = g
        return grad, None, None, None, None, None


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, mask, temperature, chunk_tokens):
        shape = logits.shape[:2]
        ent = logits.new_empty(shape, dtype=_compute_dtype(logits))
        ws = _Workspace(logits, shape, chunk_tokens)
        floor = torch.finfo(ent.dtype).min
        for block in _blocks(shape, chunk_tokens):
            z = _z(logits, block, temperature)
            # H = −Σ p log p, with 0·log 0 = 0 for banned (−inf) tokens
            logp = _log_softmax(z, ws).clamp_(min=floor)
            ent[block] = -torch.einsum(
                "btv,btv->bt", torch.exp(logp, out=ws.get("p", z.shape)), logp
            )
        ctx.save_for_backward(logits, mask, ent)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return ent if mask is None else torch.where(mask, ent, 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, mask, entropy = ctx.saved_tensors
        tau = ctx.temperature
        g_out = grad_out if mask is None else torch.where(mask, grad_out, 0.0)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        direct = grad.dtype == _compute_dtype(logits)
        ws = _Workspace(logits, logits.shape[:2], ctx.chunk_tokens)
        floor = torch.finfo(_compute_dtype(logits)).min
        for block in _blocks(logits.shape[:2], ctx.chunk_tokens):
            z = _z(logits, block, tau)
            logp = _log_softmax(z, ws).clamp_(min=floor)
            # dH/dz_j = −p_j (log p_j + H); p_j = 0 (banned) contributes 0, not 0·(−inf)
            g = torch.exp(logp, out=grad[block] if direct else ws.get("g", z.shape))
            g.mul_(logp.add_(entropy[block][..., None]))
            _zero_masked(g, mask, block)
            g.mul_(-g_out[block][..., None].to(g.dtype))
            if tau != 1.0:
                g.div_(tau)
            if not direct:
                grad[block] = g
        return grad, None, None, None


def _check(logits: Tensor, mask: Tensor | None, temperature: float, chunk_tokens: int) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    check("temperature", temperature)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = real token), got dtype {mask.dtype}"
            )
        if mask.shape != logits.shape[:2]:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} does not match logits (B, T) "
                f"{tuple(logits.shape[:2])}"
            )


def filter_logits(z: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to −inf every logit outside the top-k and outside the nucleus of probability ``top_p``
    (Holtzman et al. 2020; the token that crosses ``top_p`` is kept, as in ``transformers`` and
    vLLM): the support an engine samples from. (..., V); ``z`` itself when neither filter is on.

    The nucleus is taken after top-k: the smallest set of the most likely tokens whose probability
    under softmax(top-k-filtered z) reaches ``top_p``. Ties at the top-k boundary are all kept."""
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = torch.where(z < kth, -torch.inf, z)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, before >= top_p)
        z = torch.where(drop, -torch.inf, z)
    return z


def truncates(top_k: int, top_p: float) -> bool:
    """Whether ``top_k`` / ``top_p`` truncate the distribution at all (top_k > 0 or top_p < 1)."""
    return top_k > 0 or top_p < 1.0


def _kept_lse(logp: Tensor, tokens: Tensor, top_k: int, top_p: float) -> Tensor:
    """log Σ_{v ∈ K} p_v, K = :func:`filter_logits`'s kept set of ``logp`` ∪ {the token}, from a
    block of full log-probabilities ``logp`` (b, t, V) (the filter sees softmax(logp) =
    softmax(z): the same set). (b, t). The set is a choice, not a function to differentiate.
    Without a filter, exactly 0: the replay is then log softmax(z)[y] to the bit."""
    if not truncates(top_k, top_p):
        return logp.new_zeros(logp.shape[:-1])
    kept = filter_logits(logp, top_k, top_p)
    # the sampled token always counts, so its log-probability is finite even where this model's
    # own filter would have dropped it (another engine, other numerics)
    kept = kept.scatter(-1, tokens[..., None], logp.gather(-1, tokens[..., None]))
    return torch.logsumexp(kept, dim=-1)


class _FilteredTokenLogprobs(torch.autograd.Function):
    """log softmax over K of z at y (the filter's replay) and log softmax(z)[y] (the full one), a
    block at a time from one log-softmax per block; optionally the full entropy (not
    differentiated). The kept set is recomputed in backward from the saved logits (the same
    deterministic choice), so nothing (B, T, V) is saved beyond the logits themselves."""

    @staticmethod
    def forward(ctx, logits, tokens, mask, temperature, top_k, top_p, chunk_tokens, with_entropy):
        shape = logits.shape[:2]
        full = logits.new_empty(shape, dtype=_compute_dtype(logits))
        lse_kept = torch.empty_like(full)
        ent = torch.empty_like(full) if with_entropy else None
        safe_tokens = tokens if mask is None else torch.where(mask, tokens, 0)
        ws = _Workspace(logits, shape, chunk_tokens)
        floor = torch.finfo(full.dtype).min
        for block in _blocks(shape, chunk_tokens):
            z = _z(logits, block, temperature)  # (b, t, V)
            logp = _log_softmax(z, ws)
            y = safe_tokens[block]
            full[block] = logp.gather(-1, y[..., None]).squeeze(-1)
            lse_kept[block] = _kept_lse(logp, y, top_k, top_p)  # log of the kept mass, ≤ 0
            if with_entropy:
                logp.clamp_(min=floor)
                p = torch.exp(logp, out=ws.get("p", z.shape))
                ent[block] = -torch.einsum("btv,btv->bt", p, logp)
        ctx.save_for_backward(logits, safe_tokens, mask)
        ctx.settings = (temperature, top_k, top_p, chunk_tokens)
        filtered = full - lse_kept
        if mask is not None:
            filtered, full = torch.where(mask, filtered, 0.0), torch.where(mask, full, 0.0)
            ent = torch.where(mask, ent, 0.0) if with_entropy else None
        if with_entropy:
            ctx.mark_non_differentiable(ent)
        return filtered, full, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_filtered, grad_full, _grad_entropy):
        logits, tokens, mask = ctx.saved_tensors
        tau, top_k, top_p, chunk_tokens = ctx.settings
        zeros = None
        if grad_filtered is None or grad_full is None:
            zeros = torch.zeros(
                logits.shape[:2], dtype=_compute_dtype(logits), device=logits.device
            )
        g_f = zeros if grad_filtered is None else grad_filtered
        g_a = zeros if grad_full is None else grad_full
        if mask is not None:
            g_f, g_a = torch.where(mask, g_f, 0.0), torch.where(mask, g_a, 0.0)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        ws = _Workspace(logits, logits.shape[:2], chunk_tokens)
        for block in _blocks(logits.shape[:2], chunk_tokens):
            z = _z(logits, block, tau)
            logp = _log_softmax(z, ws)
            y = tokens[block]
            lse = _kept_lse(logp, y, top_k, top_p)
            # d(z_y − lse_K)/dz = onehot(y) − p^K (p^K = p / kept mass on K, 0 off it);
            # d(z_y − lse)/dz = onehot(y) − p. Then d/dlogits = d/dz / τ.
            kept = filter_logits(logp, top_k, top_p).scatter(
                -1, y[..., None], logp.gather(-1, y[..., None])
            )
            p_kept = torch.exp(kept - lse[..., None])  # 0 outside K (exp(−inf))
            gf, ga = g_f[block][..., None], g_a[block][..., None]
            g = torch.exp(logp).mul_(-ga).sub_(p_kept.mul_(gf))
            _zero_masked(g, mask, block)
            _add_at(g, y, g_f[block] + g_a[block])
            if tau != 1.0:
                g.div_(tau)
            grad[block] = g
        return grad, None, None, None, None, None, None, None


def filtered_logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    mask: Tensor | None = None,
    chunk_tokens: int = REPLAY_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """The replay of an engine's top-k / top-p filter in the trainer: the log-probability of each
    token under the truncated, renormalised distribution it was drawn from,

        log π^f(y_t | s_t) = z_y / τ − log Σ_{v ∈ K_t} exp(z_v / τ),
        K_t = {the kept set of :func:`filter_logits`(z / τ, top_k, top_p)} ∪ {y_t},

    and, from the same pass, the full log softmax(z_t / τ)[y_t] (:func:`logprobs_from_logits`) —
    what the KL terms and the entropy use: they compare policies, not sampling procedures.

    K_t is the filter applied to *this* model's logits, so π_old^f and π_θ^f are each truncated to
    their own support, as an engine holding those weights would sample. The sampled token is always
    in K_t: a token this model's filter would drop (drawn by an engine whose numerics put it just
    inside the nucleus) keeps a finite log-probability — its mass joins the normaliser — instead of
    −inf, which would make every ratio to it 0 or NaN. K_t is chosen without gradient (a set); the
    gradient of log π^f reaches only the logits in K_t: ∂/∂z_v = (1[v = y] − π^f_v)/τ for v ∈ K_t, 0
    outside. log π^f ≥ log softmax(z/τ)[y], equal (to the bit) without a filter (top_k = 0, top_p = 1).

    Chunked like :func:`logprobs_from_logits` (its module docstring): the logits and (B, T)
    statistics are saved for backward; the filter (a sort over V) runs per block, in forward and
    again in backward, so the extra memory is a few blocks of ``chunk_tokens × V`` (about seven
    floats per logit of a block, hence the smaller default, :data:`REPLAY_CHUNK_TOKENS`).

    Args:
        logits: (B, T, V), any float dtype; ``logits[:, t]`` scores ``tokens[:, t]``.
        tokens: (B, T) token ids.
        temperature: τ > 0, dividing the logits before the filter (as the engines do).
        top_k: keep the k most likely (0 = all). top_p: keep the nucleus of that mass (1 = all).
        mask: optional bool (B, T); where False both results are 0, nothing there is read, and the
            gradient is 0.
        chunk_tokens: about how many (row, position) pairs are expanded to V floats at once.
        with_entropy: also the entropy of the full softmax(logits / τ), not differentiated.

    Returns:
        ``(filtered, full)`` (B, T) float32 (float64 for float64 logits), both differentiable; with
        ``with_entropy``, ``(filtered, full, entropy)``.
    """
    _check(logits, mask, temperature, chunk_tokens)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} does not match logits (B, T) "
            f"{tuple(logits.shape[:2])}"
        )
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"top_k = {top_k} must be ≥ 0 and top_p = {top_p} in (0, 1]")
    filtered, full, ent = _FilteredTokenLogprobs.apply(
        logits,
        tokens.long(),
        mask,
        float(temperature),
        int(top_k),
        float(top_p),
        int(chunk_tokens),
        bool(with_entropy),
    )
    return (filtered, full, ent) if with_entropy else (filtered, full)


def logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(y_t | s_t) = log softmax(logits_t / τ)[y_t] for each position — the policy
    π_θ(a_t | s_t) = P(y_t | x, y_<t) of docs/formulas.md, "The MDP of autoregressive generation",
    evaluated on the sampled tokens (and the clipped surrogate's log π_θ, log π_old).

    Equal to ``torch.log_softmax(logits / τ, -1).gather(-1, tokens[..., None]).squeeze(-1)``, but no
    full-vocabulary float32 tensor of the whole batch is created or kept for backward (module
    docstring). Temperature divides the logits *before* the log-softmax, matching how the tokens were
    sampled; pass the sampling temperature.

    Args:
        logits: (B, T, V), any float dtype; ``logits[:, t]`` scores ``tokens[:, t]`` (caller shifts).
        tokens: (B, T) integer token ids.
        temperature: τ > 0.
        mask: optional bool (B, T). Where False the result is 0, and neither the token id there
            (e.g. -100) nor the logits there (even NaN) are read; their gradient is exactly 0.
        chunk_tokens: about how many (row, position) pairs are expanded to V floats at once.
        with_entropy: also return the per-position entropy of softmax(logits / τ) (as
            :func:`token_entropy`), computed in the same pass over the logits and **not
            differentiated** — for logging it when no loss uses it.

    Returns:
        (B, T) log-probabilities in float32 (float64 if the logits are float64); with
        ``with_entropy``, ``(logprobs, entropy)``.

    Only the valid positions are read (gathered a chunk of rows at a time), so padding costs nothing.
    """
    _check(logits, mask, temperature, chunk_tokens)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} does not match logits (B, T) "
            f"{tuple(logits.shape[:2])}"
        )
    out, entropy = _TokenLogprobs.apply(
        logits, tokens.long(), mask, float(temperature), int(chunk_tokens), bool(with_entropy)
    )
    return (out, entropy) if with_entropy else out


def token_entropy(
    logits: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Per-position entropy S[π](s_t) = −Σ_a π(a|s_t) log π(a|s_t) of softmax(logits_t / τ) (the
    entropy bonus of Schulman et al. 2017).

    Args:
        logits: (B, T, V), any float dtype.
        temperature: τ > 0 (the policy is the tempered distribution the tokens were sampled from).
        mask: optional bool (B, T); where False the result is 0 and the logits there are not read.
        chunk_tokens: about how many (row, position) pairs are expanded to V floats at once.

    Returns:
        (B, T) entropies in nats, float32 (float64 for float64 logits).
    """
    _check(logits, mask, temperature, chunk_tokens)
    return _TokenEntropy.apply(logits, mask, float(temperature), int(chunk_tokens))


def token_kl(
    logits: Tensor,
    ref_logits: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """The exact per-position KL(π(·|s_t) ‖ π_ref(·|s_t)) = Σ_a π(a|s_t)·(log π(a|s_t) − log π_ref(a|s_t)),
    summed over the whole vocabulary (not a sampled-token estimate like :func:`~proximal.core.kl_penalty`).

    For monitoring — how far a policy trained offline (DPO, SimPO) has moved from where it started, on
    held-out responses. A slice of the sequence at a time, so no two full (B, T, V) float32
    distributions exist at once; plain autograd (use it under ``torch.no_grad()``: nothing trains on it).

    Args:
        logits: (B, T, V) of the policy; ``logits[:, t]`` is π(·|s_t) (the caller shifts).
        ref_logits: (B, T, V) of the reference, aligned with ``logits``.
        temperature: τ > 0, dividing both.
        mask: optional bool (B, T); where False the result is 0 and neither input is read there.
        chunk_tokens: see :func:`logprobs_from_logits`.

    Returns:
        (B, T) in nats, float32 (float64 for float64 logits); ≥ 0 up to round-off, +inf where π_ref
        gives probability 0 to a token π does not.
    """
    _check(logits, mask, temperature, chunk_tokens)
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits shape {tuple(ref_logits.shape)} != logits shape {tuple(logits.shape)}"
        )
    out = logits.new_zeros(logits.shape[:2], dtype=_compute_dtype(logits))
    for sl in _chunks(logits, chunk_tokens):
        logp = torch.log_softmax(_scaled(logits, sl, mask, temperature), -1)  # (B, c, V)
        logq = torch.log_softmax(_scaled(ref_logits, sl, mask, temperature).to(logp.dtype), -1)
        p = torch.exp(logp)
        # 0·log 0 = 0 for banned tokens
        out[:, sl] = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)
    return out if mask is None else torch.where(mask, out, 0.0)


def sequence_logprobs(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor,
    average: bool = False,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """The log-likelihood of each row's response, log π(y | x) = Σ_t log π(y_t | x, y_<t), summed over
    the response tokens only — or, with ``average``, divided by their number |y| (SimPO's
    length-normalised (1/|y|)·log π(y | x), Meng et al. 2024, eq. 4; IPO's normalisation).

    DPO's implicit reward (Rafailov et al. 2023, eq. 5) is built from the sums; the prompt and the
    padding are excluded by ``mask``. Alignment is that of :func:`logprobs_from_logits`:
    ``logits[:, t]`` scores ``labels[:, t]``; for a causal LM pass ``out.logits[:, :-1]``,
    ``input_ids[:, 1:]`` and ``response_mask[:, 1:]``. Temperature 1: the model's own likelihood.

    Args:
        logits: (B, L, V), any float dtype.
        labels: (B, L) token ids; never read where ``mask`` is False.
        mask: bool (B, L), True = a response token (its EOS included) whose log-probability counts.
        average: divide each row's sum by its number of True positions.
        chunk_tokens: see :func:`logprobs_from_logits` (the same memory-light log-softmax).

    Returns:
        (B,) in float32 (float64 for float64 logits).

    Raises:
        ValueError: with ``average``, a row with no True position (its mean is undefined). A sum over
            no token is 0, which no caller wants either; the data layer never makes such a row.
    """
    check_mask(labels, mask)
    per_token = logprobs_from_logits(logits, labels, mask=mask, chunk_tokens=chunk_tokens)  # (B, L)
    return masked_mean(per_token, mask, dim=1) if average else masked_sum(per_token, mask, dim=1)
