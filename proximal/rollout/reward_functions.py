"""Calling reward functions (verifiers): loading them by spec, TRL's call convention, the async loop
and the time limit. What they return is checked and turned into scores, which
:class:`proximal.rollout.scoring.Scorer` weighs and adds to a reward model's.

**Reward functions** are called the way TRL's ``GRPOTrainer`` calls them, so functions written for
it carry over: ``f(prompts=…, completions=…, completion_ids=…, **columns, step=…,
trainer_state=…)``, one list entry per completion (a prompt's G completions repeat its prompt and
its columns G times, in the rollout's order). ``prompts`` holds the prompt text, or the prompt's
messages when the row is conversational (and then each completion is ``[{"role": "assistant",
"content": text}]``, as in TRL); ``columns`` are the prompt row's other fields (``answer=`` …). A
function is given only what its signature accepts (everything, with ``**kwargs``), so the first
convention, ``f(prompts, completions)`` with two positional parameters, still works. An ``async
def`` function is awaited, the step's async functions concurrently, on one event loop of the process.

**The time limit** (``model.reward_timeout_s``): a function runs in the calling (main) thread — where
TRL runs it, where ``signal``-based timeouts inside verifiers work, and where its state stays its
own — under a watchdog thread. A call that outlives its limit cannot be stopped from outside in
Python, so the watchdog ends the process: one line naming the function, the step and the limit on
stderr, exit status 1 (:data:`EXIT_TIMEOUT`), with the run directory as the last checkpoint left it
(``--resume`` continues from there). For native code that holds the interpreter lock, where no
Python thread can run, the interpreter's own watchdog (``faulthandler``) ends the process
:data:`BACKSTOP_S` seconds later, printing ``Timeout`` and every thread's stack. The pre-emption
handlers (:mod:`proximal.train.signals`) are untouched: a first stop signal waits for the step, so
for the call (or its limit); a second one interrupts the function where Python code runs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import inspect
import numbers
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from proximal import dist
from proximal.config import ConfigError, PythonObject
from proximal.specs import import_spec

#: What proximal itself passes to a reward function beside the prompt row's columns (a column may not
#: take one of these names).
PASSED = ("prompts", "completions", "completion_ids", "step", "trainer_state")
#: ``model.reward_timeout_s``'s default: generous for a verifier over a whole batch (a judge behind an
#: API included), short beside an hour of a hung run.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds past the limit after which ``faulthandler`` ends a process our watchdog could not end
#: (a function in native code that never releases the interpreter lock).
BACKSTOP_S = 5.0
#: The exit status of a run whose reward function outlived its limit: a training failure, as a lost
#: process is (the input may be fine: a service the verifier calls may be down).
EXIT_TIMEOUT = 1
NAN = float("nan")


class RewardFunctionError(ValueError):
    """A reward function failed or returned something other than one number per completion; the
    message names the function (and the step)."""


class RewardServerLost(RuntimeError):
    """A reward served over HTTP (:mod:`proximal.rollout.reward_http`) whose server failed every try
    of a request: a training failure, exit status 1 (:data:`EXIT_TIMEOUT`), as a reward timeout is;
    the message names the source, the step, the tries and the last error."""


@dataclass(frozen=True)
class TrainerState:
    """What a TRL reward function reads from its ``trainer_state`` argument: ``global_step``, the step
    being scored (the ``step`` of metrics.jsonl, 1 for the first; None outside training)."""

    global_step: int | None


# ----------------------------------------------------------------------------------------------
# Loading and naming
# ----------------------------------------------------------------------------------------------


def load_reward_function(spec: str | Callable) -> Callable:
    """A callable as it is; ``module:function`` imported. ConfigError naming the spec when it can't
    (:func:`proximal.specs.import_spec`, the one import path of user code)."""
    return import_spec(spec, "reward function")


def reward_function_name(spec: str | Callable) -> str:
    """A reward function's name in metrics (``score/<name>``) and messages: its spec, or for a callable
    ``module:qualname`` as a spec would name it (the bare qualname for one defined in a script or a
    notebook, module ``__main__``; a ``functools.partial`` by the function it wraps)."""
    if isinstance(spec, str):
        return spec
    inner = spec.value if isinstance(spec, PythonObject) else spec
    while isinstance(inner, functools.partial):
        inner = inner.func
    qualname = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    module = getattr(inner, "__module__", None) or type(inner).__module__
    return qualname if module in (None, "__main__") else f"{module}:{qualname}"


def reward_function_names(specs: Sequence[str | Callable]) -> list[str]:
    """:func:`reward_function_name` of each, made unique: the second ``f`` is ``f#2``."""
    names, seen = [], {}
    for spec in specs:
        name = reward_function_name(spec)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def load_reward_functions(
    specs: Sequence[str | Callable],
    kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    field: str = "model.reward_function_kwargs",
) -> dict[str, Callable]:
    """``{name: function}`` for ``model.reward_functions`` (specs and callables), in order.

    ``kwargs`` (``model.reward_function_kwargs``, read from ``field``) maps a function's name (its
    spec; :func:`reward_function_names`) to the arguments of a *factory*: that spec is called with
    them once, here, and what it returns is the reward function (TRL's
    ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``). ConfigError naming the
    spec and the argument when the factory does not take them, raises, or returns no callable; and
    for a factory of :mod:`proximal.rewards` (``reward_function_factory``) named without them."""
    kwargs = kwargs or {}
    functions = {}
    for name, spec in zip(reward_function_names(specs), specs):
        fn = load_reward_function(spec)
        if name in kwargs:
            fn = build_reward_function(fn, kwargs[name], f"{field}[{name!r}]")
        elif getattr(fn, "reward_function_factory", False):
            raise ConfigError(
                f"reward function {name!r} is a factory of reward functions: give its arguments "
                f"in {field} ({{{name!r}: {{{', '.join(_parameters(fn))}}}}})"
            )
        functions[name] = fn
    return functions


