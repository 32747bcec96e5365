"""linear_logprobs / linear_token_kl / linear_sequence_logprobs: log-probabilities, entropies and KL
from hidden states and the LM head, equal to the logits path (``logprobs_from_logits(hidden @ W.T +
b, ...)`` and its siblings) in values and gradients, with masked positions inert, and no tensor of
B × T × V elements ever allocated.

Expected values come from the logits path of proximal.core.logprobs (itself tested against
``log_softmax``-then-gather) with plain autograd through ``hidden @ W.T + b``, or by hand; float64
comparisons are at 1e-12, float32 ones at the tolerances stated beside them."""

import math
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from proximal.core import (
    fused,
    linear_logprobs,
    linear_sequence_logprobs,
    linear_token_kl,
    logprobs_from_logits,
    sequence_logprobs,
    token_entropy,
    token_kl,
)

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
U32 = 2.0**-24  # float32 unit round-off


def _logits(h, W, b=None, cap=None):
    raw = h @ W.T if b is None else h @ W.T + b
    return raw if cap is None else cap * torch.tanh(raw / cap)


def _reference(h, W, y, tau=1.0, *, b=None, mask=None, cap=None):
    """(logprobs, entropy) through the logits path, both differentiable (plain autograd through the
    head; token_entropy's own backward), 0 at masked positions."""
    logits = _logits(h, W, b, cap)
    lp = logprobs_from_logits(logits, y, tau, mask=mask)
    return lp, token_entropy(logits, tau, mask=mask)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [x for x in tensors if x is not None])


def _leaves(*xs, dtype=F64):
    return [None if x is None else x.to(dtype).detach().clone().requires_grad_(True) for x in xs]


def _block_min(k: int | None):
    """Vocabulary blocks from k columns (fused.BLOCK_MIN), so that the small vocabularies of these
    tests are tiled as 151,936 is at the default budget; None keeps the default (one block)."""
    return nullcontext() if k is None else mock.patch.object(fused, "BLOCK_MIN", k)


def _case(g, B, T, H, V, *, dtype=F64, bias=True, scale=1.0):
    h = torch.randn(B, T, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype) * scale / math.sqrt(H)
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    return h, W, b, y


