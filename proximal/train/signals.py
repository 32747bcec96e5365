"""Pre-emption: the signals that ask a run to stop, and what a run does with them.

Clusters stop jobs with a signal and a grace period before ``SIGKILL``: SLURM sends ``SIGTERM`` at
the time limit (or the signal of ``--signal``, often ``SIGUSR1``, some minutes before), Kubernetes
sends ``SIGTERM`` on eviction, ``torchrun`` forwards the ``SIGTERM`` and ``SIGINT`` it receives to
every worker, and a person presses Ctrl-C (``SIGINT``). While a run trains, each of these only
*asks* it to stop: the handler records the signal and returns, the step in progress finishes, and at
the step boundary the run writes a checkpoint of that step (due or not) and ends —
:class:`Stopped`, exit status ``EXIT_PREEMPTED`` for ``SIGTERM``/``SIGUSR1`` (the scheduler requeues
on it), 130 for ``SIGINT`` (``proximal.train.command``). Under torchrun the ranks agree at every step
boundary whether any of them was signalled (:meth:`proximal.train.run.Run.checkpoint_due`), so they
stop after the same step and save together.

So the wait is bounded: a signal that arrives during a step costs at most the rest of that step
plus the checkpoint; before the first step (models loading) the run stops at
:meth:`~proximal.train.run.Run.begin` without writing anything.

A second request stops at once: ``SIGINT`` raises ``KeyboardInterrupt``, ``SIGTERM``/``SIGUSR1``
raise :class:`Stopped` from wherever the process is — in the middle of a checkpoint too, whose
temporary directory is then removed, so the previous checkpoint stays intact and ``latest``
(``proximal.train.checkpoint``). The same signal again within :data:`REPEAT_S` seconds of the first
is not a second request but the first delivered twice (torchrun forwards the ``SIGTERM`` that
SLURM also sends to every process of the job step).

Python runs a handler between bytecodes of the main thread, so a signal that arrives during one
long native call (a large matrix product, a collective) is seen when that call returns.
"""

from __future__ import annotations

import signal
import threading
import time

#: The signals that ask a run to stop (SIGUSR1: SLURM's ``--signal=USR1@<seconds>``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: Seconds within which the same signal again is the first one delivered twice, not a second request.
REPEAT_S = 1.0


class Stopped(BaseException):
    """The run stopped on a signal (a ``BaseException``, as ``KeyboardInterrupt`` is, so that no
    ``except Exception`` on the way out swallows it).

    ``signum``: the signal; ``everywhere``: every rank raised it alike (a stop agreed at a step
    boundary: rank 0 alone reports it), rather than this rank alone (a second signal)."""

    def __init__(self, message: str, signum: int, *, everywhere: bool):
        super().__init__(message)
        self.signum = signum
        self.everywhere = everywhere


def name(signum: int) -> str:
    return signal.Signals(signum).name


class _State:
    signum: int = 0  # the first stop signal received (0: none)
    at: float = 0.0  # when (time.monotonic)
    stopping: bool = False  # the run is already on its way out: later signals change nothing
    previous: dict[int, object] = {}  # the handlers ours replaced


_state = _State()


def _handler(signum: int, frame) -> None:
    now = time.monotonic()
    if _state.stopping:
        return
    if _state.signum == 0:
        _state.signum, _state.at = signum, now
        return
    if signum == _state.signum and now - _state.at < REPEAT_S:
        return  # the first request delivered twice (a launcher and a scheduler)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(
        f"stopped at once by a second stop signal ({name(signum)} after "
        f"{name(_state.signum)}): the step in progress and any checkpoint being written are "
        "lost; the run continues from its last complete checkpoint (checkpoints/latest)",
        signum,
        everywhere=False,
    )


def install() -> bool:
    """Handle :data:`STOP_SIGNALS` as above, from now until :func:`restore`; forget any signal a
    previous run received. False (and nothing done) outside the main thread, where Python cannot
    install handlers: such a run stops on a signal as a plain process does."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state.signum, _state.at, _state.stopping = 0, 0.0, False
    for s in STOP_SIGNALS:
        if s not in _state.previous:
            _state.previous[s] = signal.getsignal(s)
        signal.signal(s, _handler)
    return True


def restore() -> None:
    """Put back the handlers :func:`install` replaced (no-op when none are installed)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s, handler in _state.previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    _state.previous.clear()
    _state.signum, _state.stopping = 0, False


def received() -> int:
    """The first stop signal received since :func:`install` (0: none)."""
    return _state.signum


def stopping() -> None:
    """The run is leaving because of the signal: further signals are ignored on the way out."""
    _state.stopping = True
