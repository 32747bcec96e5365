"""Worker processes that run the user's tools and environments, so that none can hold the run.

A thread that hangs cannot be stopped from Python; a process can. Every tool call, every
environment's ``reset``/``step``/method runs in one of a :class:`WorkerPool`'s processes; a call
still running ``timeout_s`` after it started is ended by killing its process group (SIGKILL: the
worker and whatever the user's code started), and the worker is replaced by a fresh one.

**Nothing outlives the run.** Each worker leads its own session and process group
(``start_new_session``: the child calls ``setsid()`` before it runs Python), so a timeout or
:meth:`WorkerPool.close` kills the worker with every process a tool started (``killpg``), and the
worker is reaped. A worker dies with its trainer even when the trainer is SIGKILLed: on Linux the
kernel sends it SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, set first thing in
:func:`main`, then the parent's pid is checked, for a parent that died before that); a watchdog
thread in the worker polls ``getppid()`` every 0.5 s and kills the worker's whole group when the
parent is gone — the guard on other systems, and the one for a pool started from a thread other
than the main one (``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits,
which would kill a healthy worker, so it is not set then); and a guardian process in the worker's
group (:func:`_guardian`) waits on a pipe only the trainer holds open and kills the group when it
closes — so what a tool started dies with the trainer too (the kernel's SIGKILL leaves the
worker no time to), and a worker whose main thread holds the GIL in a C call still goes.

A tool's own prints (stdout, stderr — its children's too) go to ``log`` (the run's ``tools.log``),
at most :data:`LOG_CAP` bytes of it, then one line saying the rest was dropped: never to the
trainer's stdout. An exception in the user's code comes back as its text; a result that is
not text is turned into text in the worker (:func:`as_text`), so nothing unpicklable crosses the
pipe.

Environments live in the workers too (they hold the trajectory's state, and their methods are
tools): trajectory ``slot`` b is served by worker b mod n, which keeps its environment object
between calls. A worker killed for a timeout or a crash loses the environments it held: the
trajectory whose call killed it fails (its later calls answer ``"lost"``); the others it held did
nothing wrong (their calls answer ``"evicted"``) and are run again from their own reset
(:mod:`proximal.agents.trajectory`).

**Cost** (docs/agents.md; measured by tests/agents/test_tools.py::test_worker_cost on this
project's 2-core CPU machine): a call's round trip through a worker is about 50 µs on top of the
tool's own time; starting a worker (a fresh interpreter importing this module, :class:`_Worker`)
and its first call about 40 ms, paid when the pool starts and again for every worker replaced
after a timeout.

This module imports neither torch nor transformers: it is what a worker process imports.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any


def as_text(value: Any) -> str:
    """A tool's result as the text of its observation: a string as it is, anything JSON can write as
    JSON (``56088`` → ``"56088"``, ``{"a": 1}`` → ``'{"a": 1}'``), anything else as ``str()``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def error_text(e: BaseException) -> str:
    """An exception as the text the policy reads: ``"ValueError: bad expression"``."""
    return f"{type(e).__name__}: {e}"


#: Bytes of the tools' prints kept in ``tools.log``; past it one line says the rest was dropped.
LOG_CAP = 10 * 2**20

#: How often a worker's watchdog checks that its trainer is alive (seconds).
WATCH_S = 0.5


def main(
    fd: int, parent: int, pdeathsig: bool = True, log: str | None = None, alive: int | None = None
) -> None:
    """A worker process's entry point: guard against outliving ``parent`` (the trainer's pid: the
    module docstring; ``alive``, the read end of a pipe only the trainer can write to, for the
    guardian), send its tools' prints to ``log``, say it is ready, and serve requests on the socket
    ``fd`` until it closes."""
    if alive is not None:  # first, while this process has one thread: it forks
        _guardian(alive, fd)
    if pdeathsig:
        _die_with_parent()
    if os.getppid() != parent:  # the trainer died before the guard was set
        _kill_group()
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    copier = _capture_output(log) if log is not None else None
    conn = Connection(fd)
    conn.send(("ready", os.getpid()))
    _serve(conn)
    if copier is not None:  # the last prints reach the log before the worker ends
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(1)
        os.close(2)
        copier.join(timeout=1)


