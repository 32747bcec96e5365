"""Scoring responses: a frozen reward model r_ψ(x, y) (Bradley–Terry, trained by ``proximal rm``) and
rule-based reward functions (verifiers).

The total score of a response is a weighted sum of components: the reward model (if any) and any
number of reward functions. Each component is also returned on its own, so a component with weight
0 is logged without being trained on (the demo logs its gold score that way).

The reward model reads prompt + response. When its tokenizer equals the policy's, the policy's token
ids are used as they are; otherwise the prompt and response are decoded to text and re-tokenized
with the reward model's tokenizer (its chat template applied when the prompt came as messages).

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
from proximal.config import PythonObject
from proximal.data.chat import apply_template, encode_prompt
from proximal.data.collate import pad_right
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_sequence_scorer, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_frozen
from proximal.rollout.sampling import Rollout
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


def load_reward_functions(specs: Sequence[str | Callable]) -> dict[str, Callable]:
    """``{name: function}`` for ``model.reward_functions`` (specs and callables), in order."""
    return {
        name: load_reward_function(spec) for name, spec in zip(reward_function_names(specs), specs)
    }


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


def call_reward_function(
    name: str,
    fn: Callable,
    prompts: list,
    completions: list,
    step: int | None = None,
    *,
    timeout_s: float | None = None,
    **arguments: Any,
) -> torch.Tensor:
    """One function on ``prompts`` and ``completions`` (and any other ``arguments``: columns,
    ``completion_ids``) as a (B,) float32 tensor (NaN where it returned None):
    :func:`call_reward_functions` for one."""
    values = {"prompts": prompts, "completions": completions, **arguments}
    values |= {"step": step, "trainer_state": TrainerState(step)}
    scores, _ = call_reward_functions(
        {name: fn}, values, n=len(completions), step=step, timeout_s=timeout_s
    )
    return scores[name]


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
    except (
        AttributeError,
        ValueError,
        OSError,
        RuntimeError,
    ):  # no usable stderr: the watchdog alone
        return False


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


# ----------------------------------------------------------------------------------------------
# The scorer
# ----------------------------------------------------------------------------------------------


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map text to the same ids (same vocabulary and special tokens)."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.eos_token_id == b.eos_token_id
        and a.bos_token_id == b.bos_token_id
    )


class Scorer:
    """Weighted sum of a reward model's score and reward functions' scores for a batch of rollouts."""

    def __init__(
        self,
        policy_tokenizer,
        *,
        reward_model=None,
        reward_tokenizer=None,
        reward_model_weight=1.0,
        functions: dict[str, Callable] | None = None,
        function_weights: dict[str, float] | None = None,
        micro_batch_size: int = 8,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ):
        self.policy_tokenizer = policy_tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer or policy_tokenizer
        self.reward_model_weight = reward_model_weight
        self.functions = functions or {}
        self.function_weights = function_weights or {name: 1.0 for name in self.functions}
        self.micro_batch_size = micro_batch_size
        self.timeout_s = timeout_s
        self.reuse_ids = reward_model is not None and same_tokenizer(
            policy_tokenizer, self.reward_tokenizer
        )

    def completions(self, rollout: Rollout) -> list[str]:
        """The response texts, special tokens (EOS, pad) removed: every real token, so a multi-turn
        response's observations too (``Rollout.real_mask``)."""
        return [
            self.policy_tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(rollout.response_ids, rollout.real_mask)
        ]

    def _reward_model_inputs(self, rollout: Rollout, prompts: list[str], messages: list | None):
        rows = []
        if self.reuse_ids:
            for p_ids, p_m, r_ids, r_m in zip(
                rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.real_mask
            ):
                rows.append(p_ids[p_m.bool()].tolist() + r_ids[r_m].tolist())
        else:
            tok = self.reward_tokenizer
            texts = self.completions(rollout)
            for i, (prompt, completion) in enumerate(zip(prompts, texts)):
                # The layout the reward trainer uses: prompt ids (the reward model's own chat template
                # with the generation prompt, when the prompt came as messages), response ids, EOS.
                msgs = messages[i] if messages else None
                if msgs and getattr(tok, "chat_template", None):
                    prompt = apply_template(list(msgs), tok, f"prompt {i}")
                ids = (
                    encode_prompt(prompt, tok) + tok(completion, add_special_tokens=False).input_ids
                )
                if bool(rollout.ended[i]) and tok.eos_token_id is not None:
                    ids = ids + [tok.eos_token_id]
                rows.append(ids)
        return rows

    def function_arguments(
        self,
        rollout: Rollout,
        prompts: list[str],
        messages: list | None = None,
        columns: Sequence[Mapping[str, Any]] | None = None,
        step: int | None = None,
        completions: list | None = None,
    ) -> dict[str, Any]:
        """Everything a reward function may be given for this rollout (:data:`PASSED` and the columns),
        one entry per completion: a conversational row's prompt as its messages and its completion as
        ``[{"role": "assistant", "content": text}]``, TRL's form (``completions``: given as they are
        instead — a multi-turn trajectory's, :mod:`proximal.agents.collect`); ``completion_ids`` the
        response's tokens, the stop token included (a multi-turn one's observations too)."""
        texts = self.completions(rollout)
        messages = messages if messages is not None else [None] * len(texts)
        if completions is None:
            completions = [
                t if m is None else [{"role": "assistant", "content": t}]
                for t, m in zip(texts, messages)
            ]
        return {
            "prompts": [p if m is None else m for p, m in zip(prompts, messages)],
            "completions": completions,
            "completion_ids": [
                ids[m].tolist() for ids, m in zip(rollout.response_ids, rollout.real_mask)
            ],
            **column_lists(columns, len(texts)),
            "step": step,
            "trainer_state": TrainerState(step),
        }

    @torch.no_grad()
    def __call__(
        self,
        rollout: Rollout,
        prompts: list[str],
        messages: list | None = None,
        *,
        columns: Sequence[Mapping[str, Any]] | None = None,
        step: int | None = None,
        completions: list | None = None,
        scored_elsewhere: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total score (B,) float32 and each component (B,) by name ("reward_model", function names;
        NaN where a function returned None — :func:`score_metrics` reads them). A row that no source
        scored has a NaN total, unless ``scored_elsewhere`` (another source the caller adds, an
        environment's reward, scores every row: the functions' part is then 0).

        ``prompts``: the rendered prompt texts; ``messages``: each row's messages (None for a text
        prompt); ``columns``: each row's other fields, handed to the reward functions as keywords;
        ``step``: the step, handed to them and named in a failing function's message;
        ``completions``: what the reward functions get as completions, when not the decoded
        responses (a multi-turn trajectory's text or messages)."""
        device = rollout.response_ids.device
        components: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(rollout), dtype=torch.float32, device=device)
        if self.reward_model is not None:
            rows = self._reward_model_inputs(rollout, prompts, messages)
            pad = self.reward_tokenizer.pad_token_id
            scores = []
            for i in range(0, len(rows), self.micro_batch_size):
                ids, mask = pad_right(rows[i : i + self.micro_batch_size], pad, device)
                scores.append(last_token_scores(self.reward_model, ids, mask).float())
            components["reward_model"] = torch.cat(scores)
            total = total + self.reward_model_weight * components["reward_model"]
        if self.functions:
            values = self.function_arguments(
                rollout, list(prompts), messages, columns, step, completions
            )
            scores, scored = call_reward_functions(
                self.functions, values, n=len(rollout), step=step, timeout_s=self.timeout_s
            )
            # TRL's rule: a row's total is the weighted sum over the functions that scored it (None:
            # does not apply); a NaN a function returned stays NaN. A row that no source scored has
            # no score (NaN: rollout.nonfinite_scores decides, where TRL would train on 0).
            anyone = torch.zeros(len(rollout), dtype=torch.bool, device=device)
            for name, score in scores.items():
                components[name] = score.to(device)
                ok = scored[name].to(device)
                total = total + torch.where(ok, self.function_weights[name] * components[name], 0.0)
                anyone = anyone | ok
            if self.reward_model is None and not scored_elsewhere:
                total = torch.where(anyone, total, NAN)
        return total, components


