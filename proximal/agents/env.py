"""The environment interface, and the driver that runs a batch of environments and tools.

An environment is a class, instantiated once per trajectory (TRL's ``environment_factory`` shape:
the class itself is the factory) and given the prompt row — ``"prompt"`` and every other column,
as reward functions get them — in ``reset``. It takes one of two forms::

    class Guess:                                   # the step form (SkyRL's BaseTextEnv)
        def reset(self, prompt, answer, **row):    # -> first observation, or None
            self.answer = int(answer)
            return None                            # None: the prompt is the first turn
        def step(self, text):                      # the policy's turn, as text
            if str(self.answer) in text:
                return None, 1.0, True             # (observation, reward, done)
            return "higher" if ... else "lower", 0.0, False

    class Calculator:                              # the tool form (TRL's environment_factory)
        def reset(self, **row):
            self.used = 0
        def calculator(self, expression: str) -> int:
            \"\"\"Evaluate ... Args: expression: ...\"\"\"
            self.used += 1
            return ...
        def get_reward(self) -> float:             # optional: the outcome reward
            return ...

* The **step form** defines ``step(text) -> (observation, reward, done)``: the observation is a
  string (a user message), a list of chat messages, or None; ``reward`` is this turn's reward
  (None or 0 for none); ``done`` ends the trajectory.
* The **tool form** has public methods — its tools (every public method but ``reset``, ``step``,
  ``get_reward``, ``close``). The calls in the policy's turn are read by the call format
  (:mod:`proximal.agents.tools`) and run; their results come back as ``tool`` messages. A turn
  with no call ends the trajectory. Plain tool functions (``tools.functions``) work the same way,
  with or without an environment.
* ``get_reward()`` (either form, optional) is the outcome reward, asked once when the trajectory
  ends, added to the reward functions' score.

Everything the user wrote runs in worker processes (:mod:`proximal.agents.worker`) under
``tools.timeout_s``. What a failure does:

* a tool that raises, times out, or a malformed call: with ``tools.on_error = "observe"`` (the
  default) the error text is the tool message and the trajectory goes on; with ``"end"`` the
  trajectory ends there and its outcome reward is 0;
* an environment that raises in ``step``, or that is lost (its worker was killed for a timeout
  or died under its call): the trajectory *fails* — it ends, and ``env.on_failure`` decides what
  training does with it (:data:`ON_FAILURE`: outcome reward 0, or left out of the update);
* the other trajectories whose environments lived in that worker did nothing wrong: their calls
  answer ``evicted`` (:attr:`StepResult.evicted`) and
  :func:`~proximal.agents.trajectory.run_trajectories` runs them again from their own reset;
* an environment that raises in ``reset``: :class:`AgentError`, one line naming the class and the
  row (a bug in the environment, not a policy's mistake).

A tool's result longer than ``max_result_chars`` is cut there, with a marker saying so. Every
outcome is counted (:data:`COUNTS`, :data:`BATCH_COUNTS`).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proximal.agents.tools import (
    NOT_TOOLS,
    Malformed,
    ToolCall,
    call_parser,
    environment_tools,
    tool_schemas,
)
from proximal.agents.worker import Job, WorkerPool
from proximal.config import ConfigError

#: ``tools.on_error``: what a tool's error, timeout or a malformed call does.
ON_ERROR = ("observe", "end")

#: ``env.on_failure``: what training does with a failed trajectory — ``zero``: its outcome reward
#: is 0 and it is trained on; ``drop``: it is left out of the update (and a GRPO/RLOO group it
#: leaves with fewer than two members goes with it), as a non-finite score is.
ON_FAILURE = ("zero", "drop")

#: ``tools.max_result_chars``' default: a tool's result longer than this is cut, with a marker.
MAX_RESULT_CHARS = 10_000


class AgentError(ConfigError):
    """A failure of the user's environment, tools or chat template that stops the run — an
    environment that raises in ``reset``, a chat template that cannot render an observation: one
    line naming the class or function and the row (exit status 2, docs/errors.md)."""


#: The counters of :attr:`Environments.counts`, logged as ``agent/<name>`` per step.
COUNTS = (
    "tool_calls",  # every call the policy wrote, malformed ones included
    "tool_errors",  # calls that raised
    "tool_timeouts",  # calls killed after tools.timeout_s
    "malformed_calls",  # calls that could not be read, or named no tool
    "env_errors",  # environments that raised in step or get_reward, or were lost
    "results_truncated",  # tool results cut at tools.max_result_chars
)

#: Counts of a whole batch, logged as ``agent/<name>`` per step beside :data:`COUNTS`.
BATCH_COUNTS = (
    "reruns",  # trajectories run again from their reset: another's call killed their worker
    "dropped",  # trajectories left out of the update (env.on_failure: drop; their group-mates)
)

Observation = str | list[dict] | None


@dataclass
class StepResult:
    """What one turn of one trajectory led to.

    messages: the observation as chat messages to append (empty when there is none).
    reward: the turn's reward (0.0 for none). done: the trajectory ends here.
    failed: it ended by a failure (``tools.on_error = "end"``, a raising or lost environment):
    ``env.on_failure`` decides what training does with it. evicted: its environment went with a
    worker another trajectory's call killed — it is to be run again from its reset (it is done
    here, neither failed nor counted). counts: this turn's share of :data:`COUNTS`.
    """

    messages: list[dict]
    reward: float = 0.0
    done: bool = False
    failed: bool = False
    counts: Counter = field(default_factory=Counter)
    evicted: bool = False


def as_messages(observation: Observation, role: str = "user") -> list[dict]:
    """An observation as chat messages: a string is one ``role`` message, None is none."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in observation
    ):
        return list(observation)
    raise TypeError(
        f"an observation must be a string, a list of {{'role', 'content'}} messages or None, "
        f"got {type(observation).__name__} {observation!r:.80}"
    )


