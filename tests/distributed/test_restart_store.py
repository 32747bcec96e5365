"""A restarted torchrun job forms its process group again in the store of the failed attempt.

torchrun's agent keeps one TCP store for every attempt of a job; the process group's keys of the
dead attempt are still in it (rank 0's address among them). A rank of the new attempt that reads
them before the new rank 0 has written its own connects to a dead process and fails ("Gloo
connectFullMesh failed ... Connection refused"). ``proximal.dist.init`` gives each attempt its own
prefix in that store (``dist.attempt_store``). Here the store is served, as the agent serves it, by
a process of its own that outlives the attempts (and is stopped when the test ends, passed or
failed: a store served from the test process would be copied into every forked rank,
tests/multiproc.py); the first attempt's processes exit without cleaning up (as a failed attempt's
do), and the second attempt's ranks start in a chosen order, arranged through the store: the later
rank starts only once the first has written its own key of this attempt. Rank 1 first is the order
that fails without ``attempt_store``, every time: with torch's own ``env://`` path
(``TORCHELASTIC_MAX_RESTARTS=0``: proximal does not step in) rank 1 writes no such key and fails in
``connectFullMesh`` before the new rank 0 has even started — the only rank 0 address it can have
read is the dead one's (the last test; gloo logs the "Connection refused" of each retry, and the
error names the refusal or the connect timeout that ended the retries).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from pathlib import Path

import pytest
import torch.distributed as td
from multiproc import fork, stop

# The keys a rank of an attempt writes first (dist.attempt_store): rank 0 its prefix, rank 1 its token.
FIRST_KEY = {0: "proximal/prefix", 1: "proximal/hello/1"}


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


def _serve(port_file: str, stop_r: int, stop_w: int) -> None:
    """The agent: a TCP store master until the test closes its end of the pipe (or dies)."""
    os.close(stop_w)
    store = td.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )
    Path(port_file).write_text(str(store.port))
    os.read(stop_r, 1)  # EOF once every write end is closed
    os._exit(0)


class Agent:
    """The store torchrun's agent would hold, served by a forked process; ``client`` reads it."""

    def __init__(self, tmp: Path):
        port_file = tmp / "agent-port"
        stop_r, self._stop_w = os.pipe()
        self.proc = fork(_serve, str(port_file), stop_r, self._stop_w)
        os.close(stop_r)
        try:
            deadline = time.monotonic() + 30
            while not (port_file.is_file() and port_file.read_text()):
                assert self.proc.is_alive() and time.monotonic() < deadline, "the agent's store"
                self.proc.join(0.01)
            self.port = int(port_file.read_text())
            self.client = td.TCPStore(
                "127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=20)
            )
        except BaseException:
            self.close()
            raise

    def value(self, key: str) -> bytes | None:
        return self.client.get(key) if self.client.check([key]) else None

    def close(self) -> None:
        os.close(self._stop_w)
        self.proc.join(10)
        stop([self.proc])


@pytest.fixture
def agent(tmp_path):
    agent = Agent(tmp_path)
    try:
        yield agent
    finally:
        agent.close()


def _attempt(
    tmp: Path,
    agent: Agent,
    restarts: int,
    first: int | None = None,
    delays=(0.0, 0.0),
    timeout=20.0,
    wait_s=60.0,
):
    """One attempt of a 2-process job, its results (a rank still running after ``wait_s`` is
    killed: "no result"). With ``first`` that rank starts alone, and the other once the first has
    written its own key of this attempt in the store (FIRST_KEY: its value changed) — not at all if
    the first finished without writing it; ``delays``: seconds each rank waits after starting."""
    outs = [str(tmp / f"attempt-{time.monotonic_ns()}-{r}.pkl") for r in range(2)]
    order = [0, 1] if first is None else [first, 1 - first]
    procs = {}
    t0 = time.monotonic()
    try:
        for r in order:
            if r != order[0] and first is not None:
                key, before = FIRST_KEY[first], agent.value(FIRST_KEY[first])
                lead = procs[first]
                while lead.is_alive() and agent.value(key) == before:
                    assert time.monotonic() - t0 < wait_s, f"rank {first} never wrote {key}"
                    lead.join(0.02)
                if not lead.is_alive() and agent.value(key) == before:
                    break  # it finished without a peer: the other would only wait for it
            args = (r, 2, agent.port, restarts, delays[r], outs[r], timeout)
            procs[r] = fork(_rank, *args)
        for proc in procs.values():
            proc.join(max(0.0, wait_s - (time.monotonic() - t0)))
    finally:
        stop(list(procs.values()))
    results = []
    for out in outs:
        try:
            results.append(pickle.loads(Path(out).read_bytes()))
        except FileNotFoundError:
            results.append(("error", "no result (hung or not started)"))
    return results


OK = [("ok", 3.0), ("ok", 3.0)]  # each rank's global sum of rank + 1


def test_a_second_attempt_forms_its_group_whatever_order_its_ranks_start(tmp_path, agent):
    assert _attempt(tmp_path, agent, 1) == OK
    assert _attempt(tmp_path, agent, 1, first=1) == OK  # rank 1 reads the first attempt's keys
    assert _attempt(tmp_path, agent, 1, first=0) == OK  # rank 0 first


# Gloo retries a refused connection for about 5 s; a rank 0 later than that is what fails. 8 s
# (a loaded machine's import of torch and transformers alone) costs this test 9 s: cluster.


@pytest.mark.cluster
def test_a_second_attempt_whose_rank_0_comes_late(tmp_path, agent):
    assert _attempt(tmp_path, agent, 1) == OK
    assert _attempt(tmp_path, agent, 1, first=1, delays=(8.0, 0.0)) == OK


# torch's env:// path in the order that fails: rank 1 either connects to the dead address (refused
# at once) or, gloo's side of that pair being decided by the addresses, waits for the dead rank 0 to
# connect (5 collective timeouts: 10 s, about one run in two): cluster.


@pytest.mark.cluster
def test_without_a_prefix_per_attempt_the_second_attempt_reads_the_first_ones_keys(tmp_path, agent):
    """What ``attempt_store`` prevents: torch's ``env://`` path in the same sequence. Rank 1 ends
    before rank 0 starts (it writes no FIRST_KEY; rank 0 is then not started at all), so the only
    rank 0 address it can have tried is the dead one's (were there none, it would wait for one in
    the store and time out there instead)."""
    assert _attempt(tmp_path, agent, 0) == OK
    second = _attempt(tmp_path, agent, 0, first=1, timeout=2.0, wait_s=30.0)
    assert second[0] == ("error", "no result (hung or not started)"), second
    assert second[1][0] == "error" and "Gloo connectFullMesh failed" in second[1][1], second
