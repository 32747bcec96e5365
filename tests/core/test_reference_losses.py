"""The reference losses of docs/formulas.md (SFT; PTX after Ouyang et al. 2022): ``token_nll``,
with ``sft_loss`` and ``ptx_loss`` on it, and ``entropy_from_logits``. No trainer calls them — the
trainers take the same numbers from log-probabilities (``nll_from_logprobs``) and the fused or logits
path's entropy — so they are held here by hand, and against the quantity the trainers compute."""

from __future__ import annotations

import math

import torch

from proximal.core import entropy_from_logits, nll_from_logprobs, ptx_loss, sft_loss, token_nll


def _by_hand_nll(logits, labels, mask) -> float:
    """−(1/n) Σ log softmax, written out in Python floats."""
    total, n = 0.0, 0
    for b_ in range(logits.shape[0]):
        for t_ in range(logits.shape[1]):
            if not mask[b_, t_]:
                continue
            row = [float(v) for v in logits[b_, t_]]
            log_z = math.log(sum(math.exp(v) for v in row))
            total -= row[int(labels[b_, t_])] - log_z
            n += 1
    return total / n


def test_token_nll_and_the_losses_on_it_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([[1, 4, 0], [2, -100, 3]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    want = _by_hand_nll(logits, labels, mask)
    for f in (token_nll, sft_loss, ptx_loss):
        assert abs(float(f(logits, labels, mask)) - want) < 1e-12, f.__name__
    # a normaliser (the whole batch's 8 tokens): the sum over this slice's 4, over 8
    assert abs(float(token_nll(logits, labels, mask, normalizer=8.0)) - want * 4 / 8) < 1e-12
    # what the trainers compute from log-probabilities is the same number
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert abs(float(nll_from_logprobs(logprobs, mask)) - want) < 1e-12


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    # uniform over 2: log 2; (3/4, 1/4): −(3/4 log 3/4 + 1/4 log 1/4)
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert abs(float(entropy_from_logits(logits, mask)) - (math.log(2.0) + h2) / 2) < 1e-12