def _guardian(alive: int, fd: int) -> None:
    """Fork the guardian: a process of this worker's group that blocks reading ``alive`` (nothing
    is ever written; the end of file comes when the trainer is gone, however it ended) and then
    kills the group — the worker, if the kernel has not already, and whatever its tools started and
    left running, which ``PR_SET_PDEATHSIG`` alone would leave behind. It is killed with the group
    when the pool ends or replaces the worker."""
    if os.fork() == 0:
        try:
            os.close(fd)  # the worker's socket: the trainer must see it close when the worker dies
            while os.read(alive, 1):
                pass
        finally:
            _kill_group()
    os.close(alive)


def _die_with_parent() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux: the kernel kills this process when the thread
    that started it exits. Nothing elsewhere (the watchdog stands in)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: the watchdog alone
        pass


def _kill_group() -> None:
    """Kill this worker's process group — the worker and every process its tools started."""
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def _watch(parent: int) -> None:
    """The watchdog: once the trainer is gone (this process was handed to another parent), kill
    the group."""
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    _kill_group()


def _capture_output(path: str) -> threading.Thread:
    """Point this process's stdout and stderr (fds 1 and 2, so child processes too) at a pipe whose
    reader appends to ``path`` up to :data:`LOG_CAP` bytes (every worker of a run shares the file),
    then writes one line saying the rest is dropped, and drops it."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)

    def copy() -> None:
        # opened at the first print (a call runs in a step, once the run directory exists), and
        # drained to the end whatever happens, so a tool never blocks on a full pipe
        f, full = None, False
        while chunk := os.read(read, 65536):
            if full:
                continue
            try:
                f = f or open(path, "ab", buffering=0)  # noqa: SIM115 - open for the thread's life
                room = LOG_CAP - f.seek(0, os.SEEK_END)
                f.write(chunk[: max(room, 0)])
                if len(chunk) > room:
                    f.write(
                        f"\n[tools.log: {LOG_CAP} bytes reached; worker {os.getpid()}'s further "
                        "output dropped]\n".encode()
                    )
                    full = True
            except OSError:  # the log cannot be written: the prints are dropped
                full = True
        if f is not None:
            f.close()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _serve(conn) -> None:
    """A worker's loop: one request in, one ``(status, value)`` out (:class:`Handler`), until the
    pipe closes."""
    handler = Handler(catch=BaseException)  # a tool calling sys.exit() must not end the worker
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            msg = pickle.loads(data)
        except Exception as e:  # e.g. a function defined in the parent's __main__
            conn.send(
                (
                    "error",
                    f"the worker could not load the call ({error_text(e)}); define "
                    "tools and environments in an importable module",
                )
            )
            continue
        out = handler.handle(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(out)
        except Exception as e:  # an environment's value that cannot be pickled
            conn.send(("error", f"the result could not be sent back ({error_text(e)})"))


class Handler:
    """What a worker does with a request; it keeps each slot's environment between requests.

    Requests: ``("call", fn, args, kwargs)`` runs a tool function, its result as text;
    ``("new", slot, factory, row)`` builds an environment for ``slot`` and returns ``reset(**row)``
    (None when it has no ``reset``); ``("method", slot, name, args, kwargs, text)`` calls that
    environment's method (its result as text when ``text``); ``("drop", slot)`` forgets it. Answers:
    ``("ok", value)`` or ``("error", "ExceptionType: message")``.
    """

    def __init__(self, catch: type[BaseException] = Exception):
        self.envs: dict[int, Any] = {}
        self.catch = catch

    def handle(self, msg: tuple) -> tuple[str, Any]:
        try:
            kind = msg[0]
            if kind == "call":
                _, fn, args, kwargs = msg
                return ("ok", as_text(fn(*args, **kwargs)))
            if kind == "new":
                _, slot, factory, row = msg
                self.envs[slot] = env = factory()
                reset = getattr(env, "reset", None)
                return ("ok", reset(**row) if callable(reset) else None)
            if kind == "method":
                _, slot, name, args, kwargs, text = msg
                value = getattr(self.envs[slot], name)(*args, **kwargs)
                return ("ok", as_text(value) if text else value)
            if kind == "drop":
                self.envs.pop(msg[1], None)
                return ("ok", None)
            return ("error", f"unknown request {kind!r}")
        except self.catch as e:  # the user's code raised: its text is the answer
            return ("error", error_text(e))


@dataclass
class Job:
    """One request for trajectory ``slot``: a tuple as :func:`_serve` reads it. ``env`` marks a
    request to the slot's environment (answered ``"lost"`` or ``"evicted"`` if its worker was
    replaced since the environment was made: :class:`WorkerPool`)."""

    slot: int
    request: tuple
    env: bool = False


def _command(
    fd: int, parent: int, pdeathsig: bool, log: str | None, alive: int | None = None
) -> list[str]:
    """The command line of a worker process: a fresh interpreter running :func:`main`. ``-c`` puts
    the working directory first on the import path; it is taken off, so that the parent's path
    (PYTHONPATH, :class:`_Worker`) decides, and a proximal checkout in the working directory cannot
    stand in for the trainer's own."""
    return [
        sys.executable,
        "-c",
        "import sys; sys.path[:] = [p for p in sys.path if p]; "
        "from proximal.agents.worker import main; "
        f"main({fd}, {parent}, {pdeathsig}, {log!r}, {alive})",
    ]


