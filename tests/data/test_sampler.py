"""The resumable, rank-sharded sampler (``proximal.data.sampler``) and the evaluation shards.

Expected batches are written out by hand: with ``shuffle=False`` a pass's order is ``0 … n−1``, so
every batch follows from the batch size, ``drop_last`` and the rank alone; with shuffling, a pass's
order is the one the docstring specifies (``torch.randperm(n)`` under a generator seeded with
``seed + epoch``), and the tests check the sampler walks that order in the same way.
"""

from __future__ import annotations

import pytest
import torch

from proximal.data.sampler import Sampler, shard_for_eval


def batches(sampler: Sampler, k: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(k)]


def spec_order(n: int, seed: int, epoch: int) -> list[int]:
    """A pass's order as the docstring specifies it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


# ----------------------------------------------------------------------------------------------
# Passes, batches and epochs (one process)
# ----------------------------------------------------------------------------------------------


def test_without_drop_last_a_batch_runs_on_into_the_next_pass():
    s = Sampler(n=10, batch_size=4, seed=0, shuffle=False)
    assert batches(s, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert (s.epoch, s.position) == (1, 6)


def test_with_drop_last_the_rows_short_of_a_batch_are_left_out_of_the_pass():
    s = Sampler(n=10, batch_size=4, seed=0, shuffle=False, drop_last=True)
    assert s.steps_per_epoch == 2
    assert batches(s, 5) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert (s.epoch, s.position) == (2, 4)


def test_a_batch_as_large_as_the_data_set_is_one_pass_per_step():
    s = Sampler(n=3, batch_size=3, seed=0, shuffle=False, drop_last=True)
    assert batches(s, 3) == [[0, 1, 2]] * 3
    assert s.epoch == 2  # the third batch started the third pass


def test_a_batch_larger_than_the_data_set_spans_passes_without_drop_last():
    s = Sampler(n=3, batch_size=5, seed=0, shuffle=False)
    assert batches(s, 2) == [[0, 1, 2, 0, 1], [2, 0, 1, 2, 0]]
    assert (s.epoch, s.position) == (3, 1)


def test_each_shuffled_pass_is_its_own_seeded_permutation():
    n, seed = 12, 5
    s = Sampler(n=n, batch_size=4, seed=seed)
    got = batches(s, 6)  # two whole passes
    first, second = sum(got[:3], []), sum(got[3:], [])
    assert first == spec_order(n, seed, 0) and second == spec_order(n, seed, 1)
    assert sorted(first) == sorted(second) == list(range(n))  # every row once per pass
    assert first != second and first != list(range(n))  # shuffled, and differently each pass
    # The order depends on the seed: another seed, another order
    assert sum(batches(Sampler(n=n, batch_size=4, seed=seed + 7), 3), []) != first


def test_shuffled_drop_last_leaves_out_the_tail_of_each_pass_order():
    n, seed = 10, 3
    s = Sampler(n=n, batch_size=4, seed=seed, drop_last=True)
    o0, o1 = spec_order(n, seed, 0), spec_order(n, seed, 1)
    assert batches(s, 4) == [o0[0:4], o0[4:8], o1[0:4], o1[4:8]]  # o0[8:], o1[8:] left out


# ----------------------------------------------------------------------------------------------
# Ranks: disjoint shares of one global batch
# ----------------------------------------------------------------------------------------------


def test_ranks_read_disjoint_contiguous_shares_of_the_same_global_batch():
    ranks = [
        Sampler(n=10, batch_size=6, seed=0, shuffle=False, rank=r, world_size=3) for r in (0, 1, 2)
    ]
    assert [batches(s, 2) for s in ranks] == [
        [[0, 1], [6, 7]],
        [[2, 3], [8, 9]],
        [[4, 5], [0, 1]],  # the second global batch, [6 7 8 9 0 1], ran on into the next pass
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_the_union_over_ranks_is_the_one_process_batch(world):
    """Shuffled, with drop_last: the ranks' shares concatenated in rank order are, step by step, the
    batches a single process reads; no row is read by two ranks in a step."""
    one = Sampler(n=13, batch_size=4, seed=11, drop_last=True)
    ranks = [
        Sampler(n=13, batch_size=4, seed=11, drop_last=True, rank=r, world_size=world)
        for r in range(world)
    ]
    for _ in range(8):  # three steps a pass: into the third pass
        parts = [s.next_batch() for s in ranks]
        assert all(len(p) == 4 // world for p in parts)
        assert sum(parts, []) == one.next_batch()
        assert len(set(sum(parts, []))) == 4


def test_local_part_splits_any_list_as_long_as_a_batch():
    s = Sampler(n=10, batch_size=4, seed=0, rank=1, world_size=2)
    assert s.local_part(["a", "b", "c", "d"]) == ["c", "d"]
    assert s.next_global_batch() == Sampler(n=10, batch_size=4, seed=0).next_global_batch()


# ----------------------------------------------------------------------------------------------
# Resuming from the state dict
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_a_loaded_state_continues_exactly_where_the_run_stopped(drop_last, k):
    """After ``k`` steps (mid-pass, at a pass boundary, and past it), a fresh sampler loaded with the
    state reads the same batches as the one that never stopped."""
    ref = Sampler(n=10, batch_size=4, seed=2, drop_last=drop_last)
    batches(ref, k)
    state = ref.state_dict()
    assert set(state) == {"epoch", "position"}  # two integers, saved in every checkpoint
    resumed = Sampler(n=10, batch_size=4, seed=2, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert batches(resumed, 6) == batches(ref, 6)


def test_the_state_after_known_steps_is_what_the_passes_say():
    s = Sampler(n=10, batch_size=4, seed=0, shuffle=False)
    assert s.state_dict() == {"epoch": 0, "position": 0}
    batches(s, 3)  # 12 rows: the whole first pass and two rows of the second
    assert s.state_dict() == {"epoch": 1, "position": 2}


def test_a_state_saved_by_one_process_resumes_on_two():
    """The state is global (pass and position of the global batch): the ranks of a resumed run at
    another process count together read what the one process would have read next."""
    one = Sampler(n=10, batch_size=4, seed=9)
    batches(one, 3)
    state = one.state_dict()
    ranks = [Sampler(n=10, batch_size=4, seed=9, rank=r, world_size=2) for r in (0, 1)]
    for s in ranks:
        s.load_state_dict(state)
    for _ in range(4):
        assert ranks[0].next_batch() + ranks[1].next_batch() == one.next_batch()


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0, "batch_size": 1}, "an empty data set"),
        ({"n": 5, "batch_size": 0}, "batch_size 0 must be a positive multiple of the 1 processes"),
        (
            {"n": 5, "batch_size": 3, "world_size": 2},
            "batch_size 3 must be a positive multiple of the 2 processes",
        ),
        ({"n": 5, "batch_size": 6, "drop_last": True}, "batch_size 6 is larger than the 5 rows"),
    ],
)
def test_impossible_samplers_are_refused_naming_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(seed=0, **kwargs)


# ----------------------------------------------------------------------------------------------
# Evaluation shards
# ----------------------------------------------------------------------------------------------


def test_eval_shards_are_contiguous_disjoint_and_equal_in_count():
    # 10 rows over 3 ranks: ⌈10/3⌉ = 4 rows each (the last rank has 2), micro-batches of 3
    assert [shard_for_eval(10, 3, r, 3) for r in range(3)] == [
        [[0, 1, 2], [3]],
        [[4, 5, 6], [7]],
        [[8, 9], []],  # the same number of calls: an empty list the caller runs as a placeholder
    ]


def test_eval_shards_when_ranks_outnumber_the_rows():
    assert [shard_for_eval(5, 2, r, 4) for r in range(4)] == [[[0, 1]], [[2, 3]], [[4]], [[]]]
    assert [shard_for_eval(1, 8, r, 2) for r in range(2)] == [[[0]], [[]]]


def test_one_process_evaluates_every_row_in_order():
    assert shard_for_eval(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert shard_for_eval(4, 4) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("n, micro, world", [(1, 1, 1), (17, 3, 2), (9, 4, 3), (6, 2, 8)])
def test_eval_shards_cover_every_row_once(n, micro, world):
    shards = [shard_for_eval(n, micro, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank makes the same number of calls
    rows = [i for s in shards for b in s for i in b]
    assert rows == list(range(n))
    assert all(len(b) <= micro for s in shards for b in s)