def test_hand_values():
    # W = I and h = log p with p = (½, ¼, ¼): the logits are log p. At τ = 2 they halve: p ∝ √p.
    # With bias b = (0, log 2, 0) the logits become log (½, ½, ¼), i.e. p = (0.4, 0.4, 0.2).
    row = [math.log(0.5), math.log(0.25), math.log(0.25)]
    h = torch.tensor([[row, row]], dtype=F64)
    W, y = torch.eye(3, dtype=F64), torch.tensor([[0, 2]])
    assert linear_logprobs(h, W, y)[0].tolist() == pytest.approx(
        [math.log(0.5), math.log(0.25)], abs=1e-15
    )
    z = math.sqrt(0.5) + 2 * math.sqrt(0.25)
    assert linear_logprobs(h, W, y, 2.0)[0].tolist() == pytest.approx(
        [math.log(math.sqrt(0.5) / z), math.log(math.sqrt(0.25) / z)], abs=1e-15
    )
    b = torch.tensor([0.0, math.log(2.0), 0.0], dtype=F64)
    lp, ent = linear_logprobs(h, W, y, bias=b, with_entropy=True)
    assert lp[0].tolist() == pytest.approx([math.log(0.4), math.log(0.2)], abs=1e-15)
    h_ent = -(2 * 0.4 * math.log(0.4) + 0.2 * math.log(0.2))
    assert ent[0].tolist() == pytest.approx([h_ent, h_ent], abs=1e-15)
    # Soft-capping at c = 1: raw = atanh(t) gives logits t; t = (0.5, 0, 0) → p ∝ (e^½, 1, 1).
    h_cap = torch.tensor([[[math.atanh(0.5), 0.0, 0.0]]], dtype=F64)
    got = linear_logprobs(h_cap, W, torch.tensor([[1]]), softcap=1.0)
    assert got.item() == pytest.approx(-math.log(math.exp(0.5) + 2), abs=1e-15)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),  # B
    st.integers(1, 6),  # T
    st.integers(1, 6),  # H
    st.integers(2, 13),  # V
    st.integers(1, 9),  # rows per chunk
    st.sampled_from([1.0, 0.7, 1.3]),
    st.booleans(),  # bias
    st.sampled_from([None, 2.5]),  # softcap
    st.booleans(),  # entropy_grad
    st.integers(0, 2**31 - 1),
)
def test_float64_values_and_gradients_equal_the_logits_path(
    B, T, H, V, rows, tau, bias, cap, entropy_grad, seed
):
    g = torch.Generator().manual_seed(seed)
    h0, W0, b0, y = _case(g, B, T, H, V, bias=bias, scale=3.0)
    mask = torch.rand(B, T, generator=g) > 0.3  # padding and holes
    a, c = torch.randn(B, T, generator=g, dtype=F64), torch.randn(B, T, generator=g, dtype=F64)
    # chunk_elements not a multiple of V: rows = chunk_elements // V
    chunk = rows * V + int(torch.randint(0, V, (1,), generator=g))

    h, W, b = _leaves(h0, W0, b0)
    lp, ent = linear_logprobs(
        h, W, y, tau, bias=b, mask=mask, softcap=cap, with_entropy=True,
        entropy_grad=entropy_grad, chunk_elements=chunk,
    )  # fmt: skip
    loss = (lp * a).sum() + ((ent * c).sum() if entropy_grad else 0.0)
    got = _grads(loss, [h, W, b])

    hr, Wr, br = _leaves(h0, W0, b0)
    lp_ref, ent_ref = _reference(hr, Wr, y, tau, b=br, mask=mask, cap=cap)
    loss_ref = (lp_ref * a).sum() + ((ent_ref * c).sum() if entropy_grad else 0.0)
    want = _grads(loss_ref, [hr, Wr, br])

    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    assert ent.requires_grad == entropy_grad
    for x, x_ref in zip(got, want):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),  # B
    st.integers(1, 6),  # T
    st.integers(1, 5),  # H
    st.integers(2, 17),  # V
    st.integers(1, 4),  # BLOCK_MIN
    st.integers(1, 40),  # chunk_elements
    st.sampled_from([1.0, 0.7]),
    st.sampled_from([None, 2.5]),  # softcap
    st.booleans(),  # banned tokens (bias −inf), possibly whole blocks of them
    st.integers(0, 2**31 - 1),
)
def test_float64_vocabulary_tiles_equal_the_logits_path(
    B, T, H, V, block_min, chunk, tau, cap, banned, seed
):
    """Blocks of the vocabulary narrower than V (several per chunk, the last possibly shorter):
    the online logsumexp and entropy, the token picked from its block, and the gradients written
    block by block equal the logits path; also the token KL."""
    g = torch.Generator().manual_seed(seed)
    h0, W0, b0, y = _case(g, B, T, H, V, scale=3.0)
    mask = torch.rand(B, T, generator=g) > 0.3
    if banned:  # a run of banned tokens from the start, never a chosen one nor all of them
        b0[: int(torch.randint(1, V, (1,), generator=g))] = -math.inf
        y = torch.randint(int((b0 == -math.inf).sum()), V, (B, T), generator=g)
    a, c = torch.randn(B, T, generator=g, dtype=F64), torch.randn(B, T, generator=g, dtype=F64)
    with _block_min(block_min):
        rows, cols = fused._tiles(chunk, V, int(mask.sum()))
        assert rows * cols <= max(chunk, rows) and cols <= V
        h, W, b = _leaves(h0, W0, b0)
        lp, ent = linear_logprobs(
            h, W, y, tau, bias=b, mask=mask, softcap=cap, with_entropy=True, entropy_grad=True,
            chunk_elements=chunk,
        )  # fmt: skip
        got = _grads((lp * a).sum() + (ent * c).sum(), [h, W, b])
        kl = linear_token_kl(
            h0, W0, 0.5 * h0, W0.flip(0), tau, bias=b0, ref_bias=b0.flip(0), mask=mask,
            softcap=cap, ref_softcap=cap, chunk_elements=chunk,
        )  # fmt: skip

    hr, Wr, br = _leaves(h0, W0, b0)
    lp_ref, ent_ref = _reference(hr, Wr, y, tau, b=br, mask=mask, cap=cap)
    want = _grads((lp_ref * a).sum() + (ent_ref * c).sum(), [hr, Wr, br])
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    for x, x_ref in zip(got, want):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)
    kl_ref = token_kl(
        _logits(h0, W0, b0, cap), _logits(0.5 * h0, W0.flip(0), b0.flip(0), cap), tau, mask=mask
    )
    torch.testing.assert_close(kl, kl_ref, rtol=0, atol=1e-12)


