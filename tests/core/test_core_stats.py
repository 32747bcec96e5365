"""Masked reductions: hand values, garbage at masked positions, the biased-variance choice, the
empty-mask error, loss aggregation, and global statistics through a simulated all-reduce."""

import ast
import pathlib

import pytest
import torch
from f64 import F64, INF, NAN, b, t  # tests/core/f64.py
from hypothesis import given, settings
from hypothesis import strategies as st

from proximal.core import masked_aggregate, masked_mean, masked_mean_var, masked_sum, masked_var

X = t([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
M = b([[True, True, False], [True, False, True]])


def test_masked_sum_and_mean_hand_values_ignore_nan_inf():
    assert masked_sum(X, M).item() == 13.0
    assert masked_mean(X, M).item() == 13.0 / 4
    assert masked_sum(X, M, dim=1).tolist() == [3.0, 10.0]
    assert masked_mean(X, M, dim=1).tolist() == [1.5, 5.0]


def test_masked_sum_of_nothing_is_zero():
    assert masked_sum(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var_is_biased_population_variance():
    # values 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5.0.
    # Biased: 5/4 = 1.25 (unbiased would be 5/3).
    x = t([[1.0, 2.0, NAN], [3.0, -INF, 4.0]])
    m = b([[True, True, False], [True, False, True]])
    assert masked_var(x, m).item() == 1.25
    mean, var = masked_mean_var(x, m)
    assert (mean.item(), var.item()) == (2.5, 1.25)


def test_masked_var_of_a_single_token_is_zero():
    assert masked_var(t([[3.0, NAN]]), b([[True, False]])).item() == 0.0


def test_masked_var_two_pass_keeps_float32_precision_when_mean_dominates():
    # 1e4 ± 1: variance exactly 1. One-pass E[x²] − E[x]² in float32 cancels 1e8 − 1e8 and is
    # wrong by O(10); the two-pass form is exact here.
    x = (1e4 + torch.tensor([-1.0, 1.0]).repeat(500)).to(torch.float32)
    assert masked_var(x, torch.ones_like(x, dtype=torch.bool)).item() == 1.0


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, m: masked_mean(x, m),
        lambda x, m: masked_var(x, m),
        lambda x, m: masked_mean(x, m, dim=1),
        lambda x, m: masked_aggregate(x, m, "token-mean"),
        lambda x, m: masked_aggregate(x, m, "seq-mean-token-mean"),
    ],
)
def test_empty_mask_raises(fn):
    with pytest.raises(ValueError, match="no valid"):
        fn(t([[1.0, 2.0], [3.0, 4.0]]), b([[False, False], [False, False]]))


def test_empty_slice_with_dim_raises():
    with pytest.raises(ValueError, match="no valid"):
        masked_mean(t([[1.0, 2.0], [3.0, 4.0]]), b([[True, False], [False, False]]), dim=1)


def test_mask_must_be_bool_and_same_shape():
    with pytest.raises(ValueError, match="bool"):
        masked_mean(t([1.0, 2.0]), t([1.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        masked_mean(t([1.0, 2.0]), b([True, True, False]))


def test_masked_aggregate_hand_values():
    per_token = t([[1.0, 2.0, 3.0], [10.0, NAN, INF], [NAN, NAN, NAN]])
    mask = b([[True, True, True], [True, False, False], [False, False, False]])
    # token-mean: (1 + 2 + 3 + 10) / 4 tokens
    assert masked_aggregate(per_token, mask, "token-mean").item() == 16.0 / 4
    # seq-mean-token-mean: rows 2.0 and 10.0; the empty third row is left out
    assert masked_aggregate(per_token, mask, "seq-mean-token-mean").item() == (2.0 + 10.0) / 2


def test_masked_aggregate_unknown_name():
    with pytest.raises(ValueError, match="'seq-sum'"):
        masked_aggregate(t([[1.0]]), b([[True]]), "seq-sum")


def test_all_reduce_needs_global_mean():
    with pytest.raises(ValueError, match="all_reduce"):
        masked_mean(t([[1.0]]), b([[True]]), dim=1, all_reduce=lambda s: s)


def test_all_reduce_two_ranks_equals_full_batch(simulate_ranks):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=F64) * 3 + 7
    mask = torch.rand(6, 5, generator=g) < 0.6
    mask[0, 0] = True
    halves = [(x[:2], mask[:2]), (x[2:], mask[2:])]  # uneven split
    got = simulate_ranks([lambda ar, xm=xm: masked_mean_var(*xm, all_reduce=ar) for xm in halves])
    # reference by plain arithmetic over the valid values of the whole batch
    vals = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    for mean_r, var_r in got:
        assert mean_r.item() == pytest.approx(mu, rel=1e-12, abs=1e-12)
        assert var_r.item() == pytest.approx(var, rel=1e-12, abs=1e-12)


def test_all_reduce_rank_without_tokens_is_fine_but_global_empty_raises(simulate_ranks):
    x = t([[1.0, 2.0], [3.0, 5.0]])
    m = b([[True, True], [True, True]])
    empty = torch.zeros_like(m)
    got = simulate_ranks(
        [lambda ar: masked_var(x, m, all_reduce=ar), lambda ar: masked_var(x, empty, all_reduce=ar)]
    )
    # values 1, 2, 3, 5: mean 2.75, deviations² 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75
    assert [v.item() for v in got] == [8.75 / 4, 8.75 / 4]
    with pytest.raises(ValueError, match="no valid"):
        simulate_ranks([lambda ar: masked_mean(x, empty, all_reduce=ar)] * 2)


def test_core_imports_only_torch():
    allowed = {"torch", "__future__", "typing", "collections", "dataclasses", "math", "proximal"}
    core = pathlib.Path(__file__).resolve().parents[2] / "proximal" / "core"
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
                if roots == {"proximal"}:
                    assert node.module.startswith("proximal.core"), (path.name, node.module)
            else:
                continue
            assert roots <= allowed, (path.name, roots)


# ---------------------------------------------------------------- properties: loop vs vectorised


@st.composite
def masked_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=F64) * 5
    mask = torch.rand(B, T, generator=g) < 0.5
    mask[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))] = True  # at least one token
    garbage = torch.tensor([NAN, INF, -INF, 1e300], dtype=F64)[
        torch.randint(0, 4, (B, T), generator=g)
    ]
    return x, mask, garbage


@settings(max_examples=50, deadline=None)
@given(masked_batches())
def test_masked_stats_match_python_loop_and_ignore_garbage(batch):
    x, mask, garbage = batch
    vals = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    dirty = torch.where(mask, x, garbage)
    assert masked_mean(dirty, mask).item() == pytest.approx(mu, rel=1e-12, abs=1e-12)
    assert masked_var(dirty, mask).item() == pytest.approx(var, rel=1e-10, abs=1e-12)
    assert torch.equal(masked_mean(dirty, mask), masked_mean(x, mask))
    assert torch.equal(masked_var(dirty, mask), masked_var(x, mask))
    rows = [[v for v, m in zip(xr, mr) if m] for xr, mr in zip(x.tolist(), mask.tolist())]
    rows = [sum(r) / len(r) for r in rows if r]
    seq = masked_aggregate(dirty, mask, "seq-mean-token-mean").item()
    assert seq == pytest.approx(sum(rows) / len(rows), rel=1e-12, abs=1e-12)
