"""logprobs_from_logits / token_entropy: equal to log_softmax-then-gather, gradients equal to
autograd's, masked positions inert, and no full-vocabulary float32 copy kept for backward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proximal.core import logprobs_from_logits, token_entropy

F64 = torch.float64


def _reference(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_hand_values():
    # p = (½, ¼, ¼) at τ = 1; at τ = 2 the logits halve: p ∝ (√½, √¼, √¼)
    logits = torch.tensor([[[math.log(0.5), math.log(0.25), math.log(0.25)]] * 2], dtype=F64)
    tokens = torch.tensor([[0, 2]])
    assert logprobs_from_logits(logits, tokens)[0].tolist() == pytest.approx(
        [math.log(0.5), math.log(0.25)], abs=1e-15
    )
    z = math.sqrt(0.5) + 2 * math.sqrt(0.25)
    assert logprobs_from_logits(logits, tokens, temperature=2.0)[0].tolist() == pytest.approx(
        [math.log(math.sqrt(0.5) / z), math.log(math.sqrt(0.25) / z)], abs=1e-15
    )


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(2, 13),
    st.integers(1, 40),
    st.sampled_from([1.0, 0.7, 1.3]),
    st.integers(0, 2**31 - 1),
)
def test_equals_log_softmax_gather_values_and_gradients(B, T, V, chunk, tau, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(B, T, generator=g, dtype=F64)
    got = logprobs_from_logits(logits, tokens, tau, chunk_tokens=chunk)
    (got * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = _reference(ref_logits, tokens, tau)
    (ref * weights).sum().backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)
    ent = token_entropy(logits.detach(), tau, chunk_tokens=chunk)
    p = torch.softmax(logits.detach() / tau, -1)
    torch.testing.assert_close(ent, -(p * torch.log(p)).sum(-1), rtol=0, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, tokens, 0.8, mask=mask, chunk_tokens=2), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x, 0.8, mask=mask, chunk_tokens=2), (logits,)
    )


def test_mask_makes_garbage_inert_in_value_and_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, generator=g, dtype=F64)
    logits[0, 2] = math.nan
    logits[1, 0, 1] = math.inf
    logits.requires_grad_(True)
    tokens = torch.tensor([[1, 3, -100], [-100, 2, 0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    lp = logprobs_from_logits(logits, tokens, mask=mask)
    ent = token_entropy(logits, mask=mask)
    (lp.sum() + ent.sum()).backward()
    assert lp[~mask].eq(0).all() and ent[~mask].eq(0).all()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(logits.grad).all()
    assert not logits.grad[~mask].any()
    clean = logits.detach().clone()
    clean[~mask] = 0.0
    torch.testing.assert_close(
        lp[mask], _reference(clean, torch.where(mask, tokens, 0))[mask], rtol=0, atol=1e-12
    )


def test_non_contiguous_logits_slice():
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2, 8, 6, generator=g, dtype=F64)
    logits = full[:, 3:-1]  # like out.logits[:, prompt_len - 1:-1]
    assert not logits.is_contiguous()
    tokens = torch.randint(0, 6, (2, 4), generator=g)
    torch.testing.assert_close(
        logprobs_from_logits(logits, tokens, chunk_tokens=3),
        _reference(logits, tokens),
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, tok: logprobs_from_logits(x, tok, chunk_tokens=4),
        lambda x, tok: token_entropy(x, chunk_tokens=4),
    ],
)
def test_no_full_vocab_float32_tensor_saved_for_backward(fn):
    # bf16 logits: plain autograd would keep a float32 (B, T, V) copy alive until backward.
    B, T, V = 2, 16, 50
    logits = torch.randn(B, T, V).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(logits, tokens)
    big = [s for s in saved if s.numel() >= B * T * V]
    assert all(s.data_ptr() == logits.data_ptr() for s in big), [
        (s.dtype, tuple(s.shape)) for s in big
    ]
    assert all(s.numel() <= B * T for s in saved if s.data_ptr() != logits.data_ptr())
    out.float().sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"mask": torch.ones(1, 2)}, "bool"),
        ({"mask": torch.ones(1, 3, dtype=torch.bool)}, "mask shape"),
    ],
)
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), **kw)


def test_shape_validation():
    with pytest.raises(ValueError, match="tokens shape"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        token_entropy(torch.zeros(2, 3))


def test_entropy_from_the_logprobs_pass_equals_token_entropy_and_is_not_trained():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 7, generator=g, dtype=F64) * 2).requires_grad_(True)
    logits.data[0, 1, 2] = -math.inf  # a banned token: probability 0, no NaN
    tokens = torch.randint(0, 7, (3, 5), generator=g)
    tokens[0, 1] = 0
    mask = torch.rand(3, 5, generator=g) > 0.3
    lp, ent = logprobs_from_logits(
        logits, tokens, 0.9, mask=mask, chunk_tokens=4, with_entropy=True
    )
    torch.testing.assert_close(
        lp, logprobs_from_logits(logits, tokens, 0.9, mask=mask), rtol=0, atol=0
    )
    torch.testing.assert_close(
        ent, token_entropy(logits.detach(), 0.9, mask=mask, chunk_tokens=2), rtol=0, atol=1e-12
    )
    p = torch.softmax(logits.detach() / 0.9, -1)
    by_hand = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)
    torch.testing.assert_close(ent[mask], by_hand[mask], rtol=0, atol=1e-12)
    assert not ent.requires_grad and torch.isfinite(ent).all()
    lp.sum().backward()  # only the log-probabilities carry a gradient
    ref = logits.detach().clone().requires_grad_(True)
    torch.where(mask, _reference(ref, tokens, 0.9), 0.0).sum().backward()
    torch.testing.assert_close(
        logits.grad, torch.where(mask[..., None], ref.grad, 0.0), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_bfloat16_logits_match_float32_at_bfloat16_precision(tau):
    """bfloat16 logits are read by float32-accumulating kernels without being converted first; the
    gradient is bfloat16 (the logits' dtype). Both agree with the float32 computation to bfloat16's
    resolution (8 bits: relative 2⁻⁸ of the largest gradient)."""
    g = torch.Generator().manual_seed(4)
    x32 = torch.randn(3, 6, 50, generator=g) * 3
    tok = torch.randint(0, 50, (3, 6), generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.2
    xb = x32.bfloat16().requires_grad_(True)
    ref = xb.detach().float().requires_grad_(True)
    lp, ent = logprobs_from_logits(xb, tok, tau, mask=mask, chunk_tokens=5, with_entropy=True)
    lp_ref = torch.where(mask, _reference(ref, tok, tau), 0.0)
    torch.testing.assert_close(
        lp, lp_ref.detach(), rtol=0, atol=1e-5
    )  # same bf16 inputs, float32 math
    p = torch.softmax(ref.detach() / tau, -1)
    torch.testing.assert_close(
        ent, torch.where(mask, -(p * p.log()).sum(-1), 0.0), rtol=0, atol=1e-5
    )
    lp.sum().backward()
    lp_ref.sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    scale = float(ref.grad.abs().max())
    torch.testing.assert_close(xb.grad.float(), ref.grad, rtol=0, atol=scale * 2**-8)