def test_tiles():
    """Hand values of (rows, cols): 2²³ elements give 2,048 rows and blocks of ~4,096 columns,
    balanced (the last block is not a sliver); fewer tokens than that widen the blocks; a
    vocabulary up to BLOCK_MIN is one block of whole rows, as chunk_elements // V rows."""
    assert fused.BLOCK_MIN == 4096
    # 151,936 / 4,096 = 37.1 → 38 blocks of ⌈151,936 / 38⌉ = 3,999 columns
    assert fused._tiles(2**23, 151_936, 10_000) == (2048, 3999)
    assert fused._tiles(2**23, 32_000, 2048) == (2048, 4000)  # 8 blocks
    assert fused._tiles(2**23, 151_936, 100) == (100, 75_968)  # 83,886 wide → 2 blocks
    assert fused._tiles(2**23, 1000, 10**6) == (8388, 1000)  # one block: chunk_elements // V rows
    assert fused._tiles(2**23, 1000, 5) == (5, 1000)
    assert fused._tiles(3, 151_936, 7) == (1, 3)  # a budget below one row: 1 row, 3 columns
    assert fused._tiles(2**23, 151_936, 0) == (1, 151_936)  # no token: never used; well-formed


def test_each_pass_reads_the_head_once():
    """With N ≤ rows (one chunk), the forward's products together read each of the V rows of W
    once, and so do the backward's (∂L/∂h reads W_blk, ∂L/∂W writes the block's rows): counted
    from the profiler's recorded input shapes, not assumed. Before tiling over the vocabulary a
    chunk of chunk_elements // V rows read all of W: ⌈N / rows⌉ times."""
    g = torch.Generator().manual_seed(15)
    B, T, H, V = 2, 100, 8, 20_000  # N = 200: 2²⁰ elements are 1 chunk × 4 blocks, 2¹⁹ 2 × 5
    h0, W0, b0, y = _case(g, B, T, H, V, dtype=F32)
    for chunk, chunks in ((2**20, 1), (2**19, 2)):
        rows, cols = fused._tiles(chunk, V, B * T)
        assert -(-B * T // rows) == chunks and rows < cols < V
        h, W, b = _leaves(h0, W0, b0, dtype=F32)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            linear_logprobs(h, W, y, bias=b, chunk_elements=chunk).sum().backward()
        # z of a tile, forward and backward: addmm(b_blk, h (n, H), W_blkᵀ (H, Vb)). The
        # backward's products (mm, or addmm_ into an accumulator) of A (p, k) and B (k, H):
        # ∂L/∂h reads W_blk, A = G (n, Vb), B = W_blk (Vb, H); ∂L/∂W: A = Gᵀ (Vb, n), B = h.
        z_cols, dh_rows, dw_rows = 0, 0, 0
        for e in prof.events():
            if e.name == "aten::addmm":
                z_cols += e.input_shapes[2][1]
            elif e.name in ("aten::mm", "aten::addmm_"):
                a, b = e.input_shapes[:2] if e.name == "aten::mm" else e.input_shapes[1:3]
                assert b == [a[1], H]
                if a[0] <= rows:  # n tokens × Vb (cols > rows here)
                    dh_rows += b[0]
                else:
                    dw_rows += a[0]
        assert z_cols == 2 * chunks * V  # forward + backward, each chunk every column once
        assert dh_rows == dw_rows == chunks * V


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    h, W, b, y = _case(g, 2, 3, 4, 5)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    h, W, b = _leaves(h, W, b)
    # BLOCK_MIN 2: one chunk of the 4 rows, blocks of 2, 2 and 1 columns
    for cap, block_min in ((None, None), (1.5, None), (1.5, 2)):
        with _block_min(block_min):
            assert torch.autograd.gradcheck(
                lambda h, W, b: linear_logprobs(
                    h,
                    W,
                    y,
                    0.8,
                    bias=b,
                    mask=mask,
                    softcap=cap,
                    with_entropy=True,
                    entropy_grad=True,
                    chunk_elements=2 * 5 + 1,
                ),  # fmt: skip
                (h, W, b),
            )


@pytest.mark.parametrize("block_min", [None, 128])
def test_float32_matches_the_float32_logits_path(block_min):
    """Both paths in float32 against the float64 truth. The fused path rounds the same arithmetic
    in a different order (its chunks are separate matrix products; ∂L/∂W is summed chunk by
    chunk), so it is as close to the truth as the logits path is (measured: at most 20 units of
    round-off of each quantity's largest entry, the logits path up to 29; at worst 1.3× the logits
    path's error, in log-probabilities of 2.5 units). Asserted: within 64 units, and within twice
    the logits path's error plus 8 units. Also with the vocabulary in 8 blocks of 125 (54 rows a
    chunk): the online logsumexp and the block-by-block ∂L/∂h stay within the same bounds."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 4, 33, 32, 1000
    h0, W0, b0, y = _case(g, B, T, H, V, scale=4.0)
    mask = torch.rand(B, T, generator=g) > 0.15
    a, c = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    if block_min:
        with _block_min(block_min):
            assert fused._tiles(7 * V + 3, V, int(mask.sum())) == (54, 125)

    def run(fuse, dtype, tau, cap):
        h, W, b = _leaves(h0, W0, b0, dtype=dtype)
        if fuse:
            with _block_min(block_min):
                lp, ent = linear_logprobs(
                    h, W, y, tau, bias=b, mask=mask, softcap=cap, with_entropy=True,
                    entropy_grad=True, chunk_elements=7 * V + 3,
                )  # fmt: skip
        else:
            lp, ent = _reference(h, W, y, tau, b=b, mask=mask, cap=cap)
        grads = _grads((lp * a.to(dtype)).sum() + (ent * c.to(dtype)).sum(), [h, W, b])
        return [x.detach().double() for x in (lp, ent, *grads)]

    for tau, cap in [(1.0, None), (0.7, None), (1.3, 10.0)]:
        truth = run(False, F64, tau, cap)
        fuse, logits = run(True, F32, tau, cap), run(False, F32, tau, cap)
        for name, f, r, t in zip(("lp", "entropy", "dh", "dW", "db"), fuse, logits, truth):
            scale = float(t.abs().max())
            err_f, err_r = float((f - t).abs().max()), float((r - t).abs().max())
            assert err_f <= 64 * U32 * scale, (name, tau, cap, err_f, scale)
            assert err_f <= 2 * err_r + 8 * U32 * scale, (name, tau, cap, err_f, err_r, scale)


def test_lora_effective_weight_gets_the_adapters_gradients():
    """A LoRA head comes in as the tensor W_eff = W + s·B A; autograd carries ∂L/∂W_eff into A
    and B (and not into the frozen W)."""
    g = torch.Generator().manual_seed(2)
    h0, W0, _, y = _case(g, 2, 5, 6, 9, bias=False)
    A0, B0 = torch.randn(3, 6, generator=g, dtype=F64), torch.randn(9, 3, generator=g, dtype=F64)
    mask = torch.tensor([[True, True, True, False, False], [False, True, True, True, True]])
    s = 0.5

    def run(fused):
        h, A, Bm = _leaves(h0, A0, B0)
        W = W0 + s * Bm @ A
        lp = linear_logprobs(h, W, y, 0.9, mask=mask, chunk_elements=2 * 9) if fused else None
        if lp is None:
            lp = _reference(h, W, y, 0.9, mask=mask)[0]
        return lp, _grads(lp.sum(), [h, A, Bm])

    (lp, got), (lp_ref, want) = run(True), run(False)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    for x, x_ref in zip(got, want):
        assert x.abs().max() > 0.1  # the adapters do get a gradient
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)


def test_tied_embedding_gradients_add_up():
    """The head shares its weight with the input embedding used earlier in the same graph: the
    embedding's gradient is the sum of both uses, as with the logits path."""
    g = torch.Generator().manual_seed(3)
    V, H = 11, 4
    ids = torch.randint(0, V, (2, 6), generator=g)
    M0 = torch.randn(H, H, generator=g, dtype=F64)
    E0 = torch.randn(V, H, generator=g, dtype=F64)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    targets = torch.where(mask, ids.roll(-1, 1), -100)

    def run(fused):
        E, M = _leaves(E0, M0)
        hidden = torch.tanh(torch.nn.functional.embedding(ids, E) @ M)  # a 1-layer "model"
        if fused:
            lp = linear_logprobs(hidden, E, targets, mask=mask, chunk_elements=3 * V)
        else:
            lp = _reference(hidden, E, torch.where(mask, targets, 0), mask=mask)[0]
        return _grads(lp.sum(), [E, M])

    for x, x_ref in zip(run(True), run(False)):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)


