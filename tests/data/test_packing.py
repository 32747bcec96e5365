"""Packing (proximal/data/packing.py) by hand, and packed against padded through the real step
functions of sft, rm and dpo on tiny float32 models.

Tolerance: packed and padded run the same tokens through the same weights, but in other matrix
shapes (one (1, Σ len) row against (N, max len) rows), so float32 sums are taken in another order.
Losses agree to 1e-6 relative and gradients to 1e-5 relative to the largest gradient entry (measured
on these models: a few 1e-7); cross-sequence leakage would move them by 1e-2 or more.
"""

from __future__ import annotations

import random

import pytest
import torch

from proximal.config import ConfigError
from proximal.core import dpo_loss
from proximal.data.packing import (
    collate_packed,
    collate_packed_pairs,
    pack_rows,
    per_sequence,
    plan_micro_batches,
    split_to,
)
from proximal.data.preferences import PreferencePair
from proximal.data.sft import SFTExample
from proximal.models.heads import check_packing, lm_logits
from proximal.models.loading import load_causal_lm
from proximal.models.reward import load_reward_model
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm, build_tiny_reward_model
from proximal.trainers.dpo import Objective
from proximal.trainers.dpo import pair_step as dpo_step
from proximal.trainers.reward import pair_step as rm_step
from proximal.trainers.sft import nll_step

LOSS_RTOL, GRAD_TOL = 1e-6, 1e-5


# ----------------------------------------------------------------------------------------------
# The layout, by hand
# ----------------------------------------------------------------------------------------------


def test_pack_rows_first_fit_never_splits():
    assert pack_rows([3, 4, 2, 5, 1], 6) == [[0, 2, 4], [1], [3]]
    assert pack_rows([3, 4], None) == [[0, 1]]
    with pytest.raises(ValueError, match="sequence 1 has 7 tokens"):
        pack_rows([3, 7], 6)


def test_collate_packed_by_hand():
    b = collate_packed(
        [[5, 6, 7], [8, 9], [4]],
        [[False, True, True], [True, True], [True]],
        pad_id=0,
        row_length=4,
    )
    # first fit: row 0 takes sequence 0 (room 1 left), row 1 sequence 1, sequence 2 (1 token)
    # goes back into row 0; L = 4
    assert b["input_ids"].tolist() == [[5, 6, 7, 4], [8, 9, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    # every sequence's first token False, whatever its mask says
    assert b["response_mask"].tolist() == [[False, True, True, False], [False, True, False, False]]
    assert b["segment_ids"].tolist() == [[0, 0, 0, 2], [1, 1, -1, -1]]
    assert b["last"].tolist() == [2, 5, 3]


def test_collate_packed_pads_the_tail_as_its_own_sequence():
    b = collate_packed([[5, 6, 7], [8]], [[True] * 3, [True]], pad_id=0, row_length=3)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert b["segment_ids"].tolist() == [[0, 0, 0], [1, -1, -1]]
    assert not b["response_mask"][1].any()


def test_per_sequence_sums_by_segment():
    values = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], requires_grad=True)
    seg = torch.tensor([[0, 0, 1], [1, 2, -1]])
    out = per_sequence(values, seg, 3)
    assert out.tolist() == [3.0, 12.0, 16.0]
    out.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_plan_micro_batches_by_hand():
    # packed: longest first (9, 5, 4, 3, 2 = items 1, 0, 3, 4, 2), closed when the sum would pass 10
    assert plan_micro_batches([[5], [9], [2], [4], [3]], 10, packed=True) == [[1], [0, 3], [4, 2]]
    # where they differ: packed 6 + 2 + 2 = 10 fits; padded 2 × 6 = 12 does not
    assert plan_micro_batches([[6], [2], [2], [2]], 10, packed=True) == [[0, 1, 2], [3]]
    assert plan_micro_batches([[6], [2], [2], [2]], 10, packed=False) == [[0], [1, 2, 3]]
    # padded: count × longest; 9 alone; 5,4 → 2×5 = 10; 3 → 3×5 = 15 > 10: new; 3,2 → 6
    assert plan_micro_batches([[5], [9], [2], [4], [3]], 10, packed=False) == [
        [1],
        [0, 3],
        [4, 2],
    ]
    # pairs: two sequences each; padded cost 2 × pairs × the longest side
    assert plan_micro_batches([[3, 4], [2, 2], [1, 1]], 8, packed=False) == [[0], [1, 2]]
    assert plan_micro_batches([[3, 4], [2, 2], [1, 1]], 8, packed=True) == [[0], [1, 2]]
    # an item over the budget is a micro-batch of its own
    assert plan_micro_batches([[20], [1]], 10, packed=True) == [[0], [1]]