def build_reward_function(factory: Callable, kwargs: Mapping[str, Any], where: str) -> Callable:
    """``factory(**kwargs)``, the reward function a factory spec makes; ConfigError naming ``where``
    (the field and the spec) and the argument it does not take or lacks, the exception it raised, or
    what it returned when that is not callable."""
    takes = ", ".join(_parameters(factory)) or "none"
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): the call says
        params = None
    if params is not None:
        if not any(p.kind == _P.VAR_KEYWORD for p in params):
            unknown = [k for k in kwargs if k not in {p.name for p in params if p.kind in _NAMED}]
            if unknown:
                raise ConfigError(f"{where}: no argument {unknown[0]!r} (its arguments: {takes})")
        missing = [
            p.name
            for p in params
            if p.kind in _NAMED and p.default is _P.empty and p.name not in kwargs
        ]
        if missing:
            raise ConfigError(f"{where}: argument {missing[0]!r} missing (its arguments: {takes})")
    try:
        fn = factory(**kwargs)
    except Exception as e:  # the factory's check of its arguments: one line, the user's mistake
        raise ConfigError(f"{where}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ConfigError(
            f"{where}: called with these arguments it returned {type(fn).__name__} {fn!r:.60}, not "
            "a reward function; only a factory (a function that returns the reward function) takes "
            "arguments here"
        )
    return fn


def _parameters(fn: Callable) -> list[str]:
    try:
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


# ----------------------------------------------------------------------------------------------
# What a function is given
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """How to call one function: ``positional`` — prompts and completions as its first two positional
    arguments (the first convention, parameters named anything) rather than by name; ``takes`` — the
    keywords it accepts (None: any, it has ``**kwargs``); ``required`` — keywords it cannot do without."""

    positional: bool
    takes: frozenset[str] | None
    required: tuple[str, ...]


_P = inspect.Parameter
_NAMED = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)