def test_masked_positions_are_never_read_and_get_zero_gradient():
    g = torch.Generator().manual_seed(4)
    h0, W0, b0, y0 = _case(g, 3, 5, 4, 7)
    mask = torch.tensor(
        [
            [False, True, True, True, False],  # prompt before, padding after
            [True, False, True, False, True],  # holes
            [False, False, False, False, False],  # nothing valid
        ]
    )
    dirty_h = torch.where(mask[..., None], h0, math.nan)
    dirty_y = torch.where(mask, y0, -100)
    h, W, b = _leaves(dirty_h, W0, b0)
    lp, ent = linear_logprobs(
        h, W, dirty_y, 0.8, bias=b, mask=mask, softcap=3.0, with_entropy=True,
        entropy_grad=True, chunk_elements=2 * 7,
    )  # fmt: skip
    (lp.sum() + ent.sum()).backward()
    assert not lp[~mask].any() and not ent[~mask].any()
    assert torch.isfinite(h.grad).all() and not h.grad[~mask].any()
    assert torch.isfinite(W.grad).all() and torch.isfinite(b.grad).all()

    hr, Wr, br = _leaves(torch.where(mask[..., None], h0, 0.0), W0, b0)
    lp_ref, ent_ref = _reference(hr, Wr, torch.where(mask, y0, 0), 0.8, b=br, mask=mask, cap=3.0)
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    for x, x_ref in ((h.grad, hr.grad), (W.grad, Wr.grad), (b.grad, br.grad)):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)

    kl = linear_token_kl(h.detach(), W0, 0.5 * dirty_h, W0.flip(0), mask=mask)
    assert torch.isfinite(kl).all() and not kl[~mask].any()