def environment_class(factory: Callable) -> type:
    """The class an ``env`` factory builds: the factory itself when it is a class, else the type of
    one instance made here."""
    return factory if isinstance(factory, type) else type(factory())


class Environments:
    """A batch's environments and tools: slot b of a batch is trajectory b.

    ``factory``: the environment class (or a function returning an instance), or None for tools
    alone. ``tools``: ``{name: function}`` (:func:`proximal.agents.tools.load_tools`).
    ``call_format``: ``"hermes"`` or ``"minimal"``. ``workers``: worker processes (0 = run in this
    process, no timeouts: for debugging). ``timeout_s``: the limit of every call into the user's
    code. ``on_error``: :data:`ON_ERROR`. ``max_result_chars``: a tool's result is cut there (None:
    never). ``log``: the file the workers' prints go to (the run's ``tools.log``; None: this
    process's stdout).

    :attr:`evicted` holds the batch's slots whose environment went with a worker another slot's
    call killed (:class:`~proximal.agents.worker.WorkerPool`): to be run again from their reset.
    """

    def __init__(
        self,
        factory: Callable | None = None,
        tools: dict[str, Callable] | None = None,
        *,
        call_format: str = "hermes",
        timeout_s: float | None = 10.0,
        on_error: str = "observe",
        workers: int = 4,
        open: str = "[",
        close: str = "]",
        max_result_chars: int | None = MAX_RESULT_CHARS,
        log: str | None = None,
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"tools.on_error = {on_error!r}; expected one of {ON_ERROR}")
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"tools.max_result_chars = {max_result_chars} must be ≥ 1 (or null)")
        self.factory = factory
        self.functions = dict(tools or {})
        cls = environment_class(factory) if factory is not None else None
        problems = check_environment(cls) if cls is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        self.is_step = cls is not None and callable(getattr(cls, "step", None))
        self.methods = tool_methods(cls)
        clash = set(self.methods) & set(self.functions)
        if clash:
            raise ValueError(f"tools {sorted(clash)} are both functions and environment methods")
        self.has_reward = cls is not None and callable(getattr(cls, "get_reward", None))
        if cls is None and not self.functions:
            raise ValueError("an agent needs an environment, tools, or both")
        if self.is_step and self.functions:
            raise ValueError(
                f"{cls.__name__} has step(text): it reads each turn itself, so tool functions "
                "would never be called; give tools to an environment without step, or none"
            )
        self.parse = call_parser(call_format, open, close)
        self.on_error = on_error
        self.max_result_chars = max_result_chars
        self.name = cls.__qualname__ if cls is not None else None
        self.pool = WorkerPool(workers, timeout_s, log)
        self.counts: Counter = Counter()
        self.evicted: set[int] = set()
        self._live: set[int] = set()  # slots whose environment is alive
        self._offered: dict[int, list[str] | None] = {}  # slot -> its row's tools (None: all)

    @property
    def tools(self) -> dict[str, Callable]:
        """Every tool the policy may call: the functions and the environment's methods."""
        return {**self.functions, **self.methods}

    def tools_of(self, slot: int) -> dict[str, Callable]:
        """The tools trajectory ``slot`` may call: those its row's ``tools`` column names
        (:func:`offered_tools`, read in :meth:`reset`), or every tool when it names none."""
        return subset(self.tools, self._offered.get(slot))

    def schemas(self, slot: int | None = None) -> list[dict]:
        """The tools' JSON schemas, for the chat template's ``tools=``: every tool's, or (``slot``)
        those trajectory ``slot`` is offered."""
        return tool_schemas(self.tools if slot is None else self.tools_of(slot))

    # ------------------------------------------------------------------------------------------

    def reset(self, rows: list[dict[str, Any]]) -> list[Observation]:
        """A fresh environment for each row (slot b = row b) and its first observation (None: the
        prompt is the first turn). Without an environment class, every observation is None."""
        self.release()
        self.pool.forget()
        self.evicted.clear()
        self._offered = {
            b: offered_tools(row.get("tools"), self.tools) for b, row in enumerate(rows)
        }
        if self.factory is None:
            return [None] * len(rows)
        jobs = [Job(b, ("new", b, self.factory, dict(row)), env=True) for b, row in enumerate(rows)]
        out = []
        for b, (status, value) in enumerate(self.pool.run(jobs)):
            if status != "ok":
                prompt = rows[b].get("prompt")
                raise AgentError(
                    f"env.factory {self.name}: reset failed for row {b} of the batch (prompt "
                    f"{prompt!r:.60}): {value if status == 'error' else f'{status}, {value}'}"
                )
            self._live.add(b)
            out.append(value)
        return out

    def step(self, texts: dict[int, str]) -> dict[int, StepResult]:
        """Each trajectory's turn ``texts[b]`` (the policy's text, end-of-turn token left off) to
        its environment or tools: what follows (:class:`StepResult`)."""
        if self.is_step:
            return self._env_steps(texts)
        return self._tool_steps(texts)

    def _env_steps(self, texts: dict[int, str]) -> dict[int, StepResult]:
        slots = list(texts)
        jobs = [Job(b, ("method", b, "step", (texts[b],), {}, False), env=True) for b in slots]
        out = {}
        for b, (status, value) in zip(slots, self.pool.run(jobs)):
            if status == "ok":
                try:
                    observation, reward, done = value
                    out[b] = StepResult(as_messages(observation), float(reward or 0.0), bool(done))
                    continue
                except (TypeError, ValueError) as e:
                    status, value = "error", f"step must return (observation, reward, done): {e}"
            if status == "evicted":
                self.evicted.add(b)
                out[b] = StepResult([], done=True, evicted=True)
                continue
            counts = Counter(env_errors=1, tool_timeouts=int(status == "timeout"))
            out[b] = StepResult([], 0.0, True, True, counts)
        self._count(out)
        return out

    def _tool_steps(self, texts: dict[int, str]) -> dict[int, StepResult]:
        out: dict[int, StepResult] = {}
        jobs: list[Job] = []
        plans: dict[int, list] = {}  # slot -> [(name, job index | Malformed)]
        for b, text in texts.items():
            tools = self.tools_of(b)  # a call to a tool its row does not offer names no tool
            calls = self.parse(text, tools)
            if not calls:
                out[b] = StepResult([], done=True)
                continue
            plan = []
            for call in calls:
                if isinstance(call, ToolCall) and call.name not in tools:
                    offered = ", ".join(sorted(tools))
                    call = Malformed(
                        call.name, f"no tool is named {call.name!r} (tools: {offered})"
                    )
                if isinstance(call, Malformed):
                    plan.append(("", call))
                    continue
                if call.name in self.methods:
                    request = ("method", b, call.name, (), call.arguments, True)
                else:
                    request = ("call", self.functions[call.name], (), call.arguments)
                plan.append((call.name, len(jobs)))
                jobs.append(Job(b, request, env=call.name in self.methods))
            plans[b] = plan
        results = self.pool.run(jobs)
        for b, plan in plans.items():
            r = StepResult([], counts=Counter(tool_calls=len(plan)))
            for name, what in plan:
                if isinstance(what, Malformed):
                    r.counts["malformed_calls"] += 1
                    status, text = "malformed", f"malformed tool call: {what.reason}"
                else:
                    status, text = results[what]
                    if status == "error":
                        r.counts["tool_errors"] += 1
                    elif status == "timeout":
                        r.counts["tool_timeouts"] += 1
                        if jobs[what].env:  # the environment went with the killed worker
                            r.counts["env_errors"] += 1
                            r.done = r.failed = True
                    elif status == "evicted":  # another's call killed its worker: run again
                        r.evicted = r.done = True
                    elif status == "lost" and jobs[what].env:  # no state left to go on from
                        r.counts["env_errors"] += 1
                        r.done = r.failed = True
                    elif status == "lost":  # a tool function whose worker died under it
                        r.counts["tool_errors"] += 1
                if status != "ok":
                    text = f"error: {text}"
                    if self.on_error == "end":
                        r.done = r.failed = True
                text, cut = self._bounded(text)
                r.counts["results_truncated"] += cut
                r.messages.append({"role": "tool", "name": name, "content": text})
            if r.evicted:  # this attempt is thrown away: nothing of it counts
                self.evicted.add(b)
                r = StepResult([], done=True, evicted=True)
            if r.done:
                r.messages = []
            out[b] = r
        self._count(out)
        return out

    def outcome_rewards(self, slots: list[int]) -> dict[int, float | None]:
        """``get_reward()`` of each slot's environment (None when the class has none, or for a
        lost environment — which is counted; its trajectory's outcome is then 0)."""
        if not self.has_reward:
            return dict.fromkeys(slots)
        jobs = [Job(b, ("method", b, "get_reward", (), {}, False), env=True) for b in slots]
        out: dict[int, float | None] = {}
        for b, (status, value) in zip(slots, self.pool.run(jobs)):
            if status == "ok":
                try:
                    out[b] = float(value)
                    continue
                except (TypeError, ValueError):
                    pass
            if status == "evicted":
                self.evicted.add(b)
            else:
                self.counts["env_errors"] += 1
            out[b] = None
        return out

    def _bounded(self, text: str) -> tuple[str, int]:
        """A tool message cut at ``max_result_chars``, with a marker saying how long it was; and
        whether it was cut."""
        limit = self.max_result_chars
        if limit is None or len(text) <= limit:
            return text, 0
        return text[
            :limit
        ] + f"… [cut: {len(text)} characters, tools.max_result_chars = {limit}]", 1

    def release(self) -> None:
        """Forget the batch's environments (in their workers)."""
        if self._live:
            self.pool.run([Job(b, ("drop", b), env=True) for b in sorted(self._live)])
        self._live.clear()

    def close(self) -> None:
        self.pool.close()

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call, as ``{"agent/<name>": n}`` for every name of
        :data:`COUNTS` and :data:`BATCH_COUNTS`."""
        out = {f"agent/{k}": int(self.counts[k]) for k in (*COUNTS, *BATCH_COUNTS)}
        self.counts.clear()
        return out

    def _count(self, results: dict[int, StepResult]) -> None:
        for r in results.values():
            self.counts.update(r.counts)


def tool_methods(cls: type | None) -> dict[str, Callable]:
    """The environment class's methods the policy may call (:func:`environment_tools`); none for an
    environment with ``step(text)``, which reads each turn itself, or no environment."""
    if cls is None or callable(getattr(cls, "step", None)):
        return {}
    return environment_tools(cls)


def subset(tools: dict[str, Callable], names: list[str] | None) -> dict[str, Callable]:
    """The tools a row offers: those ``names`` picks (:func:`offered_tools`, in its order), or every
    one of ``tools`` for None."""
    return tools if names is None else {n: tools[n] for n in names}


def row_schemas(registered: dict[str, Callable]) -> Callable[[dict], list[dict]]:
    """For a prompt row, the JSON schemas of the tools it is offered (:func:`offered_tools`: those
    its ``tools`` column names, or every one of ``registered``) — what its chat template is given,
    the same as :meth:`Environments.schemas` of its trajectory. ValueError for a column naming a
    tool that is not registered. Each set of tools is made into schemas once."""
    made: dict[tuple[str, ...] | None, list[dict]] = {}

    def schemas(row: dict) -> list[dict]:
        names = offered_tools(row.get("tools"), registered)
        key = None if names is None else tuple(names)
        if key not in made:
            made[key] = tool_schemas(subset(registered, names))
        return made[key]

    return schemas


def offered_tools(value, registered: dict[str, Callable] | Sequence[str]) -> list[str] | None:
    """The names of the tools a prompt row offers, from its ``tools`` column (docs/agents.md).

    ``value`` is the column's value: None (no column) offers every registered tool; a list names a
    subset, each entry a tool's name or its JSON schema (TRL's ``tools`` column,
    ``{"type": "function", "function": {"name": ...}}``, or ``{"name": ...}``). With no tools
    registered the column is only data (the reward functions still get it): None. ValueError for
    an entry that names no registered tool, or a value that is not a list.
    """
    if value is None or not registered:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"the row's 'tools' column must be a list of tool names or schemas, got "
            f"{type(value).__name__} {value!r:.60}"
        )
    names = []
    for entry in value:
        name = entry
        if isinstance(entry, dict):
            name = (entry.get("function") or entry).get("name")
        if not isinstance(name, str) or name not in registered:
            shown = name if isinstance(name, str) else repr(entry)[:60]
            raise ValueError(
                f"the row's 'tools' column names {shown}, which is not a registered tool "
                f"(tools: {', '.join(sorted(registered))})"
            )
        if name not in names:
            names.append(name)
    return names


def check_offered(columns: Sequence[dict] | None, registered: dict[str, Callable], where: str):
    """The first problem (a string naming the row) with the rows' ``tools`` columns, or None; read
    before any model loads."""
    for i, row in enumerate(columns or []):
        try:
            offered_tools(row.get("tools"), registered)
        except ValueError as e:
            return f"{where}[row {i}]: {e}"
    return None


def check_environment(cls: type) -> list[str]:
    """What is wrong with an environment class as :class:`Environments` would use it (empty: nothing)."""
    problems = []
    if not callable(getattr(cls, "reset", None)):
        problems.append(f"{cls.__name__} has no reset(**row) method")
    elif not any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.reset).parameters.values()):
        problems.append(
            f"{cls.__name__}.reset must accept **kwargs: it is given every column of the row"
        )
    if not callable(getattr(cls, "step", None)) and not environment_tools(cls):
        problems.append(
            f"{cls.__name__} has neither step(text) nor public methods (tools); "
            f"methods named {', '.join(NOT_TOOLS)} are not tools"
        )
    return problems