def _call_of(fn: Callable) -> _Call:
    """Read ``fn``'s signature: by name (TRL's way) when it names ``prompts`` or ``completions`` or
    takes only ``**kwargs``, else the first two positional parameters get prompts and completions."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): the first convention
        return _Call(True, frozenset(), ())
    named = {p.name for p in params if p.kind in _NAMED}
    any_keyword = any(p.kind == _P.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    by_name = bool(named & {"prompts", "completions"}) or (any_keyword and len(positional) < 2)
    rest = params if by_name else [p for p in params if p not in positional[:2]]
    required = tuple(
        p.name
        for p in rest
        if p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
    )
    if by_name:
        return _Call(False, None if any_keyword else frozenset(named), required)
    takes = {p.name for p in rest if p.kind in _NAMED}
    return _Call(True, None if any_keyword else frozenset(takes), required)


def _arguments(call: _Call, values: Mapping[str, Any]) -> tuple[list, dict]:
    """``(args, kwargs)`` for one call: what the function takes of ``values``."""
    args, rest = [], dict(values)
    if call.positional:
        args = [rest.pop("prompts"), rest.pop("completions")]
    if call.takes is not None:
        rest = {k: v for k, v in rest.items() if k in call.takes}
    return args, rest


def column_lists(columns: Sequence[Mapping[str, Any]] | None, n: int) -> dict[str, list]:
    """The rows' columns as keyword lists, one value per row (None where a row lacks the column), in
    the order the columns first appear. RewardFunctionError for a column named as an argument
    proximal passes (:data:`PASSED`)."""
    if not columns:
        return {}
    if len(columns) != n:
        raise ValueError(f"{len(columns)} rows of columns for {n} completions")
    keys = list(dict.fromkeys(k for row in columns for k in row))
    clash = [k for k in keys if k in PASSED]
    if clash:
        raise RewardFunctionError(_clash_message(clash[0]))
    return {k: [row.get(k) for row in columns] for k in keys}


def _clash_message(column: str) -> str:
    return (
        f"the prompts have a column {column!r}, the name of an argument proximal passes to reward "
        f"functions ({', '.join(PASSED)}); rename it with data.columns (e.g. "
        f"{{my_{column}: {column}}})"
    )


def reward_argument_problems(
    functions: Mapping[str, Callable], columns: Sequence[str], source: str
) -> list[str]:
    """What stops ``functions`` from being called on prompt rows with ``columns`` (read from
    ``source``): a parameter without a default that is neither a column nor passed by proximal, or a
    column that takes the name of one proximal passes. Checked before any model loads."""
    if not functions:
        return []
    problems = [_clash_message(c) for c in columns if c in PASSED]
    have = set(columns) | set(PASSED)
    for name, fn in functions.items():
        call = _call_of(fn)
        missing = [r for r in call.required if r not in have]
        if missing:
            problems.append(
                f"reward function {name!r} needs argument {missing[0]!r}, which is not a column of "
                f"{source} (columns: {', '.join(columns) or 'none besides the prompt'}) nor one "
                f"proximal passes ({', '.join(PASSED)}); add the column, map one to it with "
                f"data.columns ({{{missing[0]}: <column>}}) or give the parameter a default"
            )
    return problems


# ----------------------------------------------------------------------------------------------
# Calling: results checked, async functions awaited, every call under the time limit
# ----------------------------------------------------------------------------------------------


def call_reward_functions(
    functions: Mapping[str, Callable],
    values: Mapping[str, Any],
    *,
    n: int,
    step: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(scores, scored)``: each function's (n,) scores, by name, in order — float32 as the trainers
    add them up, or ``dtype`` (the held-out evaluations keep float64, the functions' own Python
    floats) — and its (n,) bool mask of the completions it scored.

    ``values`` — every argument proximal offers (:data:`PASSED` and the columns, each a list of ``n``
    where it is per completion); each function gets what its signature takes. Synchronous functions
    run one after another, each under ``timeout_s``; the awaitables of async ones are then awaited
    together, under ``timeout_s`` as a whole. ``None`` for a completion means the function does not
    apply to it (TRL's convention): its score there is NaN and ``scored`` False. NaN is allowed (the
    trainer's ``rollout.nonfinite_scores`` decides; ``scored`` True); anything else than one real
    number or None per completion, an exception or a missing argument is a RewardFunctionError naming
    the function and the step (an exception: and the line of the user's code it came from)."""
    at = f" at step {step}" if step is not None else ""
    scores: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    pending: list[tuple[str, Any]] = []
    for name, fn in functions.items():
        call = _call_of(fn)
        args, kwargs = _arguments(call, values)
        missing = [r for r in call.required if r not in kwargs]
        if missing:
            raise RewardFunctionError(
                f"reward function {name!r}{at} needs argument {missing[0]!r}, which the prompt rows "
                f"do not have (arguments given: {', '.join(values)})"
            )
        with deadline(timeout_s, lambda name=name: _late([name], step, timeout_s)):
            try:
                out = fn(*args, **kwargs)
            except Exception as e:  # the user's code: report it as theirs, in one line
                if isinstance(e, RewardServerLost) or getattr(fn, "served", False):
                    raise  # a reward served over HTTP says its own line (reward_http)
                raise RewardFunctionError(_raised(name, at, e)) from e
        if inspect.isawaitable(out):
            pending.append((name, out))
        else:
            scores[name] = _as_scores(name, out, n, at, dtype)
    if pending:
        for (name, _), out in zip(pending, _await_together(pending, step, timeout_s)):
            if isinstance(out, Exception):
                raise RewardFunctionError(_raised(name, at, out)) from out
            scores[name] = _as_scores(name, out, n, at, dtype)
    return (
        {name: scores[name][0] for name in functions},
        {name: scores[name][1] for name in functions},
    )


def _as_scores(
    name: str, values: Any, n: int, at: str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, scored)`` of one function's result: NaN and False where it returned None."""
    where = f"reward function {name!r}{at}"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"{where} returned {type(values).__name__} {values!r:.60}; it must return a "
            f"list of {n} numbers, one per completion (None where it does not apply)"
        )
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != n:
        raise RewardFunctionError(
            f"{where} returned {len(values)} score{'' if len(values) == 1 else 's'} for "
            f"{n} completions"
        )
    bad = [
        (i, v)
        for i, v in enumerate(values)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real))
    ]
    if bad:
        i, v = bad[0]
        raise RewardFunctionError(
            f"{where} returned a non-number at position {i}: {type(v).__name__} {v!r:.60} "
            "(a number, or None where the function does not apply)"
        )
    scored = torch.tensor([v is not None for v in values], dtype=torch.bool)
    return torch.tensor([NAN if v is None else float(v) for v in values], dtype=dtype), scored


