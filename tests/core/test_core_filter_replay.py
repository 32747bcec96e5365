"""filtered_logprobs_from_logits: the trainer's replay of an engine's top-k / top-p filter
(rollout.replay_filter). Values and gradients against hand-computed ones — the sampled token
outside the kept set included — an independent float64 loop, chunking and masking."""

import math

import pytest
import torch

from proximal.core import filter_logits, filtered_logprobs_from_logits, logprobs_from_logits

F64 = torch.float64
P = [0.5, 0.3, 0.15, 0.05]  # one position's distribution, most likely first


def _logits(tau: float = 1.0) -> torch.Tensor:
    """(1, 4, 4): four positions of the distribution P, as logits whose z / τ is log P."""
    return torch.tensor([[[tau * math.log(p) for p in P]] * 4], dtype=F64)


# (top_k, top_p): the kept mass for each sampled token 0 … 3, by hand. top_p 0.7: the masses before
# each token are 0, 0.5, 0.8, 0.95, so {0, 1} is kept (0.8); a token outside it joins K (its mass is
# added: 0.8 + 0.15, 0.8 + 0.05). top_k 3: {0, 1, 2} (0.95); token 3 joins it (1.0). top_k 3 with
# top_p 0.9: the nucleus of the renormalised top 3 (0.5/0.95, 0.3/0.95 = 0.842 < 0.9, so token 2
# is kept too): {0, 1, 2}.
KEPT_MASS = {
    (0, 0.7): [0.8, 0.8, 0.95, 0.85],
    (3, 1.0): [0.95, 0.95, 0.95, 1.0],
    (3, 0.9): [0.95, 0.95, 0.95, 1.0],
    (1, 1.0): [0.5, 0.8, 0.65, 0.55],
}


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("top_k, top_p", list(KEPT_MASS))
def test_hand_values_including_tokens_outside_the_kept_set(top_k, top_p, tau):
    tokens = torch.tensor([[0, 1, 2, 3]])
    filtered, full = filtered_logprobs_from_logits(
        _logits(tau), tokens, tau, top_k=top_k, top_p=top_p
    )
    want = [math.log(P[y] / KEPT_MASS[top_k, top_p][y]) for y in range(4)]
    assert filtered[0].tolist() == pytest.approx(want, abs=1e-14)
    assert full[0].tolist() == pytest.approx([math.log(p) for p in P], abs=1e-14)
    assert torch.isfinite(filtered).all()  # the sampled token is always in K


def test_gradient_flows_only_through_the_kept_logits():
    """∂ log π^f(y)/∂z_v = (1[v = y] − π^f_v)/τ on K = kept ∪ {y}, exactly 0 outside K."""
    tau = 2.0
    logits = _logits(tau).requires_grad_(True)
    tokens = torch.tensor([[0, 2, 3, 1]])
    filtered, _ = filtered_logprobs_from_logits(logits, tokens, tau, top_p=0.7)
    filtered.sum().backward()
    grad = logits.grad[0]
    # token 0: K = {0, 1} (mass 0.8); token 2: K = {0, 1, 2} (0.95); token 3: K = {0, 1, 3} (0.85)
    want = [
        [1 - 0.5 / 0.8, -0.3 / 0.8, 0.0, 0.0],
        [-0.5 / 0.95, -0.3 / 0.95, 1 - 0.15 / 0.95, 0.0],
        [-0.5 / 0.85, -0.3 / 0.85, 0.0, 1 - 0.05 / 0.85],
        [-0.5 / 0.8, 1 - 0.3 / 0.8, 0.0, 0.0],
    ]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=F64) / tau, rtol=0, atol=1e-14)
    assert grad[0, 2:].eq(0).all() and grad[1, 3] == 0 and grad[2, 2] == 0  # exactly 0 off K
    # the full log-probabilities' gradient is the plain one: (1[v = y] − p_v)/τ everywhere
    logits.grad = None
    _, full = filtered_logprobs_from_logits(logits, tokens, tau, top_p=0.7)
    full.sum().backward()
    onehot = torch.nn.functional.one_hot(tokens[0], 4).to(F64)
    torch.testing.assert_close(
        logits.grad[0], (onehot - torch.tensor(P, dtype=F64)) / tau, rtol=0, atol=1e-14
    )


