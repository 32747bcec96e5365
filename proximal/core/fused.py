"""Token log-probabilities, entropies and KL from the last hidden states and the LM head, a tile of
(tokens × vocabulary) at a time, so that no logits tensor of the batch ever exists.

Notation: B batch size, T positions, H hidden size, V vocabulary size, N the valid (mask True)
positions of the batch; a chunk is n rows (tokens), a block Vb columns (vocabulary entries), and a
tile (n, Vb) holds at most ``chunk_elements`` elements (:func:`_tiles`).

The logits path (:mod:`proximal.core.logprobs`) takes ``logits = head(hidden)``: a (B, T, V) tensor,
10 GB in float32 for 16 × 1,024 tokens at V = 151,936, and the same again as its gradient. Here the
head's matrix product is part of the computation:

    raw = h Wᵀ + b                 (n, Vb)  in ``matmul_dtype``
    ℓ   = c · tanh(raw / c)        (Gemma-2's final-logit soft-capping, when ``softcap`` = c is given)
    z   = float(ℓ) / τ
    log π(y | s) = z_y − logsumexp(z),   S = −Σ_v p_v log p_v = lse − E_p[z],   p = softmax(z)

Forward runs over a chunk's vocabulary blocks with an online logsumexp (running max m, running
Σ exp(z − m), and for the entropy Σ exp(z − m)·(z − m)), picks z_y from the block holding y, and
keeps only (N,) statistics: lse, and S when differentiated. Backward recomputes each tile's z and
forms its gradient G = ∂L/∂raw (n, Vb) in place from p = exp(z − lse),

    ∂L/∂z = g_lp · (onehot(y) − p) − g_S · p ⊙ (z − lse + S)
    ∂L/∂raw = ∂L/∂z / τ ⊙ (1 − tanh²(raw / c))        (the last factor only with soft-capping)

then ``∂L/∂h += G W_blk`` for the chunk, ``∂L/∂W[blk] (+)= Gᵀ h`` (the block's own rows, written by
the first chunk and added to by the others) and ``∂L/∂b[blk] (+)= Σ_rows G`` — the head's gradient
in float32. A chunk reads the (V, H) weight once, so a pass over N tokens reads it ⌈N / n⌉ times
(once for N ≤ n: 2,048 tokens at the default budget), not N / (chunk_elements / V) times as a chunk
of whole rows of V would. Peak extra memory is a few (n, Vb) buffers, reused by every tile, plus the
(V, H) float32 ∂L/∂W: independent of B·T, and of V through the element budget. Double backward is
not supported (nothing trains through a gradient).

Alignment is that of :mod:`proximal.core.logprobs`: ``hidden[:, t]`` scores ``tokens[:, t]``; the
caller shifts. Masked positions are never read (their hidden states may be NaN, their token ids
-100): the valid rows are gathered once to (N, H), and their results scattered back with 0 elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from proximal.core.ranges import check
from proximal.core.stats import check_mask, masked_mean, masked_sum

#: elements of one (tokens × vocabulary) tile materialised at once: 2²³ is 32 MiB per float32 buffer.
DEFAULT_CHUNK_ELEMENTS = 2**23
#: the narrowest vocabulary block worth tiling with: a chunk has ``chunk_elements // BLOCK_MIN`` rows
#: (2,048 at the default budget) and blocks of ``chunk_elements // rows`` columns. 4,096 keeps each
#: block's product (n × 4,096 × H) large enough to run at the matrix unit's speed and the per-block
#: work (a dozen small (n,) operations) negligible — 37 blocks at V = 151,936 — while a pass over
#: 2,048 tokens reads the head's weight once. A vocabulary up to this size is one block (whole rows).
BLOCK_MIN = 4096


def _tiles(chunk_elements: int, V: int, N: int) -> tuple[int, int]:
    """(rows, cols) of a tile: rows = min(N, chunk_elements // min(V, BLOCK_MIN)) (at least 1),
    cols = the widest block of ⌈V / (chunk_elements // rows)⌉ equal ones, so rows · cols ≤
    chunk_elements (when chunk_elements ≥ rows; else one column)."""
    rows = max(1, min(N, chunk_elements // min(V, BLOCK_MIN)))
    width = max(1, chunk_elements // rows)
    return rows, -(-V // -(-V // width))


def _no_autocast(t: Tensor):
    """Autocast off inside forward and backward: the matrix products run in the dtype the caller
    chose (``matmul_dtype``), not in whatever an enclosing ``torch.autocast`` would pick."""
    return torch.autocast(t.device.type, enabled=False)


class _Buffers:
    """Scratch tensors, one per name, reused by every tile of one call (a fresh large tensor per tile
    costs page faults that take longer than the arithmetic). A tile buffer holds rows · cols
    elements; a smaller tile (a short last chunk or block) is a contiguous prefix of it."""

    def __init__(self, rows: int, cols: int, like: Tensor):
        self.rows, self.cols, self.like, self.buffers = rows, cols, like, {}

    def fixed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = self.like.new_empty(shape, dtype=dtype)
        return buf

    def tile(self, name: str, n: int, vb: int, dtype: torch.dtype) -> Tensor:
        return self.fixed(name, (self.rows * self.cols,), dtype)[: n * vb].view(n, vb)

    def row(self, name: str, n: int, dtype: torch.dtype) -> Tensor:
        """An (n,) per-token statistic of the current chunk."""
        return self.fixed(name, (self.rows,), dtype)[:n]


def _blocks(V: int, cols: int):
    return [(v, min(v + cols, V)) for v in range(0, V, cols)]


def _in_block(y: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """(whether each row's token lies in [v0, v1), its column there clamped into the block)."""
    return (y >= v0) & (y < v1), (y - v0).clamp_(0, v1 - v0 - 1)


class _Head:
    """The LM head cast once per call to the matmul dtype, and a tile's z = softcap(h Wᵀ + b) / τ."""

    def __init__(self, weight, bias, matmul_dtype, temperature, softcap, compute_dtype=None):
        self.mdt = matmul_dtype
        self.cdt = compute_dtype or torch.promote_types(matmul_dtype, torch.float32)
        self.w = weight.to(matmul_dtype)  # (V, H); the weight itself when it already is that dtype
        self.b = None if bias is None else bias.to(matmul_dtype)
        self.tau, self.cap = temperature, softcap
        self.V = weight.shape[0]

    def z(self, h: Tensor, ws: _Buffers, v0: int, v1: int, name: str = "") -> Tensor:
        """z for a chunk h (n, H) of hidden states in the matmul dtype and the vocabulary block
        [v0, v1): (n, v1 − v0) in the compute dtype, in a workspace buffer (computed identically in
        forward and backward)."""
        n, vb, wt = h.shape[0], v1 - v0, self.w[v0:v1].t()
        b = None if self.b is None else self.b[v0:v1]
        raw = ws.tile("raw" + name, n, vb, self.mdt)
        if self.mdt != self.cdt:  # bf16 logits, as the logits path has them, then float32
            if b is None:
                torch.mm(h, wt, out=raw)
            else:
                torch.addmm(b, h, wt, out=raw)
            z = ws.tile("z" + name, n, vb, self.cdt).copy_(raw)
            if self.cap is not None:
                z.div_(self.cap)
            elif self.tau != 1.0:
                z.div_(self.tau)
        else:  # the product's α, β scale by 1/c (soft-capping) or 1/τ: one pass over (n, Vb) fewer
            a = 1.0 / (self.cap if self.cap is not None else self.tau)
            if b is not None:
                torch.addmm(b, h, wt, beta=a, alpha=a, out=raw)
            elif a != 1.0:  # β = 0: the buffer's old contents are not read
                torch.addmm(raw, h, wt, beta=0.0, alpha=a, out=raw)
            else:
                torch.mm(h, wt, out=raw)
            z = raw
        if self.cap is not None:  # z = c · tanh(raw / c) / τ
            z.tanh_().mul_(self.cap / self.tau)
        return z


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(z)[y] for N gathered positions, a tile of (rows × cols) at a time; optionally the
    entropy of softmax(z) from the same pass, differentiated only with ``entropy_grad``.

    Inputs: h (N, H) in the matmul dtype, the head's weight (V, H) and bias (V,) in their own dtypes
    (cast once per call here, so the gradients come back in theirs), y (N,) int64."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, temperature, softcap, with_entropy, entropy_grad, tiles):
        ctx.set_materialize_grads(False)
        N = h.shape[0]
        rows, cols = tiles
        with _no_autocast(h):
            head = _Head(weight, bias, h.dtype, temperature, softcap)
            cdt, V = head.cdt, head.V
            lp = h.new_empty(N, dtype=cdt)
            lse = torch.empty_like(lp)
            ent = torch.empty_like(lp) if with_entropy else None
            ws = _Buffers(min(rows, N), cols, h)
            floor = torch.finfo(cdt).min
            for s in range(0, N, rows):
                e = min(s + rows, N)
                n, hc, yc = e - s, h[s:e], y[s:e]
                # running max (finite: a block of banned −inf logits leaves it at `floor`, so no
                # −inf − −inf), Σ exp(z − m), and for the entropy Σ exp(z − m)·(z − m)
                m = ws.row("m", n, cdt).fill_(floor)
                tot = ws.row("tot", n, cdt).zero_()
                t = ws.row("t", n, cdt).zero_() if with_entropy else None
                zy = lp[s:e]
                for v0, v1 in _blocks(V, cols):
                    z = head.z(hc, ws, v0, v1)
                    inb, col = _in_block(yc, v0, v1)
                    zy.copy_(torch.where(inb, z.gather(1, col[:, None]).squeeze(1), zy))
                    m_new = torch.maximum(m, torch.amax(z, 1))
                    shift = m - m_new  # ≤ 0
                    alpha = torch.exp(shift)
                    d = z.sub_(m_new[:, None])  # z − m_new, in place
                    if with_entropy:  # 0·log 0 = 0 for banned (−inf) tokens: −inf → floor
                        d.clamp_(min=floor)
                        p = torch.exp(d, out=ws.tile("p", n, v1 - v0, cdt))
                        # Σ e^{z − m_new}(z − m_new) = α (t + shift · tot) + this block's
                        t.addcmul_(shift, tot).mul_(alpha).add_(torch.einsum("nv,nv->n", p, d))
                        tot.mul_(alpha).add_(p.sum(1))
                    else:
                        tot.mul_(alpha).add_(d.exp_().sum(1))
                    m.copy_(m_new)
                log_tot = torch.log(tot)
                torch.add(log_tot, m, out=lse[s:e])
                zy.sub_(lse[s:e])
                if with_entropy:  # S = lse − E_p[z] = log tot − t / tot
                    torch.sub(log_tot, t / tot, out=ent[s:e])
        ctx.save_for_backward(h, weight, bias, y, lse, ent if entropy_grad else None)
        ctx.temperature, ctx.softcap, ctx.tiles = temperature, softcap, tiles
        ctx.entropy_grad = entropy_grad
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, y, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tau, cap, (rows, cols) = ctx.temperature, ctx.softcap, ctx.tiles
        if not ctx.entropy_grad:
            g_ent = None
        N, H = h.shape
        with _no_autocast(h):
            head = _Head(weight, bias, h.dtype, tau, cap)
            mdt, cdt, V = head.mdt, head.cdt, head.V
            if g_lp is None:
                g_lp = h.new_zeros(N, dtype=cdt)
            dh = h.new_empty(N, H) if need_h else None  # contiguous; rows written chunk by chunk
            # the first chunk writes each block's rows of ∂L/∂W and ∂L/∂b, the others add to them
            dw = (h.new_empty if N else h.new_zeros)(V, H, dtype=cdt) if need_w else None
            db = (h.new_empty if N else h.new_zeros)(V, dtype=cdt) if need_b else None
            ws = _Buffers(min(rows, N), cols, h)
            floor = torch.finfo(cdt).min
            for s in range(0, N, rows):
                e, n = min(s + rows, N), min(rows, N - s)
                hc, yc, lse_c = h[s:e], y[s:e], lse[s:e, None]
                go = g_lp[s:e] / tau  # ∂z/∂ℓ = 1/τ, folded into the (n,) factors
                if g_ent is not None:
                    g_s, ent_c = g_ent[s:e, None] / tau, ent[s:e, None]
                # ∂L/∂h of the chunk, summed over the blocks in the compute dtype: dh's own rows
                # when that is it, else a float32 accumulator of the blocks' bf16 products
                dh_c = None
                if need_h:
                    dh_c = dh[s:e] if mdt == cdt else ws.fixed("dh", (ws.rows, H), cdt)[:n]
                for i, (v0, v1) in enumerate(_blocks(V, cols)):
                    vb = v1 - v0
                    z = head.z(hc, ws, v0, v1)
                    if g_ent is not None:
                        # −g_S · p ⊙ (log p + S); p = 0 (banned) gives 0, not 0 · (−inf)
                        logp = torch.sub(z, lse_c, out=ws.tile("logp", n, vb, cdt))
                        g = torch.exp(logp.clamp_(min=floor), out=ws.tile("g", n, vb, cdt))
                        logp.add_(ent_c).mul_(g)
                        g.mul_(-go[:, None]).addcmul_(logp, g_s, value=-1.0)
                    else:
                        g = torch.sub(z, lse_c, out=ws.tile("g", n, vb, cdt)).exp_()
                        g.mul_(-go[:, None])
                    inb, col = _in_block(yc, v0, v1)  # + g_lp · onehot(y): ∂L/∂ℓ done
                    g.scatter_add_(1, col[:, None], torch.where(inb, go, 0.0)[:, None])
                    if cap is not None:  # ∂ℓ/∂raw = 1 − tanh²(raw / c); tanh(raw / c) = z τ / c
                        g.addcmul_(g, z.square_(), value=-((tau / cap) ** 2))
                    # g is ∂L/∂raw (n, Vb) in the compute dtype; the products run in the matmul dtype
                    if need_b:
                        if s == 0:
                            torch.sum(g, 0, out=db[v0:v1])
                        else:
                            db[v0:v1].add_(torch.sum(g, 0, out=ws.fixed("db", (cols,), cdt)[:vb]))
                    gm = g if mdt == cdt else ws.tile("gm", n, vb, mdt).copy_(g)
                    w_blk = head.w[v0:v1]
                    if need_h:
                        if mdt != cdt:  # a bfloat16 product, accumulated in float32
                            prod = torch.mm(gm, w_blk, out=ws.fixed("dhm", (ws.rows, H), mdt)[:n])
                            if i == 0:
                                dh_c.copy_(prod)
                            else:
                                dh_c.add_(prod)
                        elif i == 0:
                            torch.mm(gm, w_blk, out=dh_c)
                        else:
                            dh_c.addmm_(gm, w_blk)
                    if need_w:
                        dw_blk = dw[v0:v1]  # the block's rows: contiguous
                        if mdt != cdt:
                            prod = torch.mm(gm.t(), hc, out=ws.fixed("dwm", (cols, H), mdt)[:vb])
                            if s == 0:
                                dw_blk.copy_(prod)
                            else:
                                dw_blk.add_(prod)
                        elif s == 0:
                            torch.mm(gm.t(), hc, out=dw_blk)
                        else:
                            dw_blk.addmm_(gm.t(), hc)
                if need_h and mdt != cdt:
                    dh[s:e].copy_(dh_c)
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            *([None] * 6),
        )


def _check_head(name: str, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    if hidden.dim() != 3:
        raise ValueError(f"{name}hidden must be (B, T, H), got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"{name}hidden must be floating point, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{name}weight must be (V, H) with H = {hidden.shape[-1]} ({name}hidden's last "
            f"dimension), got shape {tuple(weight.shape)}"
        )
    if not weight.is_floating_point():
        raise ValueError(f"{name}weight must be floating point, got {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(
            f"{name}weight is on {weight.device} but {name}hidden is on {hidden.device}"
        )
    if bias is not None:
        if bias.shape != weight.shape[:1]:
            raise ValueError(
                f"{name}bias must be (V,) = ({weight.shape[0]},), got shape {tuple(bias.shape)}"
            )
        if not bias.is_floating_point() or bias.device != weight.device:
            raise ValueError(
                f"{name}bias must be floating point on {weight.device}, got {bias.dtype} on "
                f"{bias.device}"
            )


def _check(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    temperature: float,
    softcap: float | None,
    matmul_dtype: torch.dtype | None,
    chunk_elements: int,
    name: str = "",
) -> torch.dtype:
    """Validate one (hidden, head) pair and the shared arguments; return the matmul dtype."""
    _check_head(name, hidden, weight, bias)
    check("temperature", temperature)
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and 0 < softcap < float("inf")
    ):
        raise ValueError(f"{name}softcap must be a positive finite number or None, got {softcap!r}")
    if matmul_dtype is not None and not (
        isinstance(matmul_dtype, torch.dtype) and matmul_dtype.is_floating_point
    ):
        raise ValueError(
            f"matmul_dtype must be a floating torch.dtype or None, got {matmul_dtype!r}"
        )
    if not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be an integer >= 1, got {chunk_elements!r}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = real token), got dtype {mask.dtype}"
            )
        if mask.shape != hidden.shape[:2]:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} does not match hidden (B, T) "
                f"{tuple(hidden.shape[:2])}"
            )
    return matmul_dtype or torch.promote_types(hidden.dtype, weight.dtype)