class _Worker:
    """One worker: a fresh interpreter running :func:`main`, reached through a socket pair, the
    leader of its own session and process group.

    Started with :mod:`subprocess`, not :mod:`multiprocessing`'s ``spawn``: that one imports the
    parent's main script again in the child, which runs a user's training script a second time
    unless it has an ``if __name__ == "__main__":`` guard; ``fork`` would copy a process that holds
    torch's threads. ``start_new_session`` makes the child call ``setsid()`` between fork and exec
    (in C, safe beside the parent's threads), so the group exists before this constructor returns
    and :meth:`kill` can never miss it. ``ready`` turns True when the worker's first message (it is
    up and guarded) has been read: a job's time limit starts then."""

    def __init__(self, log: str | None = None, alive: int | None = None):
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # PR_SET_PDEATHSIG fires when the starting *thread* exits: from another thread, the
        # watchdog alone guards the worker.
        main_thread = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(
            _command(theirs.fileno(), os.getpid(), main_thread, log, alive),
            pass_fds=(theirs.fileno(),) + ((alive,) if alive is not None else ()),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False
        self.started = time.monotonic()

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (its tools' children too), and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass
        self.process.wait(timeout=5)
        self.conn.close()


#: Seconds a fresh worker may take to start (an interpreter under load); not a job's time.
START_S = 120.0


#: Every pool of this process, for the child of a fork (:meth:`WorkerPool._forget_in_child`).
_POOLS: weakref.WeakSet = weakref.WeakSet()


def _forget_pools_in_child() -> None:
    for pool in list(_POOLS):
        pool._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


class WorkerPool:
    """``n`` worker processes; :meth:`run` executes a list of jobs, each slot's jobs in order on
    worker slot mod n, different workers in parallel, each job under ``timeout_s`` from its start —
    from when its worker is ready, so a replacement's start-up is not charged to the next call.

    Outcomes, one per job: ``("ok", value)``; ``("error", text)`` — the code raised;
    ``("timeout", text)`` — killed after ``timeout_s`` (its worker replaced); ``("lost", text)`` —
    the worker died under this job, or this slot's own call killed the worker that held its
    environment; ``("evicted", text)`` — the slot's environment went with a worker that *another*
    slot's call killed: this slot did nothing wrong (:class:`~proximal.agents.env.Environments`
    runs its trajectory again from its reset).

    ``n = 0`` runs everything in this process: no timeout can be enforced (a debugging mode, and
    what a test of the trajectory logic uses to stay fast). ``log``: the file the workers' prints
    go to (None: this process's stdout and stderr).
    """

    def __init__(self, n: int, timeout_s: float | None, log: str | None = None):
        if n < 0:
            raise ValueError(f"WorkerPool: n must be ≥ 0, got {n}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"WorkerPool: timeout_s must be > 0 or None, got {timeout_s}")
        self.n, self.timeout_s, self.log = n, timeout_s, log
        self._workers: list[_Worker | None] = [None] * n
        self._generation = [0] * n  # bumped each time a worker is replaced
        self._made_in: dict[int, int] = {}  # slot -> generation of the worker holding its env
        self._culprits: set[int] = set()  # slots whose own call killed their environment's worker
        self._local = Handler() if n == 0 else None
        self.replaced = 0  # workers killed and replaced (timeouts, deaths)
        # The workers' guardians read the first end; this process alone holds the second (not
        # inheritable, and closed in a child this process forks: _forget_in_child), so they see
        # the end of file only when it is gone.
        self._alive: tuple[int, int] | None = None
        _POOLS.add(self)

    def _forget_in_child(self) -> None:
        """In a child this process forked (without exec: a forked rank, a multiprocessing worker):
        close the pipe's ends the child inherited, so the guardians still see the end of file when
        the trainer is gone, and forget the parent's workers (the child must neither use nor kill
        them)."""
        if self._alive is not None:
            for end in self._alive:
                try:
                    os.close(end)
                except OSError:
                    pass
        self._alive = None
        self._workers = [None] * self.n

    def _worker(self, w: int) -> _Worker:
        if self._alive is None and os.name == "posix":
            self._alive = os.pipe()
        if self._workers[w] is None:
            self._workers[w] = _Worker(self.log, self._alive[0] if self._alive else None)
        return self._workers[w]

    def _replace(self, w: int, culprit: int | None = None) -> None:
        worker = self._workers[w]
        if worker is not None:
            worker.kill()
        if culprit is not None and self._made_in.get(culprit) == self._generation[w]:
            self._culprits.add(culprit)
        self._workers[w] = None
        self._generation[w] += 1
        self.replaced += 1

    def forget(self) -> None:
        """A new batch: no slot has an environment, none is to blame."""
        self._made_in.clear()
        self._culprits.clear()

    def start(self) -> None:
        """Start every worker now (else each starts at its first job)."""
        for w in range(self.n):
            self._worker(w)

    def run(self, jobs: list[Job]) -> list[tuple[str, Any]]:
        if self.n == 0:
            return [self._local.handle(j.request) for j in jobs]
        out: list[tuple[str, Any] | None] = [None] * len(jobs)
        queues: dict[int, deque[int]] = {}
        for i, job in enumerate(jobs):
            queues.setdefault(job.slot % self.n, deque()).append(i)
        busy: dict[int, tuple[int, float]] = {}  # worker -> (job, deadline)
        limit = self.timeout_s if self.timeout_s is not None else float("inf")

        def start_next(w: int) -> None:
            while queues.get(w):
                i = queues[w].popleft()
                job = jobs[i]
                if job.env and job.request[0] != "new":
                    if self._made_in.get(job.slot) != self._generation[w]:
                        if job.slot in self._culprits:
                            out[i] = ("lost", "the environment was lost with its worker")
                        else:
                            out[i] = (
                                "evicted",
                                "the environment was lost with a worker another trajectory's "
                                "call killed",
                            )
                        continue
                if job.request[0] == "new":
                    self._made_in[job.slot] = self._generation[w]
                    self._culprits.discard(job.slot)
                worker = self._worker(w)
                try:
                    worker.conn.send(job.request)
                except Exception as e:  # e.g. a tool function that cannot be pickled
                    out[i] = ("error", f"could not send the call to a worker ({error_text(e)})")
                    continue
                # a worker still starting: the job's clock starts when it is ready (below)
                busy[w] = (
                    i,
                    time.monotonic() + limit if worker.ready else worker.started + START_S,
                )
                return

        for w in list(queues):
            start_next(w)
        while busy:
            now = time.monotonic()
            soonest = min(d for _, d in busy.values())
            conns = {self._workers[w].conn: w for w in busy}
            ready = wait(
                list(conns), timeout=None if soonest == float("inf") else max(0.0, soonest - now)
            )
            for conn in ready:
                w = conns[conn]
                worker = self._workers[w]
                i, _ = busy.pop(w)
                try:
                    answer = conn.recv()
                except (EOFError, OSError):
                    out[i] = ("lost", "the worker process died")
                    self._replace(w, jobs[i].slot)
                    start_next(w)
                    continue
                if not worker.ready:  # ("ready", pid): the job's time starts now
                    worker.ready = True
                    busy[w] = (i, time.monotonic() + limit)
                    continue
                out[i] = answer
                start_next(w)
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[w]
                    if self._workers[w].ready:
                        text = f"no result within tools.timeout_s = {self.timeout_s:g} s"
                        out[i] = ("timeout", text)
                    else:
                        out[i] = ("lost", f"the worker process did not start within {START_S:g} s")
                    self._replace(w, jobs[i].slot)
                    start_next(w)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """End every worker and whatever its tools started (its process group), and reap it."""
        for w in range(self.n):
            worker = self._workers[w]
            if worker is not None:
                worker.conn.close()  # the worker's loop ends at EOF
                try:
                    worker.process.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
                worker.kill()  # its group: a tool's children still running, or a hung worker
            self._workers[w] = None
        if self._alive is not None:
            for end in self._alive:
                os.close(end)
            self._alive = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
