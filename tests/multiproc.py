"""Run a function on W forked processes joined in one gloo process group, and collect the results.

Forking from the already-imported test process starts a rank in about a tenth of a second (spawn or
torchrun take 5–10 s: every process imports torch and transformers again). Each rank gets the
environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), one intra-op thread
(tiny models on two shared cores are all synchronisation overhead otherwise), a process group over
a file store with a short timeout, and returns its result through a file. The parent waits with a
deadline, so a hang fails the test instead of stalling the suite.

``run_ranks(W, fn, *args)`` → ``[fn(*args) on rank 0, ..., on rank W-1]``; ``fn`` must be picklable
by reference (a module-level function) only if spawn were used — with fork any callable works.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import traceback
from pathlib import Path


class RankFailed(AssertionError):
    pass


def _child(rank: int, world: int, store: str, out: str, timeout_s: float, fn, args, kwargs) -> None:
    code = 0
    # a rank that dies of a signal (a crash in native code) leaves its stack here for the parent
    faults = open(out + ".faults", "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=faults, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
            }
        )
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    try:
        with open(out, "wb") as fh:
            pickle.dump(result, fh)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _no_result(exitcode: int | None, faults: str) -> str:
    """Why a rank left no result: its exit code (a signal by name) and, where it crashed, the stack
    faulthandler wrote."""
    how = f"exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        try:
            how += f", {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    try:
        stack = Path(faults).read_text().strip()
    except OSError:
        stack = ""
    return f"no result (killed or hung; {how})" + (f"\n{stack}" if stack else "")


def run_ranks(
    world: int,
    fn,
    *args,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    expect_failure: bool = False,
    **kwargs,
):
    """``fn(*args, **kwargs)`` on ``world`` ranks; the list of their results (rank order).

    Raises RankFailed with every failing rank's traceback, or if the ranks are not done within
    ``timeout_s``. With ``expect_failure`` the list holds ``("error", message)`` / ``("ok", value)``
    pairs instead, so a test can check how a failure was reported.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world, store, outs[r], collective_timeout_s, fn, args, kwargs),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = timeout_s
        import time

        t0 = time.monotonic()
        for p in procs:
            p.join(max(0.0, deadline - (time.monotonic() - t0)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world):
            try:
                with open(outs[r], "rb") as fh:
                    results.append(pickle.load(fh))
            except FileNotFoundError:
                results.append(("error", _no_result(procs[r].exitcode, outs[r] + ".faults")))
    if hung and not expect_failure:
        raise RankFailed(f"ranks {hung} did not finish within {timeout_s} s")
    if expect_failure:
        return results
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status != "ok"]
    if errors:
        raise RankFailed("\n".join(errors))
    return [value for _, value in results]