def test_split_to_equal_counts():
    assert split_to([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to([[0], [1]], 2) == [[0], [1]]
    with pytest.raises(ValueError):
        split_to([[0], [1]], 3)


# ----------------------------------------------------------------------------------------------
# Packed against padded through the models
# ----------------------------------------------------------------------------------------------

ALPHABET = "abcdefghij"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("packing")
    tok = build_char_tokenizer(list(ALPHABET))
    return tok, build_tiny_causal_lm(d / "lm", tok, seed=0), build_tiny_reward_model(d / "rm", tok)


def sequences(tok, lengths, seed=0):
    rng = random.Random(seed)
    ids = [tok.convert_tokens_to_ids(c) for c in ALPHABET]
    return [[rng.choice(ids) for _ in range(n)] for n in lengths]


def sft_rows(tok):
    seqs = sequences(tok, [3, 11, 6, 17, 4])
    return [SFTExample(s, p, "t") for s, p in zip(seqs, [1, 5, 2, 9, 2])]


def pairs_of(tok):
    c = sequences(tok, [4, 12, 7, 9], seed=1)
    r = sequences(tok, [8, 5, 13, 3], seed=2)
    prompts = [2, 3, 1, 2]
    r = [x[:p] + y[p:] for x, y, p in zip(c, r, prompts)]  # sides share the prompt
    return [PreferencePair(a, b, None, "t", p) for a, b, p in zip(c, r, prompts)]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_both(model, step):
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        s = step(packed)
        out[packed] = ({k: float(v) for k, v in s.items()}, grads(model))
    return out


def assert_same(out, keys):
    (a, ga), (b, gb) = out[False], out[True]
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=LOSS_RTOL, abs=1e-7), k
    assert ga.keys() == gb.keys() and ga
    scale = max(float(g.abs().max()) for g in ga.values())
    worst = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
    assert worst <= GRAD_TOL * scale, (worst, scale)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sft_packed_equals_padded(tiny, attn):
    tok, lm, _ = tiny
    model = load_causal_lm(str(lm), dtype="float32")
    model.set_attn_implementation(attn)
    rows = sft_rows(tok)
    n = float(sum(r.n_targets for r in rows))
    out = run_both(model, lambda packed: nll_step(model, rows, 0, "cpu", n, packed=packed))
    assert out[True][0]["tokens"] == n
    assert_same(out, ["loss_sum", "tokens"])


def test_rm_packed_equals_padded(tiny):
    tok, _, rm = tiny
    model, _ = load_reward_model(str(rm), "float32", tok)
    pairs = pairs_of(tok)
    out = run_both(model, lambda packed: rm_step(model, pairs, 0, "cpu", 4.0, packed=packed))
    assert_same(out, ["loss_sum", "gap_sum", "chosen_sum", "rejected_sum"])


@pytest.mark.parametrize("average", [False, True])
def test_dpo_packed_equals_padded(tiny, average):
    tok, lm, _ = tiny
    model = load_causal_lm(str(lm), dtype="float32")
    pairs = pairs_of(tok)
    ref = torch.tensor([[-30.0, -31.0], [-40.0, -38.0], [-25.0, -26.0], [-33.0, -30.0]])
    obj = Objective(
        "dpo",
        average=average,
        needs_reference=True,
        loss=lambda pw, pl, rw, rl, n: dpo_loss(pw, pl, rw, rl, 0.1, "sigmoid", 0.0, normalizer=n),
    )
    out = run_both(
        model,
        lambda packed: dpo_step(
            model, pairs, 0, "cpu", objective=obj, normalizer=4.0, ref_logps=ref, packed=packed
        ),
    )
    assert_same(out, ["loss_sum", "logp_chosen_sum", "logp_rejected_sum", "tokens"])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_token_attends_across_a_boundary(tiny, attn):
    """Changing the middle sequence of a packed row leaves the others' logits unchanged to the bit."""
    tok, lm, _ = tiny
    model = load_causal_lm(str(lm), dtype="float32")
    model.set_attn_implementation(attn)
    seqs = sequences(tok, [5, 7, 6])
    other = [seqs[0], sequences(tok, [7], seed=9)[0], seqs[2]]
    logits = []
    for s in (seqs, other):
        b = collate_packed(s, [[True] * len(x) for x in s], 0)
        with torch.no_grad():
            logits.append(
                lm_logits(model, b["input_ids"], None, 0, 18, position_ids=b["position_ids"])
            )
    a, b = logits
    assert torch.equal(a[:, :5], b[:, :5])  # before it (causal anyway)
    assert torch.equal(a[:, 12:], b[:, 12:])  # after it: the packed mask at work
    assert not torch.equal(a[:, 5:12], b[:, 5:12])  # the changed sequence itself


def test_check_packing_refuses_other_attention(tiny):
    _, lm, _ = tiny
    model = load_causal_lm(str(lm), dtype="float32")
    check_packing(model)  # sdpa: accepted, and the probe passes
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="train.packing.*'flash_attention_2'"):
        check_packing(model)


def test_collate_packed_pairs_order(tiny):
    tok, _, _ = tiny
    pairs = pairs_of(tok)[:2]
    b = collate_packed_pairs(pairs, 0)
    n = [len(pairs[0].chosen_ids), len(pairs[1].chosen_ids), len(pairs[0].rejected_ids)]
    assert b["last"].tolist()[:3] == [n[0] - 1, n[0] + n[1] - 1, n[0] + n[1] + n[2] - 1]
    assert b["response_mask"][0, : pairs[0].prompt_len].sum() == 0
