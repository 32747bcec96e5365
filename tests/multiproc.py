"""Run a function on W forked processes joined in one gloo process group, and collect the results.

Forking from the already-imported test process starts a rank in about a tenth of a second (spawn or
torchrun take 5–10 s: every process imports torch and transformers again). Each rank gets the
environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), one intra-op thread
(tiny models on two shared cores are all synchronisation overhead otherwise), a process group over
a file store with a short timeout, and returns its result through a file. The parent waits with a
deadline, so a hang fails the test instead of stalling the suite; a rank still running then writes
the stacks of its threads (faulthandler, ``HUNG_SIGNAL``) into the failure before it is killed.

Fork, not spawn or forkserver, and what fork needs (issue 39). A forked child has only the thread
that forked; objects that own a thread of the parent come with it, their thread does not. Measured
on a hung rank of ``make test-cluster`` (py-spy): a failed test's ``TCPStore`` master was left as
cyclic garbage in the pytest process (its traceback's frames) with its server thread
``pt_tcpstore_uv`` alive; the next test forked its ranks; in a rank, the garbage collector (run by
an allocation in DCP's save) freed the inherited store, whose destructor ``~LibUVStoreDaemon`` waits
in ``std::thread::join`` for the server thread — forever. Why forever (a 20-line reproduction, gdb):
glibc's fork handler reclaims the stacks of the threads the child lacks, and the first thread the
child starts (gloo's ``gloo_tcp_loop``, when the rank joins its process group) gets that stack, so
the old ``pthread_t`` is now a live thread that never ends. Which test hangs is which rank collects
first, so it changes from run to run. Hence every fork here goes through ``fork()``: the parent
collects its garbage first if a store's server thread or a process group's thread is alive (a
leaked store dies where its thread lives), refuses to fork while one still is (a store the caller
holds: serve it from a process of its own, as ``tests/distributed/test_restart_store.py`` does), and
the child freezes what it inherited (``gc.freeze``, the collector off across the fork: never
collected, so never destroyed there; either measure alone ends the hang). That keeps fork's tenth of
a second; spawn would cost 5–10 s a launch and make ``fn`` picklable by reference only, for a cause
fork can avoid. ``tests/distributed/test_multiproc_helper.py`` plants the failing test before a
forked one.

``run_ranks(W, fn, *args)`` → ``[fn(*args) on rank 0, ..., on rank W-1]``; with fork any callable
works. ``launch`` runs a command (``torchrun``) in a process group of its own that is killed with all
its workers when the test ends, passed or failed.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


class RankFailed(AssertionError):
    pass


HUNG_SIGNAL = signal.SIGUSR1  # a rank past its deadline writes its threads' stacks on this signal

# Threads torch.distributed starts: a TCPStore's server (pt_tcpstore, pt_tcpstore_uv) and a gloo
# process group's (pt_gloo_runloop, gloo_tcp_loop). Their objects must not cross a fork (above).
DIST_THREADS = ("pt_tcpstore", "pt_gloo", "gloo_")


def dist_threads() -> list[str]:
    """The names of this process's threads that torch.distributed started (Linux; [] elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(DIST_THREADS):
            names.append(name)
    return sorted(names)


def _forked(gc_was_enabled: bool, target, args) -> None:
    gc.freeze()  # what the parent left, garbage included, is never collected (so destroyed) here
    if gc_was_enabled:
        gc.enable()
    target(*args)


def fork(target, *args) -> mp.Process:
    """Start ``target(*args)`` in a forked process (started; the caller joins it), from a process
    that serves no store and holds no process group: the parent's garbage is collected first if
    such a thread is alive, and RuntimeError names any still alive after that."""
    if dist_threads():
        gc.collect()  # a store left as garbage (a failed test's traceback) dies here, with its thread
    live = dist_threads()
    if live:
        raise RuntimeError(
            f"refusing to fork: this process still runs torch.distributed threads {live} (a TCPStore "
            "master or a process group someone holds); a forked child that frees its copy waits "
            "forever for a thread it does not have. Close it first, or serve it from a process of "
            "its own (tests/multiproc.py)"
        )
    enabled = gc.isenabled()
    gc.disable()  # no collection between the fork and the child's gc.freeze()
    try:
        proc = mp.get_context("fork").Process(target=_forked, args=(enabled, target, args))
        proc.start()
    finally:
        if enabled:
            gc.enable()
    return proc


def stop(procs: list[mp.Process]) -> None:
    """Kill and reap each process still running."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def _child(rank: int, world: int, store: str, out: str, timeout_s: float, fn, args, kwargs) -> None:
    code = 0
    # a rank that dies of a signal (a crash in native code) leaves its stack here for the parent
    faults = open(out + ".faults", "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=faults, all_threads=True)
    faulthandler.register(HUNG_SIGNAL, file=faults, all_threads=True)  # and a hung one, on request
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


def _written(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


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
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world)]
        procs: list[mp.Process] = []
        try:
            for r in range(world):
                procs.append(
                    fork(_child, r, world, store, outs[r], collective_timeout_s, fn, args, kwargs)
                )
            t0 = time.monotonic()
            for p in procs:
                p.join(max(0.0, timeout_s - (time.monotonic() - t0)))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in hung:  # each writes its threads' stacks before it is killed
                os.kill(procs[r].pid, HUNG_SIGNAL)
            t1 = time.monotonic()
            while (
                hung
                and time.monotonic() - t1 < 2.0
                and not all(_written(outs[r] + ".faults") for r in hung)
            ):
                time.sleep(0.05)
            if hung:
                time.sleep(0.2)  # the rest of the stacks
        finally:
            stop(procs)  # also when this test is interrupted or failed above
        results = []
        for r in range(world):
            try:
                with open(outs[r], "rb") as fh:
                    results.append(pickle.load(fh))
            except FileNotFoundError:
                results.append(("error", _no_result(procs[r].exitcode, outs[r] + ".faults")))
    if hung and not expect_failure:
        raise RankFailed(
            f"ranks {hung} did not finish within {timeout_s} s\n"
            + "\n".join(f"rank {r}: {results[r][1]}" for r in hung)
        )
    if expect_failure:
        return results
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status != "ok"]
    if errors:
        raise RankFailed("\n".join(errors))
    return [value for _, value in results]


@contextlib.contextmanager
def launch(cmd: list[str], **popen_kwargs):
    """``subprocess.Popen(cmd, ...)`` in a session of its own; when the block ends (returned,
    failed or interrupted) the whole process group — torchrun and every worker it started — is
    killed if still running, and reaped."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def run_launched(cmd: list[str], timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, ...)`` through
    ``launch``: a timeout kills torchrun's workers too, not torchrun alone."""
    with launch(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs
    ) as p:
        out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``, from /proc (Linux)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return False