def _loop_reference(logits, tokens, tau, top_k, top_p):
    """An independent float64 loop: sort each position's tokens, keep the top k, then the shortest
    prefix whose renormalised mass reaches top_p (the crossing token kept), add the sampled token."""
    B, T, V = logits.shape
    out = torch.empty(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            p = torch.softmax(logits[b, t].double() / tau, -1).tolist()
            order = sorted(range(V), key=lambda v: -p[v])
            kept = order[:top_k] if top_k else order
            if top_p < 1:
                mass, cum, nucleus = sum(p[v] for v in kept), 0.0, []
                for v in kept:
                    if cum >= top_p:
                        break
                    nucleus.append(v)
                    cum += p[v] / mass
                kept = nucleus
            y = int(tokens[b, t])
            out[b, t] = math.log(p[y] / sum(p[v] for v in set(kept) | {y}))
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (5, 1.0), (7, 0.6), (0, 1.0)])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_random_logits_match_a_float64_loop_chunked_and_masked(top_k, top_p, chunk):
    g = torch.Generator().manual_seed(3)
    B, T, V, tau = 3, 6, 17, 0.7
    logits = torch.randn(B, T, V, generator=g, dtype=F64) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    garbage = torch.where(mask[..., None], logits, torch.nan).requires_grad_(True)
    filtered, full = filtered_logprobs_from_logits(
        garbage,
        torch.where(mask, tokens, -100),
        tau,
        top_k=top_k,
        top_p=top_p,
        mask=mask,
        chunk_tokens=chunk,
    )
    want = torch.where(mask, _loop_reference(logits, tokens, tau, top_k, top_p), 0.0)
    torch.testing.assert_close(filtered, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        full, logprobs_from_logits(logits, tokens, tau, mask=mask), rtol=0, atol=1e-12
    )
    (filtered.sum() + full.sum()).backward()
    assert torch.isfinite(garbage.grad).all() and garbage.grad[~mask].eq(0).all()


def test_without_a_filter_the_replay_is_the_full_logprob_to_the_bit():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    filtered, full = filtered_logprobs_from_logits(logits, tokens, 0.9)
    assert torch.equal(filtered, full)
    assert torch.equal(full, logprobs_from_logits(logits, tokens, 0.9))


def test_gradcheck_and_entropy_of_the_full_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 9, generator=g, dtype=F64).requires_grad_(True)
    tokens = torch.randint(0, 9, (2, 3), generator=g)
    assert torch.autograd.gradcheck(
        lambda x: filtered_logprobs_from_logits(x, tokens, 0.8, top_k=6, top_p=0.7, chunk_tokens=2),
        (logits,),
    )
    _, _, ent = filtered_logprobs_from_logits(logits, tokens, 0.8, top_p=0.7, with_entropy=True)
    p = torch.softmax(logits.detach() / 0.8, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=0, atol=1e-12)
    assert not ent.requires_grad


def test_filter_logits_is_the_engine_support():
    """The kept set the replay uses is the one the engine samples from (one function)."""
    from proximal.rollout import engine

    assert engine.filter_logits is filter_logits


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_no_full_vocab_tensor_saved_for_backward_and_bfloat16_gradient(tau):
    """As logprobs_from_logits: only the logits themselves and (B, T) statistics are saved."""
    B, T, V = 2, 16, 50
    logits = torch.randn(B, T, V).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        filtered, full = filtered_logprobs_from_logits(
            logits, tokens, tau, top_k=20, top_p=0.8, chunk_tokens=4
        )
    big = [s for s in saved if s.numel() >= B * T * V]
    assert all(s.data_ptr() == logits.data_ptr() for s in big), [
        (s.dtype, tuple(s.shape)) for s in big
    ]
    assert all(s.numel() <= B * T for s in saved if s.data_ptr() != logits.data_ptr())
    (filtered + full).sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
    assert filtered.dtype == full.dtype == torch.float32