def _valid(x: Tensor, mask: Tensor | None) -> Tensor:
    """The valid positions of a (B, T, ...) tensor as (N, ...): a gather (masked rows never read)."""
    return x.flatten(0, 1) if mask is None else x[mask]


def _scatter(values: Tensor, mask: Tensor | None, shape) -> Tensor:
    """(N,) results back to (B, T), 0 at masked positions (differentiable in ``values``)."""
    if mask is None:
        return values.view(shape)
    return values.new_zeros(shape).masked_scatter(mask, values)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor | tuple[Tensor, Tensor]:
    """log π(y_t | s_t) = log softmax(head(h_t) / τ)[y_t] from the last hidden states — what
    ``logprobs_from_logits(hidden @ weight.T + bias, tokens, temperature)`` computes (docs/formulas.md,
    "Log-probabilities from hidden states"), without the (B, T, V) logits or their gradient.

    Args:
        hidden: (B, T, H), any float dtype; ``hidden[:, t]`` scores ``tokens[:, t]`` (caller shifts).
        weight: (V, H), the LM head (possibly an embedding tied to it); gets a gradient if it
            requires one, accumulated over the chunks in float32 and returned in its dtype. A LoRA
            head comes in as its effective weight ``W + s·B A``, a tensor with autograd.
        tokens: (B, T) integer token ids, in [0, V) at valid positions.
        temperature: τ > 0, dividing the (soft-capped) logits before the log-softmax.
        bias: optional (V,).
        mask: optional bool (B, T). Where False the result is 0, and neither the hidden state there
            (even NaN) nor the token id (e.g. -100) is read; their gradient is exactly 0.
        softcap: c > 0 for ℓ = c·tanh(raw / c) (Gemma-2's ``final_logit_softcapping``), else None.
            Applied in the compute dtype after the matrix product.
        matmul_dtype: the dtype of the head's matrix products (forward and backward); None promotes
            hidden's and weight's dtypes. Under bf16 autocast pass ``torch.bfloat16``, so the values
            match the logits path's bf16 logits. An enclosing autocast is otherwise ignored.
        with_entropy: also return the per-position entropy of softmax(z) from the same pass.
        entropy_grad: differentiate that entropy too (PPO's entropy bonus); otherwise it is marked
            non-differentiable. Needs ``with_entropy``.
        chunk_elements: logits elements materialised at once: chunks of min(N, chunk_elements //
            min(V, BLOCK_MIN)) valid positions, each over vocabulary blocks of at most
            chunk_elements // rows columns (whole rows of V when V ≤ BLOCK_MIN).

    Returns:
        (B, T) log-probabilities in float32 (float64 when the matmul dtype is float64); with
        ``with_entropy``, ``(logprobs, entropy)``.
    """
    mdt = _check(hidden, weight, bias, mask, temperature, softcap, matmul_dtype, chunk_elements)
    if tokens.shape != hidden.shape[:2]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} does not match hidden (B, T) "
            f"{tuple(hidden.shape[:2])}"
        )
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if entropy_grad and not with_entropy:
        raise ValueError(
            "entropy_grad=True needs with_entropy=True (it differentiates the entropy)"
        )
    V = weight.shape[0]
    y = _valid(tokens, mask).long()
    if y.numel():
        lo, hi = torch.stack(torch.aminmax(y)).tolist()  # one device sync
        if lo < 0 or hi >= V:
            raise ValueError(
                f"tokens at valid positions must be in [0, V = {V}), got values from {lo} to {hi}"
            )
    h = _valid(hidden, mask).to(mdt)  # (N, H)
    lp, ent = _LinearLogprobs.apply(
        h,
        weight,
        bias,
        y,
        float(temperature),
        None if softcap is None else float(softcap),
        bool(with_entropy),
        bool(entropy_grad),
        _tiles(chunk_elements, V, h.shape[0]),
    )
    shape = hidden.shape[:2]
    if not with_entropy:
        return _scatter(lp, mask, shape)
    return _scatter(lp, mask, shape), _scatter(ent, mask, shape)


