"""Rewards served over HTTP: a reward server (``model.reward_urls``) and an LLM judge on an
OpenAI-compatible chat endpoint (``model.reward_judges``), each turned into a reward function so that
it is called, weighed, timed and logged as one (:mod:`proximal.rollout.reward_functions`).

**A reward server** is POSTed the completions in batches of ``model.reward_http_batch_size``::

    {"prompts": [...], "completions": [...], "columns": {"answer": [...], ...}, "step": 3}

one entry per completion, as a reward function gets them (a conversational row's prompt is its
messages, its completion ``[{"role": "assistant", "content": text}]``); ``step`` is the training step
(null outside training). It answers ``{"scores": [...]}``: one number or null (does not apply) per
completion of the batch, in order. Anything else — not JSON, no ``scores`` list, another count, a
string — is a :class:`~proximal.rollout.reward_functions.RewardFunctionError` naming the source, the
step and the batch (exit status 2: the server breaks the contract, as a function returning the wrong
count does).

**A judge** gets one chat request per completion: its rubric file with ``{prompt}``,
``{completion}`` and ``{<column>}`` filled in, as the one user message to ``POST
<endpoint>/chat/completions`` (``temperature`` 0), with ``Authorization: Bearer $<api_key_env>``
when an ``api_key_env`` is named. The last match of ``score_pattern`` (one group) in the reply's
``choices[0].message.content``, divided by ``scale``, is the score; a reply without a match scores
None (the completion is not scored by the judge; ``score/<name>_count`` counts those it scored).

**Transport** (both): at most ``model.reward_http_concurrency`` requests at once, each under
``model.reward_http_timeout_s``; a refused or dropped connection, a timeout, HTTP 5xx or 429 is tried
again up to ``model.reward_http_retries`` times, waiting ``model.reward_http_backoff_s`` × 2^k
(k = 0, 1, …; at most :data:`MAX_BACKOFF_S`) before try k + 2. Another HTTP status (4xx: a wrong path,
a refused key) is not retried: RewardFunctionError, exit 2. A request that fails every try is a
server lost for good: :class:`~proximal.rollout.reward_functions.RewardServerLost`, one line, exit
status 1 — a training failure, as a reward timeout is, not the pre-emption status a scheduler would
requeue forever. The whole call (every batch, every retry) counts against
``model.reward_timeout_s``, as a function's does. Requests to a loopback host never go through a
proxy; others follow the environment's ``http_proxy``/``no_proxy``.
"""

from __future__ import annotations

import http.client
import inspect
import ipaddress
import json
import math
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proximal.config import ConfigError
from proximal.rollout.reward_functions import RewardFunctionError, RewardServerLost

#: The longest wait between two tries of a request, however many retries are allowed.
MAX_BACKOFF_S = 30.0
#: A judge's score pattern unless its config gives one: "Score: 7" or "Score: 7.5", the last in the reply.
DEFAULT_SCORE_PATTERN = r"Score: (\d+(?:\.\d+)?)"
#: The keys of one ``model.reward_judges`` entry: required, then optional with their defaults.
JUDGE_REQUIRED = ("endpoint", "model", "rubric")
JUDGE_DEFAULTS: dict[str, Any] = {
    "name": "judge",
    "api_key_env": None,
    "score_pattern": DEFAULT_SCORE_PATTERN,
    "scale": 10.0,
    "max_tokens": 512,
}
#: What a rubric may name besides the prompt rows' columns.
RUBRIC_FIELDS = ("prompt", "completion")
#: A rubric's placeholder: ``{name}``, not doubled (``{{name}}`` stays as written).
_PLACEHOLDER = re.compile(r"(?<!\{)\{([A-Za-z_]\w*)\}(?!\})")


@dataclass(frozen=True)
class HttpSettings:
    """How requests are made (``model.reward_http_*``): completions per reward-server request, requests
    at once, seconds per request, retries after the first try, the first back-off in seconds."""

    batch_size: int = 64
    concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0


