"""The forked-ranks helper of the multi-process tests (tests/multiproc.py): a rank that dies of a
signal is reported with the signal's name and the stack faulthandler wrote, so a crash in CI says
where it happened (a CI run once read only "rank 0: no result (killed or hung)")."""

from __future__ import annotations

import os
import signal

from multiproc import run_ranks


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
