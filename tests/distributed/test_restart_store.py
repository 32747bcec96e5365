"""A restarted torchrun job forms its process group again in the store of the failed attempt.

torchrun's agent keeps one TCP store for every attempt of a job; the process group's keys of the
dead attempt are still in it (rank 0's address among them). A rank of the new attempt that reads
them before the new rank 0 has written its own connects to a dead process and fails ("Gloo
connectFullMesh failed ... Connection refused"). ``proximal.dist.init`` gives each attempt its own
prefix in that store (``dist.attempt_store``). Here the store is held by the test, as the agent
holds it, the first attempt's processes exit without cleaning up (as a failed attempt's do), and
the second attempt's ranks start in either order, rank 0 up to 8 s late. With torch's own
``env://`` path (``TORCHELASTIC_MAX_RESTARTS=0``: proximal does not step in) the late rank 0 fails
the attempt with that very error (the last test).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
from pathlib import Path

import pytest
import torch.distributed as td


def _rank(rank: int, world: int, port: int, restarts: int, delay: float, out: str, timeout: float):
    code, result = 0, None
    try:
        import torch

        from proximal import dist

        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_MAX_RESTARTS": str(restarts),
            }
        )
        time.sleep(delay)
        dist.init(torch.device("cpu"), timeout_s=timeout)
        result = ("ok", dist.global_sum(rank + 1))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result, code = ("error", f"{type(e).__name__}: {e}"), 1
    with open(out, "wb") as fh:
        pickle.dump(result, fh)
    os._exit(
        code
    )  # no destroy_process_group: a failed attempt's processes die, they do not clean up


def _attempt(tmp, port: int, restarts: int, delays: tuple, timeout=20.0, wait_s=60.0):
    """One attempt of a 2-process job (``delays``: seconds before each rank starts); its results
    (a rank still running after ``wait_s`` is killed: "no result")."""
    ctx = mp.get_context("fork")
    outs = [str(tmp / f"attempt-{time.monotonic_ns()}-{r}.pkl") for r in range(2)]
    procs = [
        ctx.Process(target=_rank, args=(r, 2, port, restarts, delays[r], outs[r], timeout))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    for p in procs:
        p.join(max(0.0, wait_s - (time.monotonic() - t0)))
        if p.is_alive():
            p.kill()
    results = []
    for out in outs:
        try:
            results.append(pickle.loads(Path(out).read_bytes()))
        except FileNotFoundError:
            results.append(("error", "no result (hung)"))
    return results


def _agent_store():
    """The store torchrun's agent would hold: a TCP server that outlives the attempts."""
    return td.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(20)
    )


OK = [("ok", 3.0), ("ok", 3.0)]  # each rank's global sum of rank + 1


def test_a_second_attempt_forms_its_group_whatever_order_its_ranks_start(tmp_path):
    store = _agent_store()
    assert _attempt(tmp_path, store.port, 1, (0.0, 0.0)) == OK
    assert _attempt(tmp_path, store.port, 1, (1.5, 0.0)) == OK  # rank 1 reads the store first
    assert _attempt(tmp_path, store.port, 1, (0.0, 1.5)) == OK  # rank 0 first


# Gloo retries a refused connection for about 5 s; a rank 0 later than that is what fails. 8 s
# (a loaded machine's import of torch and transformers alone) costs these two tests 25 s: cluster.


@pytest.mark.cluster
def test_a_second_attempt_whose_rank_0_comes_late(tmp_path):
    store = _agent_store()
    assert _attempt(tmp_path, store.port, 1, (0.0, 0.0)) == OK
    assert _attempt(tmp_path, store.port, 1, (8.0, 0.0)) == OK


@pytest.mark.cluster
def test_without_a_prefix_per_attempt_the_second_attempt_reads_the_first_ones_keys(tmp_path):
    """What ``attempt_store`` prevents: torch's ``env://`` path in the same sequence."""
    store = _agent_store()
    assert _attempt(tmp_path, store.port, 0, (0.0, 0.0)) == OK
    second = _attempt(tmp_path, store.port, 0, (8.0, 0.0), timeout=5.0, wait_s=20.0)
    assert second[1][0] == "error" and "Connection refused" in second[1][1], second