# ----------------------------------------------------------------------------------------------
# Names and config checks (before anything loads)
# ----------------------------------------------------------------------------------------------


def url_name(url: str) -> str:
    """A reward server's name in metrics (``score/<name>``) and weights: the URL's fragment when it
    has one (``http://host:8000/score#math`` is ``math``; a fragment is never sent), else its host,
    port and path (``host:8000/score``)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL (url_problems says so): named as written
        return url
    return parts.fragment or (parts.netloc + parts.path)


def url_problems(urls: Sequence[str], field: str = "model.reward_urls") -> list[str]:
    """One line per URL that is not ``http(s)://host[:port]/path[#name]``."""
    problems = []
    for i, url in enumerate(urls):
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is no number
        except ValueError as e:
            problems.append(f"{field}[{i}] = {url!r}: {e}")
            continue
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(
                f"{field}[{i}] = {url!r}: expected http://host[:port]/path (or https), "
                "optionally #name for its score/<name>"
            )
    return problems


def judge_problems(judges: Sequence[Any], field: str = "model.reward_judges") -> list[str]:
    """One line per mistake in ``model.reward_judges`` that the config alone shows: not a mapping, a
    key missing or unknown, a pattern without exactly one group, a scale not > 0."""
    problems = []
    known = (*JUDGE_REQUIRED, *JUDGE_DEFAULTS)
    for i, judge in enumerate(judges):
        where = f"{field}[{i}]"
        if not isinstance(judge, Mapping):
            problems.append(
                f"{where} = {judge!r:.80}: expected a mapping {{endpoint, model, rubric, ...}}"
            )
            continue
        missing = [k for k in JUDGE_REQUIRED if not judge.get(k)]
        unknown = [k for k in judge if k not in known]
        if missing:
            problems.append(f"{where}: {missing[0]!r} missing (needs {', '.join(JUDGE_REQUIRED)})")
        elif unknown:
            problems.append(f"{where}: no key {unknown[0]!r} (its keys: {', '.join(known)})")
        else:
            problems += url_problems([str(judge["endpoint"])], f"{where}.endpoint")
        pattern = judge.get("score_pattern", DEFAULT_SCORE_PATTERN)
        try:
            groups = re.compile(str(pattern)).groups
        except re.error as e:
            problems.append(f"{where}.score_pattern = {pattern!r}: not a regular expression ({e})")
        else:
            if groups != 1:
                problems.append(
                    f"{where}.score_pattern = {pattern!r} has {groups} groups: give exactly one, "
                    "the number (e.g. 'Score: (\\d+)')"
                )
        scale = judge.get("scale", JUDGE_DEFAULTS["scale"])
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            problems.append(f"{where}.scale = {scale!r} must be a number > 0")
        env = judge.get("api_key_env")
        if env is not None and not (isinstance(env, str) and re.fullmatch(r"[A-Za-z_]\w*", env)):
            problems.append(
                f"{where}.api_key_env = {env!r}: the NAME of an environment variable holding the key "
                "(never the key itself)"
            )
    return problems