def score_metrics(
    components: Mapping[str, torch.Tensor], valid: torch.Tensor, functions: Sequence[str] = ()
) -> dict[str, float]:
    """``score/<name>``: each component's mean over the rows trained on (``valid``: a finite total)
    that it scored, over every process; and for each reward function of ``functions``
    ``score/<name>_count``, how many rows that is. (On a row with a finite total every component
    that scored it is finite, so a non-finite component there is one that returned None.)"""
    metrics: dict[str, float] = {}
    for name, values in components.items():
        w = (valid & torch.isfinite(values)).float()
        metrics[f"score/{name}"] = dist.global_mean(values, w)
        if name in functions:
            metrics[f"score/{name}_count"] = int(dist.global_sum(w.sum(), w.device))
    return metrics


def build_scorer(
    policy_tokenizer,
    *,
    reward_model: str | None,
    reward_model_weight: float,
    functions: dict,
    function_weights: dict[str, float],
    precision: str,
    device: torch.device,
    world_size: int,
    frozen_sharding: str = "shard",
    micro_batch_size: int = 8,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> Scorer:
    """The frozen reward model (if any) loaded, checked, placed and (several processes) sharded, with
    the reward functions, as one :class:`Scorer`."""
    model = tokenizer = None
    if reward_model is not None:
        tokenizer = load_tokenizer(
            reward_model, role="reward-model tokenizer (model.reward_model)", padding_side="right"
        )
        model = load_sequence_scorer(
            reward_model,
            role="reward model (model.reward_model)",
            dtype=load_dtype(precision, trained=False),
            pad_token_id=tokenizer.pad_token_id,
        )
        prepare_frozen(model, device=device, world_size=world_size, sharding=frozen_sharding)
    return Scorer(
        policy_tokenizer,
        reward_model=model,
        reward_tokenizer=tokenizer,
        reward_model_weight=reward_model_weight,
        functions=functions,
        function_weights=function_weights,
        micro_batch_size=micro_batch_size,
        timeout_s=timeout_s,
    )
