"""The forked-ranks helper of the multi-process tests (tests/multiproc.py): a rank that dies of a
signal is reported with the signal's name and the stack faulthandler wrote, so a crash in CI says
where it happened (a CI run once read only "rank 0: no result (killed or hung)"); a rank that hangs
is reported with its threads' stacks; and ranks are never forked from a process that runs a
TCPStore's server thread (issue 39: a failed test's store, left as garbage, hung the next test's
forked ranks)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as td
from multiproc import RankFailed, dist_threads, run_launched, run_ranks

TESTS = Path(__file__).resolve().parents[1]


def _crash_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return dist.get_rank()


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack():
    results = run_ranks(2, _crash_on_rank_1, timeout_s=60, expect_failure=True)
    assert results[0] == ("ok", 0)
    status, message = results[1]
    assert status == "error"
    assert message.startswith("no result (killed or hung; exit code -11, SIGSEGV)")
    assert "Fatal Python error: Segmentation fault" in message
    assert "_crash_on_rank_1" in message  # the crashing frame


def _stuck_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def test_a_hung_rank_is_reported_with_its_threads_stacks():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(2, _stuck_on_rank_1, timeout_s=2)
    message = str(failed.value)
    assert message.startswith(
        "ranks [1] did not finish within 2 s\nrank 1: no result (killed or hung"
    )
    assert "_stuck_on_rank_1" in message  # where it was stuck
    assert time.monotonic() - t0 < 30


def test_ranks_are_not_forked_while_this_process_serves_a_store():
    """A store the test still holds: forking now would copy it into every rank (RuntimeError)."""
    store = td.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )
    try:
        assert dist_threads() == ["pt_tcpstore_uv"]
        with pytest.raises(RuntimeError, match=r"refusing to fork: .*\['pt_tcpstore_uv'\]"):
            run_ranks(2, _crash_on_rank_1, timeout_s=60)
    finally:
        del store
    assert dist_threads() == []


# The sequence of issue 39, planted: a test that fails while holding a TCPStore master, then a test
# whose forked ranks run the garbage collector (as any rank's does at some point). The collector is
# off in the pytest process (as between two of its automatic runs), so the failed test's traceback,
# with the store, is garbage still in memory when the ranks are forked. Before the fix a rank froze
# in ~TCPStore (joining the server thread's pthread_t, which gloo's thread had taken over in the
# fork) and the forked test failed after its timeout.
PLANTED = """
import gc

import torch.distributed as td
from multiproc import run_ranks

gc.disable()


def _collect():
    import gc

    gc.collect()
    return "collected"


def test_fails_holding_a_store():
    store = td.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert store is None


def test_forks_after_it():
    assert run_ranks(2, _collect, timeout_s=20) == ["collected", "collected"]
"""


def test_a_failed_test_holding_a_store_does_not_hang_the_next_forked_one(tmp_path):
    (tmp_path / "test_planted.py").write_text(textwrap.dedent(PLANTED))
    done = run_launched(  # a session of its own: a timeout kills its hung ranks too
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_planted.py"],
        timeout=120,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        },
    )
    out = done.stdout
    assert "FAILED test_planted.py::test_fails_holding_a_store" in out, out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
