"""Shared fixtures for the core tests."""

import threading

import pytest


def _simulate_ranks(rank_fns, timeout=20.0):
    """Run ``rank_fns[r](all_reduce)`` for each rank r in its own thread, where ``all_reduce(t)``
    returns the sum of ``t`` over all ranks — the data-parallel SUM all-reduce, without a process
    group. Each rank must make the same sequence of all_reduce calls (as real collectives require).
    Returns the list of per-rank results."""
    n = len(rank_fns)
    barrier = threading.Barrier(n, timeout=timeout)
    slots = [None] * n
    results = [None] * n
    errors = []

    def make_all_reduce(rank):
        def all_reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0].clone()
            for other in slots[1:]:
                total = total + other  # same order on every rank, as a real all-reduce
            barrier.wait()  # nobody overwrites a slot before everyone has read it
            return total

        return all_reduce

    def run(rank):
        try:
            results[rank] = rank_fns[rank](make_all_reduce(rank))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def simulate_ranks():
    return _simulate_ranks