def _raised(name: str, at: str, error: BaseException) -> str:
    """The one line for a function that raised: its name, the step, the exception and where in the
    user's code it was raised (:func:`user_frame`)."""
    frame = user_frame(error)
    return f"reward function {name!r}{at} raised {type(error).__name__}: {error}" + (
        f" ({frame})" if frame else ""
    )


#: Where proximal's own modules live: frames under it are not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where Python's standard library and installed packages live: a frame there is the user's only
#: when no frame of theirs is elsewhere (a function of an installed package).
_LIBRARY_DIRS = tuple(
    {
        os.path.abspath(p)
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)


def user_frame(error: BaseException) -> str | None:
    """``file:line in function`` of the last frame of ``error``'s traceback in the user's code: the
    last outside proximal and Python's own libraries (the line of theirs that called a library that
    raised), else the last outside proximal; None when every frame is proximal's. The file is given
    relative to the working directory when it lies under it."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not _under(f.filename, (_PACKAGE_DIR,))
    ]
    if not frames:
        return None
    own = [
        f
        for f in frames
        if not _under(f.filename, _LIBRARY_DIRS) and not f.filename.startswith("<")
    ]
    f = (own or frames)[-1]
    path = f.filename
    try:
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            path = relative
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{f.lineno} in {f.name}"


def _under(path: str, dirs: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(path == d or path.startswith(d + os.sep) for d in dirs)


class _Loop:
    """The process's event loop for async reward functions, run in a daemon thread so that it works
    where a loop already runs in the main thread (a notebook), and kept across steps so that a client
    a function opened stays bound to a live loop (TRL keeps one the same way). A forked child makes
    its own: the parent's thread does not exist in it."""

    loop: asyncio.AbstractEventLoop | None = None
    pid: int = 0
    lock = threading.Lock()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls.lock:
            if cls.loop is None or cls.pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="proximal-reward-functions", daemon=True
                ).start()
                cls.loop, cls.pid = loop, os.getpid()
            return cls.loop


def _await_together(pending: list[tuple[str, Any]], step: int | None, timeout_s: float | None):
    """The results of ``pending`` (name, awaitable), awaited concurrently; an exception a function
    raised takes its result's place."""
    finished: set[str] = set()

    async def one(name, awaitable):
        try:
            return await awaitable
        finally:
            finished.add(name)

    async def together():
        return await asyncio.gather(*(one(n, a) for n, a in pending), return_exceptions=True)

    def late() -> str:
        return _late([n for n, _ in pending if n not in finished], step, timeout_s)

    with deadline(timeout_s, late):
        out = asyncio.run_coroutine_threadsafe(together(), _Loop.get()).result()
    for result in out:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # a KeyboardInterrupt, a cancellation: not the function's failure
    return out


def _late(names: list[str], step: int | None, timeout_s: float | None) -> str:
    which = ", ".join(repr(n) for n in names) or "(all had just returned)"
    at = f" at step {step}" if step is not None else ""
    return (
        f"reward function {which}{at} did not return within model.reward_timeout_s = "
        f"{timeout_s:g} s; the run was stopped (exit status {EXIT_TIMEOUT}). Fix the function or "
        "raise the limit (null: none), then resume from the last checkpoint"
    )


@contextmanager
def deadline(limit_s: float | None, message: Callable[[], str]):
    """Run the block under a watchdog: past ``limit_s`` seconds, print ``message()`` (one line) and end
    the process with :data:`EXIT_TIMEOUT`; :data:`BACKSTOP_S` later, ``faulthandler`` ends it if the
    watchdog could not run. ``limit_s`` None: no limit."""
    if limit_s is None:
        yield
        return
    timer = threading.Timer(limit_s, _expire, args=(message,))
    timer.daemon = True
    timer.start()
    backstop = _arm_backstop(limit_s + BACKSTOP_S)
    try:
        yield
    finally:
        timer.cancel()
        if backstop:
            faulthandler.cancel_dump_traceback_later()


def _arm_backstop(after_s: float) -> bool:
    try:
        faulthandler.dump_traceback_later(after_s, exit=True, file=sys.__stderr__)
        return True
    except (AttributeError, ValueError, OSError, RuntimeError):
        return False  # no usable stderr: the watchdog alone


def _expire(message: Callable[[], str]) -> None:
    """The watchdog's end of the process: the line, then ``os._exit`` (a hung call cannot be unwound)."""
    try:
        prefix = f"[rank {dist.rank()}] " if dist.rank() > 0 else ""
        line = f"{prefix}proximal: {message()}\n"
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                pass
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr replaced or closed: write to the descriptor
            os.write(2, line.encode())
    finally:
        os._exit(EXIT_TIMEOUT)
