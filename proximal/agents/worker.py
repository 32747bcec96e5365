"""Worker processes that run the user's tools and environments, so that none can hold the run.

A thread that hangs cannot be stopped from Python; a process can. Every tool call, every
environment's ``reset``/``step``/method runs in one of a :class:`WorkerPool`'s processes; a call
still running ``timeout_s`` after it started is ended by killing its process (SIGKILL), which is
replaced by a fresh one. An exception in the user's code comes back as its text; a result that is
not text is turned into text in the worker (:func:`as_text`), so nothing unpicklable crosses the
pipe.

Environments live in the workers too (they hold the trajectory's state, and their methods are
tools): trajectory ``slot`` b is served by worker b mod n, which keeps its environment object
between calls. A worker killed for a timeout loses the environments it held; their later calls
answer ``"lost"`` and their trajectories end.

**Cost** (docs/agents.md; measured by tests/agents/test_tools.py::test_worker_cost on this
project's 2-core CPU machine): a call's round trip through a worker is about 50 µs on top of the
tool's own time; starting a worker (a fresh interpreter importing this module, :class:`_Worker`)
and its first call about 40 ms, paid when the pool starts and again for every worker replaced
after a timeout.

This module imports neither torch nor transformers: it is what a worker process imports.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
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


def main(fd: int) -> None:
    """A worker process's entry point: serve requests on the socket ``fd`` until it closes."""
    _serve(Connection(fd))


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
    request to the slot's environment (answered ``"lost"`` if its worker was replaced since the
    environment was made)."""

    slot: int
    request: tuple
    env: bool = False


class _Worker:
    """One worker: a fresh interpreter running :func:`main`, reached through a socket pair.

    Started with :mod:`subprocess`, not :mod:`multiprocessing`'s ``spawn``: that one imports the
    parent's main script again in the child, which runs a user's training script a second time
    unless it has an ``if __name__ == "__main__":`` guard; ``fork`` would copy a process that holds
    torch's threads."""

    def __init__(self):
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from proximal.agents.worker import main; main({theirs.fileno()})",
            ],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(mine.detach())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.conn.close()


class WorkerPool:
    """``n`` worker processes; :meth:`run` executes a list of jobs, each slot's jobs in order on
    worker slot mod n, different workers in parallel, each job under ``timeout_s`` from its start.

    Outcomes, one per job: ``("ok", value)``; ``("error", text)`` — the code raised;
    ``("timeout", text)`` — killed after ``timeout_s`` (its worker replaced); ``("lost", text)`` —
    the worker died, or the slot's environment went with a replaced worker.

    ``n = 0`` runs everything in this process: no timeout can be enforced (a debugging mode, and
    what a test of the trajectory logic uses to stay fast).
    """

    def __init__(self, n: int, timeout_s: float | None):
        if n < 0:
            raise ValueError(f"WorkerPool: n must be ≥ 0, got {n}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"WorkerPool: timeout_s must be > 0 or None, got {timeout_s}")
        self.n, self.timeout_s = n, timeout_s
        self._workers: list[_Worker | None] = [None] * n
        self._generation = [0] * n  # bumped each time a worker is replaced
        self._made_in: dict[int, int] = {}  # slot -> generation of the worker holding its env
        self._local = Handler() if n == 0 else None
        self.replaced = 0  # workers killed and replaced (timeouts, deaths)

    def _worker(self, w: int) -> _Worker:
        if self._workers[w] is None:
            self._workers[w] = _Worker()
        return self._workers[w]

    def _replace(self, w: int) -> None:
        worker = self._workers[w]
        if worker is not None:
            worker.kill()
        self._workers[w] = None
        self._generation[w] += 1
        self.replaced += 1

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

        def start_next(w: int) -> None:
            while queues.get(w):
                i = queues[w].popleft()
                job = jobs[i]
                if job.env and job.request[0] != "new":
                    if self._made_in.get(job.slot) != self._generation[w]:
                        out[i] = ("lost", "the environment was lost with its worker")
                        continue
                if job.request[0] == "new":
                    self._made_in[job.slot] = self._generation[w]
                try:
                    self._worker(w).conn.send(job.request)
                except Exception as e:  # e.g. a tool function that cannot be pickled
                    out[i] = ("error", f"could not send the call to a worker ({error_text(e)})")
                    continue
                limit = self.timeout_s if self.timeout_s is not None else float("inf")
                busy[w] = (i, time.monotonic() + limit)
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
                i, _ = busy.pop(w)
                try:
                    out[i] = conn.recv()
                except (EOFError, OSError):
                    out[i] = ("lost", "the worker process died")
                    self._replace(w)
                start_next(w)
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[w]
                    out[i] = ("timeout", f"no result within tools.timeout_s = {self.timeout_s:g} s")
                    self._replace(w)
                    start_next(w)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for w in range(self.n):
            worker = self._workers[w]
            if worker is not None:
                worker.conn.close()  # the worker's loop ends at EOF
                try:
                    worker.process.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    worker.kill()
            self._workers[w] = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