def test_no_valid_position_gives_zeros_and_zero_gradients():
    h, W, b = _leaves(torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(5))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    lp = linear_logprobs(h, W, torch.full((2, 3), -100), bias=b, mask=mask)
    assert lp.shape == (2, 3) and not lp.any()
    lp.sum().backward()
    assert not h.grad.any() and not W.grad.any() and not b.grad.any()


def test_only_the_inputs_that_require_grad_get_one():
    g = torch.Generator().manual_seed(5)
    h0, W0, b0, y = _case(g, 2, 4, 3, 6)
    h = h0.clone().requires_grad_(True)
    lp = linear_logprobs(h, W0, y, bias=b0, chunk_elements=6)  # a frozen head
    lp.sum().backward()
    hr, Wr, br = _leaves(h0, W0, b0)
    _reference(hr, Wr, y, b=br)[0].sum().backward()
    torch.testing.assert_close(h.grad, hr.grad, rtol=0, atol=1e-12)
    W = W0.clone().requires_grad_(True)
    linear_logprobs(h0, W, y, bias=b0).sum().backward()  # only the head trains
    torch.testing.assert_close(W.grad, Wr.grad, rtol=0, atol=1e-12)


def test_non_contiguous_hidden_slice():
    g = torch.Generator().manual_seed(6)
    full = torch.randn(2, 9, 5, generator=g, dtype=F64)
    hidden = full[:, 3:-1]  # like out.hidden_states[-1][:, prompt_len - 1:-1]
    assert not hidden.is_contiguous()
    W = torch.randn(8, 5, generator=g, dtype=F64)
    y = torch.randint(0, 8, (2, 5), generator=g)
    torch.testing.assert_close(
        linear_logprobs(hidden, W, y, chunk_elements=3 * 8),
        _reference(hidden, W, y)[0],
        rtol=0,
        atol=1e-12,
    )


def test_entropy_is_not_differentiated_without_entropy_grad():
    g = torch.Generator().manual_seed(7)
    h0, W0, _, y = _case(g, 2, 3, 4, 6, bias=False)
    h, W = _leaves(h0, W0)
    lp, ent = linear_logprobs(h, W, y, with_entropy=True)
    assert not ent.requires_grad and lp.requires_grad
    assert torch.equal(lp, linear_logprobs(h, W, y))
    ent_ref = token_entropy(_logits(h0, W0))
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)


def test_an_enclosing_autocast_does_not_change_the_matmul_dtype():
    """Without matmul_dtype the products run in float32 even inside a bf16 autocast region (the
    caller decides the dtype; autocast would otherwise turn torch.mm into a bf16 product)."""
    g = torch.Generator().manual_seed(8)
    h0, W0, b0, y = _case(g, 2, 5, 8, 40, dtype=F32)
    results = []
    for autocast in (False, True):
        h, W, b = _leaves(h0, W0, b0, dtype=F32)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            lp = linear_logprobs(h, W, y, bias=b, chunk_elements=3 * 40)
            lp.sum().backward()
        results.append((lp, h.grad, W.grad, b.grad))
    for x, x_ref in zip(*results):
        assert x.dtype == F32 and torch.equal(x, x_ref)


