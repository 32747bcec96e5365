"""The step plan, micro-batch accumulation and sharded evaluation (``proximal.train.batches``), in
one process.

A rank's share of an evaluation is what it would be under torchrun: ``proximal.dist``'s rank and
process count are set to those of rank r of W (the sums over ranks are then this rank's own, as the
collectives are the identity without a process group), so each rank's calls can be checked alone.
(The sums and extremes of ``accumulate`` over two real ranks: tests/trainers/ppo/test_ppo_update_stats.py.)
"""

from __future__ import annotations

import pytest
import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.train.batches import accumulate, evaluate, evaluate_rows, plan_steps


@pytest.fixture
def as_rank(monkeypatch):
    """``as_rank(r, w)``: this process answers ``dist.rank()`` and ``dist.world_size()`` as rank r of w."""

    def set_rank(r: int, w: int):
        monkeypatch.setattr(dist, "rank", lambda: r)
        monkeypatch.setattr(dist, "world_size", lambda: w)

    return set_rank


# ----------------------------------------------------------------------------------------------
# plan_steps
# ----------------------------------------------------------------------------------------------


def _plan(n_rows=10, steps=None, epochs=2, batch_size=3, warmup_steps=0):
    return plan_steps(
        n_rows,
        steps=steps,
        epochs=epochs,
        batch_size=batch_size,
        warmup_steps=warmup_steps,
        train_file="pairs.jsonl",
    )


def test_epochs_count_full_batches_only():
    assert _plan(n_rows=10, epochs=2, batch_size=3) == 6  # 3 full batches a pass; row 10 left out
    assert _plan(n_rows=9, epochs=1, batch_size=3) == 3
    assert _plan(n_rows=3, epochs=4, batch_size=3) == 4


def test_steps_win_over_epochs():
    assert _plan(n_rows=10, steps=25, epochs=2, batch_size=3) == 25


def test_a_batch_larger_than_the_data_is_refused_naming_both():
    with pytest.raises(
        ConfigError, match="train.batch_size = 11 is larger than the 10 usable rows"
    ):
        _plan(n_rows=10, batch_size=11, steps=5)
    with pytest.raises(ConfigError, match="data.train_file = pairs.jsonl"):
        _plan(n_rows=10, batch_size=11, steps=5)


def test_a_warm_up_as_long_as_the_run_is_refused():
    assert _plan(n_rows=10, epochs=2, batch_size=3, warmup_steps=5) == 6
    with pytest.raises(
        ConfigError, match="optim.warmup_steps = 6 must be less than the 6 training steps"
    ):
        _plan(n_rows=10, epochs=2, batch_size=3, warmup_steps=6)


# ----------------------------------------------------------------------------------------------
# accumulate
# ----------------------------------------------------------------------------------------------


def test_accumulate_calls_the_step_on_consecutive_micro_batches_and_sums():
    calls = []

    def step(rows):
        calls.append(list(rows))
        return {
            "rows": len(rows),
            "sum": torch.tensor(float(sum(rows))),
            "sq": sum(r * r for r in rows),
        }

    got = accumulate(list(range(1, 8)), 3, step)
    assert calls == [[1, 2, 3], [4, 5, 6], [7]]
    assert got == {"rows": 7.0, "sum": 28.0, "sq": 140.0}
    assert all(type(v) is float for v in got.values())


def test_accumulate_sums_in_float64():
    """float32 loses a 1 added to 1e8 (its spacing there is 8); the sums are kept in float64."""
    parts = iter([1e8, 1.0, 1.0, 1.0])
    got = accumulate([0, 1, 2, 3], 1, lambda rows: {"x": torch.tensor(next(parts))})
    assert got == {"x": 100000003.0}


def test_accumulate_a_step_that_runs_backward():
    """A trainer's step: forward, backward, and its loss share returned with its graph."""
    w = torch.tensor(2.0, requires_grad=True)

    def step(rows):
        loss = w * len(rows)
        loss.backward()
        return {"loss": loss}

    assert accumulate([0, 1, 2], 2, step) == {"loss": 6.0}
    assert float(w.grad) == 3.0  # gradients accumulated over both micro-batches


# ----------------------------------------------------------------------------------------------
# evaluate
# ----------------------------------------------------------------------------------------------


def _count_and_sum(calls):
    def fn(idx):
        calls.append(list(idx))
        assert not torch.is_grad_enabled()  # evaluation runs without autograd
        return {"n": len(idx), "sum": torch.tensor(float(sum(idx)))}

    return fn


def test_evaluate_passes_over_every_row_in_micro_batches():
    calls = []
    assert evaluate(7, 3, _count_and_sum(calls)) == {"n": 7.0, "sum": 21.0}
    assert calls == [[0, 1, 2], [3, 4, 5], [6]]


def test_evaluate_on_each_of_two_ranks(as_rank):
    """7 rows over 2 ranks: rank 0 reads 0-3, rank 1 reads 4-6 and, to make as many calls, one
    placeholder call on row 0 whose result is counted as nothing."""
    calls = []
    as_rank(0, 2)
    assert evaluate(7, 3, _count_and_sum(calls)) == {"n": 4.0, "sum": 6.0}
    assert calls == [[0, 1, 2], [3]]
    calls.clear()
    as_rank(1, 2)
    assert evaluate(7, 3, _count_and_sum(calls)) == {"n": 3.0, "sum": 15.0}
    assert calls == [[4, 5, 6], [0]]


def test_a_rank_with_no_rows_still_reports_every_key(as_rank):
    as_rank(3, 4)  # 2 rows over 4 ranks: rank 3 has none
    calls = []
    assert evaluate(2, 4, _count_and_sum(calls)) == {"n": 0.0, "sum": 0.0}
    assert calls == [[0]]


# ----------------------------------------------------------------------------------------------
# evaluate_rows
# ----------------------------------------------------------------------------------------------


def _row_values(calls):
    def fn(idx):
        calls.append(list(idx))
        assert not torch.is_grad_enabled()
        return torch.tensor([[i, 10 * i + 0.5] for i in idx], dtype=torch.float32)

    return fn


def test_evaluate_rows_assembles_the_table_of_every_row():
    calls = []
    table = evaluate_rows(5, 2, _row_values(calls), width=2)
    assert calls == [[0, 1], [2, 3], [4]]
    assert table.dtype == torch.float64 and table.device.type == "cpu"
    assert table.tolist() == [[i, 10 * i + 0.5] for i in range(5)]


def test_evaluate_rows_of_one_rank_fills_its_own_rows_only(as_rank):
    """Rank 1 of 2 over 5 rows: rows 3-4, then a placeholder call; the rest stays 0 for the other
    rank's share (one sum over ranks assembles the table)."""
    as_rank(1, 2)
    calls = []
    table = evaluate_rows(5, 2, _row_values(calls), width=2)
    assert calls == [[3, 4], [0]]
    assert table.tolist() == [[0, 0], [0, 0], [0, 0], [3, 30.5], [4, 40.5]]


def test_evaluate_rows_reshapes_one_value_per_row():
    table = evaluate_rows(3, 2, lambda idx: torch.tensor(idx, dtype=torch.float32) * 2, width=1)
    assert table.shape == (3, 1) and table.flatten().tolist() == [0.0, 2.0, 4.0]