@torch.no_grad()
def linear_token_kl(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    ref_bias: Tensor | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    ref_softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """The exact per-position KL(π(·|s_t) ‖ π_ref(·|s_t)) = Σ_a π(a|s_t)·(log π(a|s_t) − log π_ref(a|s_t))
    over the whole vocabulary (as :func:`~proximal.core.token_kl`), from the two models' hidden
    states and heads. For monitoring: no gradient.

    Args:
        hidden, weight, bias, softcap: the policy's (B, T, H) hidden states and head, as in
            :func:`linear_logprobs`.
        ref_hidden, ref_weight, ref_bias, ref_softcap: the reference's, (B, T, H_ref) and
            (V, H_ref) (the same V; the hidden sizes may differ).
        temperature: τ > 0, dividing both.
        mask: optional bool (B, T); where False the result is 0 and neither input is read there.
        matmul_dtype: as in :func:`linear_logprobs`, for both heads.
        chunk_elements: as in :func:`linear_logprobs`.

    Returns:
        (B, T) in nats, float32 (float64 when either matmul dtype is float64); ≥ 0 up to round-off,
        +inf where π_ref gives probability 0 to a token π does not.
    """
    mdt = _check(hidden, weight, bias, mask, temperature, softcap, matmul_dtype, chunk_elements)
    ref_mdt = _check(
        ref_hidden, ref_weight, ref_bias, None, temperature, ref_softcap, matmul_dtype, 1, "ref_"
    )
    if ref_hidden.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"ref_hidden (B, T) {tuple(ref_hidden.shape[:2])} != hidden (B, T) "
            f"{tuple(hidden.shape[:2])}"
        )
    V = weight.shape[0]
    if ref_weight.shape[0] != V:
        raise ValueError(f"ref_weight has V = {ref_weight.shape[0]} rows, weight has V = {V}")
    cdt = torch.promote_types(torch.promote_types(mdt, ref_mdt), torch.float32)
    h, hr = _valid(hidden, mask).to(mdt), _valid(ref_hidden, mask).to(ref_mdt)  # (N, H), (N, H_ref)
    N = h.shape[0]
    rows, cols = _tiles(chunk_elements, V, N)
    kl = h.new_empty(N, dtype=cdt)
    with _no_autocast(h):
        head = _Head(weight, bias, mdt, temperature, softcap, cdt)
        ref_head = _Head(ref_weight, ref_bias, ref_mdt, temperature, ref_softcap, cdt)
        ws = _Buffers(min(rows, N), cols, h)
        floor = torch.finfo(cdt).min
        for s in range(0, N, rows):
            e, n = min(s + rows, N), min(rows, N - s)
            # online over the blocks: each distribution's running max and Σ exp(z − m), and
            # t = Σ exp(z − m)(z − z_ref); KL = E_p[z − z_ref] − lse + lse_ref = t / tot − lse + lse_ref
            m, m_ref = ws.row("m", n, cdt).fill_(floor), ws.row("m_ref", n, cdt).fill_(floor)
            tot, tot_ref = ws.row("tot", n, cdt).zero_(), ws.row("tot_ref", n, cdt).zero_()
            t = ws.row("t", n, cdt).zero_()
            for v0, v1 in _blocks(V, cols):
                z = head.z(h[s:e], ws, v0, v1)
                zr = ref_head.z(hr[s:e], ws, v0, v1, "_ref")
                d = torch.sub(z, zr, out=ws.tile("d", n, v1 - v0, cdt))
                m_new = torch.maximum(m, torch.amax(z, 1))
                alpha = torch.exp(m - m_new)
                p = z.sub_(m_new[:, None]).exp_()  # exp(z − m_new), in place
                d.masked_fill_(p == 0, 0.0)  # 0·log 0 = 0 for tokens π bans (−inf − −inf is NaN)
                t.mul_(alpha).add_(torch.einsum("nv,nv->n", p, d))
                tot.mul_(alpha).add_(p.sum(1))
                m.copy_(m_new)
                mr_new = torch.maximum(m_ref, torch.amax(zr, 1))
                tot_ref.mul_(torch.exp(m_ref - mr_new)).add_(zr.sub_(mr_new[:, None]).exp_().sum(1))
                m_ref.copy_(mr_new)
            lse = torch.log(tot).add_(m)
            kl[s:e] = t / tot - lse + torch.log(tot_ref).add_(m_ref)
    return _scatter(kl, mask, hidden.shape[:2])