@pytest.mark.parametrize("block_min", [None, 64])
def test_bf16_matmul_matches_the_bf16_logits_path(block_min):
    """bf16 mixed precision: the logits path's head runs under autocast and produces bf16 logits;
    matmul_dtype=torch.bfloat16 gives the fused path the same bf16 products. Values agree to bf16
    resolution (2⁻⁸ of the largest logit, twice: z_y and logsumexp), gradients to 2⁻⁷ of their
    largest entry; the head's gradients come back in float32 (the master weights' dtype). Tiled
    (5 blocks of 60), ∂L/∂h is the float32 sum of the blocks' bf16 products, within the same bound."""
    g = torch.Generator().manual_seed(9)
    B, T, H, V = 3, 10, 16, 300
    h0, W0, b0, y = _case(g, B, T, H, V, dtype=F32, scale=3.0)
    mask = torch.rand(B, T, generator=g) > 0.2
    a = torch.randn(B, T, generator=g)

    h, W, b = _leaves(h0, W0, b0, dtype=F32)
    with _block_min(block_min):
        if block_min:
            assert fused._tiles(4 * V + 1, V, int(mask.sum()))[1] == 60
        lp = linear_logprobs(
            h, W, y, 0.9, bias=b, mask=mask, matmul_dtype=BF16, chunk_elements=4 * V + 1
        )
    got = _grads((lp * a).sum(), [h, W, b])

    hr, Wr, br = _leaves(h0, W0, b0, dtype=F32)
    with torch.autocast("cpu", dtype=BF16):
        logits = torch.nn.functional.linear(hr, Wr, br)
    assert logits.dtype == BF16
    lp_ref = logprobs_from_logits(logits, y, 0.9, mask=mask)
    want = _grads((lp_ref * a).sum(), [hr, Wr, br])

    zmax = float(logits.detach().float().abs().max()) / 0.9
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=2 * zmax * 2**-8)
    for x, x_ref in zip(got, want):
        assert x.dtype == F32
        torch.testing.assert_close(x, x_ref, rtol=0, atol=float(x_ref.abs().max()) * 2**-7)
    # and both are bf16 approximations of the float32 truth
    lp32 = linear_logprobs(h0, W0, y, 0.9, bias=b0, mask=mask)
    torch.testing.assert_close(lp, lp32, rtol=0, atol=2 * zmax * 2**-8)


@pytest.mark.parametrize("block_min", [None, 16])
def test_bf16_weights_get_bf16_gradients(block_min):
    """Pure bf16 (weights and hidden states in bf16): the products run in bf16, the softmax in
    float32, and the gradients come back in bf16, within bf16 resolution of the float32 result."""
    g = torch.Generator().manual_seed(10)
    h0, W0, b0, y = _case(g, 2, 6, 8, 50, dtype=F32)
    h, W, b = _leaves(h0, W0, b0, dtype=BF16)
    with _block_min(block_min):  # 16: 9 rows × 4 blocks of 13
        lp = linear_logprobs(h, W, y, bias=b, chunk_elements=3 * 50)
    lp.sum().backward()
    assert lp.dtype == F32 and h.grad.dtype == W.grad.dtype == b.grad.dtype == BF16
    h32, W32, b32 = _leaves(h, W, b, dtype=F32)  # the same (bf16-rounded) numbers in float32
    lp32 = linear_logprobs(h32, W32, y, bias=b32)
    lp32.sum().backward()
    zmax = float(_logits(h32, W32, b32).detach().abs().max())  # bf16 logits: |Δz| ≤ 2⁻⁸·zmax
    torch.testing.assert_close(lp, lp32.detach(), rtol=0, atol=2 * zmax * 2**-8)
    for x, x32 in ((h.grad, h32.grad), (W.grad, W32.grad), (b.grad, b32.grad)):
        torch.testing.assert_close(x.float(), x32, rtol=0, atol=float(x32.abs().max()) * 2**-7)


def _rows_change_products(product, x: torch.Tensor, rows: int) -> bool:
    """Whether this machine's float32 matrix product gives a row a different result depending on
    how many rows it is multiplied with (BLAS picks its kernels by shape; several do on x86)."""
    chunked = torch.cat([product(x[s : s + rows]) for s in range(0, len(x), rows)])
    return not torch.equal(chunked, product(x))