def judge_names(judges: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each judge's name (its ``name``, default ``judge``), made unique: the second is ``judge#2``."""
    names, seen = [], {}
    for judge in judges:
        name = str(judge.get("name") or JUDGE_DEFAULTS["name"])
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def source_names(urls: Sequence[str], judges: Sequence[Mapping[str, Any]]) -> list[str]:
    """The served sources' names in their order in the weights: the URLs, then the judges."""
    return [url_name(u) for u in urls] + judge_names(judges)


# ----------------------------------------------------------------------------------------------
# Loading: each source as a reward function
# ----------------------------------------------------------------------------------------------


def load_served_rewards(
    urls: Sequence[str], judges: Sequence[Mapping[str, Any]], settings: HttpSettings
) -> dict[str, Callable]:
    """``{name: reward function}`` for each URL, then each judge (the order of their weights). A
    judge's rubric file is read and its API key looked up here, before any model: ConfigError naming
    the judge, the file or the variable when either is missing."""
    out: dict[str, Callable] = {}
    for name, url in zip([url_name(u) for u in urls], urls):
        out[name] = RewardServer(name, url, settings)
    for i, (name, judge) in enumerate(zip(judge_names(judges), judges)):
        where = f"model.reward_judges[{i}]"
        config = {**JUDGE_DEFAULTS, **judge}
        rubric_path = Path(str(config["rubric"])).expanduser()
        try:
            rubric = rubric_path.read_text()
        except OSError as e:
            raise ConfigError(f"{where}.rubric = {str(rubric_path)!r}: {e.strerror}") from None
        key = None
        if config["api_key_env"]:
            key = os.environ.get(config["api_key_env"])
            if not key:
                raise ConfigError(
                    f"{where}.api_key_env = {config['api_key_env']!r}: that environment variable is "
                    "not set (export it with the API key)"
                )
        out[name] = judge_function(
            Judge(
                name,
                endpoint=str(config["endpoint"]),
                model=str(config["model"]),
                rubric=rubric,
                api_key=key,
                score_pattern=str(config["score_pattern"]),
                scale=float(config["scale"]),
                max_tokens=int(config["max_tokens"]),
                settings=settings,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# One request, tried again with back-off
# ----------------------------------------------------------------------------------------------


class _Retryable(Exception):
    """A try that failed in a way another try may not: a connection refused or dropped, a timeout,
    HTTP 5xx or 429. Its text is what the last line says."""


class _Client:
    """POSTs JSON to one URL under :class:`HttpSettings`; shared by every batch of a call."""

    def __init__(self, name: str, kind: str, url: str, settings: HttpSettings, headers=None):
        self.name, self.kind, self.url, self.settings = name, kind, url, settings
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        parts = urllib.parse.urlsplit(url)
        self.target = urllib.parse.urlunsplit(parts._replace(fragment=""))
        handlers = [urllib.request.ProxyHandler({})] if _loopback(parts.hostname) else []
        self.opener = urllib.request.build_opener(*handlers)

    def where(self, at: str) -> str:
        return f"{self.kind} {self.name!r}{at}"

    def post(self, body: dict, at: str, what: str, stop: threading.Event) -> Any:
        """The decoded JSON answer to ``body``, tried up to ``retries + 1`` times. RewardServerLost
        when every try failed; RewardFunctionError for an answer that is no JSON or an HTTP status
        that another try would not change."""
        data = json.dumps(body, allow_nan=False).encode()
        s = self.settings
        last = ""
        for attempt in range(s.retries + 1):
            if attempt:
                wait = min(s.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                if stop.wait(wait):  # another batch failed for good: give up too
                    break
            try:
                raw = self._once(data)
            except _Retryable as e:
                last = str(e)
                continue
            except urllib.error.HTTPError as e:
                raise RewardFunctionError(
                    f"{self.where(at)} answered HTTP {e.code} {e.reason} to POST {self.target} "
                    f"({what}): {_body_of(e)!r:.200}; not retried (a status another try would not "
                    "change: check the URL, the key, the request contract in docs/rewards.md)"
                ) from None
            try:
                return json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RewardFunctionError(
                    f"{self.where(at)} answered what is not JSON to POST {self.target} ({what}): "
                    f"{e} in {raw[:120]!r}"
                ) from None
        tries = attempt + 1
        raise RewardServerLost(
            f"{self.where(at)} is lost: POST {self.target} ({what}) failed {tries} "
            f"tr{'y' if tries == 1 else 'ies'} (last: {last}); the run was stopped (exit status 1). "
            "Bring the server back (or raise model.reward_http_retries / reward_http_timeout_s), "
            "then resume from the last checkpoint"
        )

    def _once(self, data: bytes) -> bytes:
        request = urllib.request.Request(self.target, data=data, headers=self.headers)
        timeout = self.settings.timeout_s
        try:
            with self.opener.open(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 429:
                e.close()  # its body is not read: free the connection
                raise _Retryable(f"HTTP {e.code} {e.reason}") from None
            raise
        except TimeoutError:
            raise _Retryable(
                f"no answer within model.reward_http_timeout_s = {timeout:g} s"
            ) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise _Retryable(
                    f"no answer within model.reward_http_timeout_s = {timeout:g} s"
                ) from None
            raise _Retryable(_reason(reason)) from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise _Retryable(_reason(e)) from None


def _reason(error: Any) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    return str(error)


def _body_of(error: urllib.error.HTTPError) -> str:
    try:
        return error.read().decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - the body is only shown; none is fine
        return ""
    finally:
        error.close()


def _loopback(host: str | None) -> bool:
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gather(client: _Client, jobs: list[tuple[dict, str]], at: str) -> list[Any]:
    """The answers to ``jobs`` (body, what), in order, at most ``concurrency`` at once. The first
    failure is raised once the requests in flight have ended (the others stop retrying)."""
    stop = threading.Event()
    workers = max(1, min(client.settings.concurrency, len(jobs)))
    if workers == 1:
        return [client.post(body, at, what, stop) for body, what in jobs]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="proximal-reward-http")
    try:
        futures = [pool.submit(client.post, body, at, what, stop) for body, what in jobs]
        results, first = [], None
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - raised below, after the others stop
                stop.set()
                first = first or e
        if first is not None:
            raise first
        return results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# A reward server
# ----------------------------------------------------------------------------------------------


class RewardServer:
    """A ``model.reward_urls`` entry as a reward function: the completions POSTed in batches, the
    scores checked batch by batch and returned in order (module docstring: the contract)."""

    def __init__(self, name: str, url: str, settings: HttpSettings):
        self.name, self.url, self.settings = name, url, settings
        self.client = _Client(name, "reward server", url, settings)
        self.__name__ = self.__qualname__ = name
        self.served = True  # its errors are its own lines (call_reward_functions)

    def __call__(self, prompts, completions, step=None, **columns):
        columns.pop("completion_ids", None)
        columns.pop("trainer_state", None)
        n = len(completions)
        at = f" at step {step}" if step is not None else ""
        size = self.settings.batch_size
        starts = list(range(0, n, size))
        jobs = []
        for k, i in enumerate(starts):
            body = {
                "prompts": list(prompts[i : i + size]),
                "completions": list(completions[i : i + size]),
                "columns": {c: list(v[i : i + size]) for c, v in columns.items()},
                "step": step,
            }
            jobs.append((body, f"batch {k + 1} of {len(starts)}"))
        try:
            json.dumps([b for b, _ in jobs], allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(
                f"reward server {self.name!r}{at}: the request cannot be sent as JSON ({e}); a "
                "column's values must be JSON (strings, numbers, lists, mappings)"
            ) from None
        scores: list = []
        for (body, what), answer in zip(jobs, _gather(self.client, jobs, at)):
            scores += self._scores(answer, len(body["completions"]), at, what)
        return scores

    def _scores(self, answer: Any, n: int, at: str, what: str) -> list:
        where = f"reward server {self.name!r}{at} ({what})"
        if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
            raise RewardFunctionError(
                f"{where} answered {json.dumps(answer)[:100]}; expected "
                f'{{"scores": [...]}} with one number or null per completion'
            )
        scores = answer["scores"]
        if len(scores) != n:
            raise RewardFunctionError(
                f"{where} answered {len(scores)} score{'' if len(scores) == 1 else 's'} for {n} "
                "completions"
            )
        for i, v in enumerate(scores):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise RewardFunctionError(
                    f"{where} answered a non-number at position {i}: {json.dumps(v)[:60]} "
                    "(a number, or null where it does not apply)"
                )
        return scores


# ----------------------------------------------------------------------------------------------
# A judge on an OpenAI-compatible chat endpoint
# ----------------------------------------------------------------------------------------------


def chat_url(endpoint: str) -> str:
    """``<endpoint>/chat/completions``, unless the endpoint already ends so (``http://host:8000/v1``
    and ``http://host:8000/v1/chat/completions`` are the same judge)."""
    parts = urllib.parse.urlsplit(endpoint)
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return urllib.parse.urlunsplit(parts._replace(path=path, fragment=""))


def rubric_fields(rubric: str) -> list[str]:
    """The ``{name}`` placeholders of a rubric, in order, each once."""
    return list(dict.fromkeys(_PLACEHOLDER.findall(rubric)))


def render_rubric(rubric: str, values: Mapping[str, Any]) -> str:
    """The rubric with each ``{name}`` of ``values`` replaced by its text (a non-string as JSON); any
    other brace, and a doubled ``{{name}}``, is left as it is."""

    def one(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            return match.group(0)
        v = values[key]
        return v if isinstance(v, str) else json.dumps(v)

    return _PLACEHOLDER.sub(one, rubric)


def _text(value: Any, role: str) -> Any:
    """A conversational prompt's last ``role`` message's content (a completion's: the assistant's), or
    the value itself when it is text."""
    if isinstance(value, list) and value and isinstance(value[-1], Mapping):
        for message in reversed(value):
            if message.get("role") == role:
                return message.get("content", "")
        return value[-1].get("content", "")
    return value


@dataclass
class Judge:
    """A ``model.reward_judges`` entry, loaded (:func:`load_served_rewards`)."""

    name: str
    endpoint: str
    model: str
    rubric: str
    api_key: str | None
    score_pattern: str
    scale: float
    max_tokens: int
    settings: HttpSettings

    def __post_init__(self):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = _Client(self.name, "judge", chat_url(self.endpoint), self.settings, headers)
        self.pattern = re.compile(self.score_pattern)

    def __call__(self, prompts, completions, step=None, **columns):
        at = f" at step {step}" if step is not None else ""
        jobs = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            values = {k: v[i] for k, v in columns.items()}
            values.update(prompt=_text(p, "user"), completion=_text(c, "assistant"))
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": render_rubric(self.rubric, values)}],
                "temperature": 0.0,
                "max_tokens": self.max_tokens,
            }
            jobs.append((body, f"completion {i + 1} of {len(completions)}"))
        return [
            self._score(answer, at, what)
            for (_, what), answer in zip(jobs, _gather(self.client, jobs, at))
        ]

    def _score(self, answer: Any, at: str, what: str) -> float | None:
        try:
            content = answer["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise RewardFunctionError(
                f"judge {self.name!r}{at} ({what}) answered {json.dumps(answer)[:100]}; expected an "
                'OpenAI chat completion, {"choices": [{"message": {"content": "..."}}]}'
            ) from None
        found = self.pattern.findall(content)
        if not found:
            return None
        try:
            value = float(found[-1])
        except ValueError:
            return None
        return value / self.scale if math.isfinite(value) else None


def judge_function(judge: Judge) -> Callable:
    """``judge`` as a reward function whose signature names the rubric's columns as required
    arguments, so that a rubric naming a column the prompts lack is refused before any model
    (:func:`~proximal.rollout.reward_functions.reward_argument_problems`)."""

    def judge_reward(prompts, completions, step=None, **columns):
        return judge(prompts, completions, step=step, **columns)

    P = inspect.Parameter
    params = [
        P("prompts", P.POSITIONAL_OR_KEYWORD),
        P("completions", P.POSITIONAL_OR_KEYWORD),
        P("step", P.KEYWORD_ONLY, default=None),
        *(P(f, P.KEYWORD_ONLY) for f in rubric_fields(judge.rubric) if f not in RUBRIC_FIELDS),
    ]
    judge_reward.__signature__ = inspect.Signature(params)
    judge_reward.__name__ = judge_reward.__qualname__ = judge.name
    judge_reward.judge = judge
    judge_reward.served = True  # its errors are its own lines (call_reward_functions)
    return judge_reward