def linear_sequence_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    mask: Tensor,
    average: bool = False,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """log π(y | x) = Σ_t log π(y_t | x, y_<t) over each row's response tokens — or, with
    ``average``, divided by their number |y| — as :func:`~proximal.core.sequence_logprobs`, from
    hidden states and the head (:func:`linear_logprobs`, temperature 1).

    Args:
        hidden: (B, L, H); ``hidden[:, t]`` scores ``labels[:, t]`` (for a causal LM pass
            ``hidden[:, :-1]``, ``input_ids[:, 1:]`` and ``response_mask[:, 1:]``).
        weight, bias, softcap, matmul_dtype, chunk_elements: as in :func:`linear_logprobs`.
        labels: (B, L) token ids; never read where ``mask`` is False.
        mask: bool (B, L), True = a response token whose log-probability counts.
        average: divide each row's sum by its number of True positions.

    Returns:
        (B,) in float32 (float64 when the matmul dtype is float64).

    Raises:
        ValueError: with ``average``, a row with no True position.
    """
    check_mask(labels, mask)
    per_token = linear_logprobs(
        hidden,
        weight,
        labels,
        bias=bias,
        mask=mask,
        softcap=softcap,
        matmul_dtype=matmul_dtype,
        chunk_elements=chunk_elements,
    )
    return masked_mean(per_token, mask, dim=1) if average else masked_sum(per_token, mask, dim=1)