def test_chunk_size_independence():
    """Each position's log-probability and entropy depend only on its own row of the head's
    product, and its ∂L/∂h only on its row of G W, so they are bitwise equal across chunk sizes
    wherever the matrix product itself gives a row the same result whatever the number of rows
    multiplied with it — checked per chunk size on this machine, not assumed. (The x86 CPUs this
    was written on do not: their BLAS picks kernels by shape, and a row's logits move by ~1 unit of
    round-off between chunk sizes, so only the bound below applies there.) The bound, also for
    ∂L/∂W and ∂L/∂b (sums over the chunks, in an order that changes with the chunk size): 16 units
    of float32 round-off of each quantity's largest entry (measured: at most 8; dropping or
    doubling one chunk would change ∂L/∂W by far more). V = 301 is below fused.BLOCK_MIN: one
    vocabulary block, so a chunk is chunk_elements // V whole rows."""
    g = torch.Generator().manual_seed(11)
    B, T, H, V = 3, 37, 64, 301
    h0, W0, b0, y = _case(g, B, T, H, V, dtype=F32, scale=3.0)
    mask = torch.rand(B, T, generator=g) > 0.2
    a, c = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    N = int(mask.sum())
    row_counts = (1, 2, 5, 16, 27)  # 27 divides nothing; the reference is one chunk of all N

    results = []
    for rows in (*row_counts, N):
        h, W, b = _leaves(h0, W0, b0, dtype=F32)
        lp, ent = linear_logprobs(
            h, W, y, 0.8, bias=b, mask=mask, softcap=5.0, with_entropy=True,
            entropy_grad=True, chunk_elements=rows * V + V - 1,
        )  # fmt: skip
        grads = _grads((lp * a).sum() + (ent * c).sum(), [h, W, b])
        results.append((lp.detach(), ent.detach(), *grads))

    hv, G = h0[mask], torch.randn(N, V, generator=g)
    whole = results[-1]
    for rows, r in zip(row_counts, results):
        fwd_stable = not _rows_change_products(lambda x: torch.addmm(b0, x, W0.t()), hv, rows)
        bwd_stable = not _rows_change_products(lambda x: x @ W0, G, rows)
        for name, x, x_ref in zip(("lp", "entropy", "dh", "dW", "db"), r, whole):
            stable = {"lp": fwd_stable, "entropy": fwd_stable, "dh": fwd_stable and bwd_stable}
            if stable.get(name, False):
                assert torch.equal(x, x_ref), (rows, name)
            torch.testing.assert_close(
                x, x_ref, rtol=0, atol=16 * U32 * float(x_ref.abs().max()), msg=f"{name} {rows}"
            )


def test_token_kl_equals_the_logits_path():
    g = torch.Generator().manual_seed(12)
    B, T, V = 3, 6, 9
    h, W, b, _ = _case(g, B, T, 5, V, scale=2.0)
    hr, Wr, br, _ = _case(g, B, T, 3, V, scale=2.0)  # the reference may have another hidden size
    mask = torch.rand(B, T, generator=g) > 0.3
    for tau, cap, ref_cap in [(1.0, None, None), (0.7, 2.0, None), (1.3, None, 4.0)]:
        got = linear_token_kl(
            h, W, hr, Wr, tau, bias=b, ref_bias=br, mask=mask, softcap=cap, ref_softcap=ref_cap,
            chunk_elements=2 * V + 5,
        )  # fmt: skip
        want = token_kl(_logits(h, W, b, cap), _logits(hr, Wr, br, ref_cap), tau, mask=mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert (got[mask] > 0).all() and not got[~mask].any()
    # KL(π‖π) = 0
    same = linear_token_kl(h, W, h, W, bias=b, ref_bias=b)
    torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-12)


def test_token_kl_with_banned_tokens():
    """A token π bans (bias −inf) contributes 0·log 0 = 0; a token only π_ref bans makes KL +inf."""
    h = torch.randn(1, 2, 3, dtype=F64)
    W = torch.randn(4, 3, dtype=F64)
    banned = torch.tensor([0.0, -math.inf, 0.0, 0.0], dtype=F64)
    both = linear_token_kl(h, W, h, W, bias=banned, ref_bias=banned)
    torch.testing.assert_close(both, torch.zeros(1, 2, dtype=F64), rtol=0, atol=1e-12)
    only_ref = linear_token_kl(h, W, h, W, ref_bias=banned)
    assert torch.isinf(only_ref).all() and (only_ref > 0).all()
    want = token_entropy(_logits(h, W, banned))
    for block_min in (None, 1):  # 1: blocks of one token, one of them all banned
        with _block_min(block_min):
            lp, ent = linear_logprobs(
                h, W, torch.tensor([[0, 2]]), bias=banned, with_entropy=True, chunk_elements=1
            )
            kl = linear_token_kl(h, W, h, W, bias=banned, ref_bias=banned, chunk_elements=1)
        assert torch.isfinite(ent).all() and torch.isfinite(lp).all()
        torch.testing.assert_close(ent, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(kl, torch.zeros(1, 2, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs_equal_the_logits_path(average):
    g = torch.Generator().manual_seed(13)
    h0, W0, b0, y = _case(g, 3, 7, 4, 10)
    mask = torch.tensor(
        [
            [False, False, True, True, True, False, False],
            [False, True, True, True, True, True, True],
            [False, False, False, False, False, False, True],
        ]
    )
    h, W, b = _leaves(h0, W0, b0)
    got = linear_sequence_logprobs(
        h, W, torch.where(mask, y, -100), mask, average, bias=b, chunk_elements=4 * 10
    )
    gh = _grads(got.sum(), [h, W, b])
    hr, Wr, br = _leaves(h0, W0, b0)
    want = sequence_logprobs(_logits(hr, Wr, br), y, mask, average)
    for x, x_ref in zip((got, *gh), (want, *_grads(want.sum(), [hr, Wr, br]))):
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-12)


def test_sequence_logprobs_average_of_an_empty_row_raises():
    mask = torch.tensor([[True, False], [False, False]])
    with pytest.raises(ValueError, match="no valid"):
        linear_sequence_logprobs(
            torch.zeros(2, 2, 3), torch.zeros(4, 3), torch.zeros(2, 2, dtype=torch.long), mask, True
        )


def test_no_logits_sized_allocation_in_forward_and_backward():
    """From the profiler's memory events: no single allocation of the fused forward + backward
    reaches B·T·V float32 elements (the largest is the (V, H) head gradient), while the logits path
    allocates several (the control, showing the events see such a tensor)."""
    B, T, V, H = 4, 64, 50_000, 16
    g = torch.Generator().manual_seed(14)
    h0, W0, b0, y = _case(g, B, T, H, V, dtype=F32)
    logits_bytes = B * T * V * 4

    def largest_allocation(fused: bool) -> int:
        h, W, b = _leaves(h0, W0, b0, dtype=F32)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if fused:
                lp, ent = linear_logprobs(
                    h, W, y, 0.9, bias=b, with_entropy=True, entropy_grad=True,
                    chunk_elements=2**19,
                )  # fmt: skip
                (lp.sum() + ent.sum()).backward()
            else:
                lp = logprobs_from_logits(_logits(h, W, b), y, 0.9)
                lp.sum().backward()
        sizes = [
            e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        ]
        assert len(sizes) > 10  # the events were recorded
        return max(sizes)

    assert largest_allocation(False) >= logits_bytes
    largest = largest_allocation(True)
    assert largest < logits_bytes
    assert largest <= V * H * 4  # ∂L/∂W; the tile buffers are 128 rows × 3,847 columns


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"chunk_elements": 0}, "chunk_elements"),
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": math.inf}, "softcap"),
        ({"matmul_dtype": torch.int32}, "matmul_dtype"),
        ({"mask": torch.ones(2, 3)}, "bool"),
        ({"mask": torch.ones(3, 2, dtype=torch.bool)}, "mask shape"),
        ({"bias": torch.zeros(4)}, r"bias must be \(V,\)"),
        ({"weight": torch.zeros(5, 3)}, r"weight must be \(V, H\) with H = 4"),
        ({"hidden": torch.zeros(2, 4)}, r"hidden must be \(B, T, H\)"),
        ({"tokens": torch.zeros(2, 2, dtype=torch.long)}, "tokens shape"),
        ({"tokens": torch.zeros(2, 3)}, "integer token ids"),
        ({"tokens": torch.full((2, 3), 5)}, r"\[0, V = 5\), got values from 5 to 5"),
        ({"tokens": torch.full((2, 3), -100)}, "got values from -100"),
        ({"entropy_grad": True}, "with_entropy"),
    ],
)
def test_validation(kw, match):
    args = {
        "hidden": torch.zeros(2, 3, 4),
        "weight": torch.zeros(5, 4),
        "tokens": torch.zeros(2, 3, dtype=torch.long),
    }
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    with pytest.raises(ValueError, match=match):
        linear_logprobs(args["hidden"], args["weight"], args["tokens"], **kw)


def test_kl_validation():
    h, W = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="ref_weight has V = 6"):
        linear_token_kl(h, W, torch.zeros(2, 3, 2), torch.zeros(6, 2))
    with pytest.raises(ValueError, match=r"ref_hidden \(B, T\)"):
        linear_token_kl(h, W, torch.zeros(2, 4, 4), W)
    with pytest.raises(ValueError, match=r"ref_weight must be \(V, H\) with H = 2"):
        linear_token_kl(h, W, torch.zeros(2, 3, 2), W)
    with pytest.raises(ValueError, match="ref_softcap"):
        linear_token_kl(h, W, h, W, ref_softcap=-1.0)


def test_the_memory_planner_tiles_as_the_kernel():
    """proximal.memory.budget (no torch) keeps its own copy of the tile shape: the same numbers."""
    from proximal.memory import budget  # lazy: the planner is only this test's concern

    assert budget.FUSED_CHUNK_ELEMENTS == fused.DEFAULT_CHUNK_ELEMENTS
    assert budget.FUSED_BLOCK_MIN == fused.BLOCK_MIN
    for V in (2, 100, 4096, 4097, 32_000, 151_936, 262_144):
        for N in (0, 1, 55, 2047, 2048, 2049, 10**6):
            assert budget.fused_tile(V, N) == fused._tiles(fused.DEFAULT_CHUNK_ELEMENTS, V, N)
