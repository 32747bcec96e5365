"""Tools: plain typed Python functions the policy calls, their schemas, and the call formats.

A tool is a module-level function with type hints and a Google-style docstring — the form
``transformers`` and TRL take::

    def calculator(expression: str) -> int:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: integers with + - * and parentheses, e.g. "123*456".
        \"\"\"
        ...

:func:`tool_schemas` gives each one's JSON schema (``transformers.utils.get_json_schema``), which
the chat template shows the model through its ``tools=`` argument. The policy calls a tool by
writing a call in its turn; a **call format** reads the calls out of the turn's text:

* ``"hermes"`` — Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one JSON object per block, any number of blocks (:func:`parse_hermes`);
* ``"minimal"`` — for character-level tiny models: ``[name arg1 arg2]``, the arguments separated by
  whitespace, the last one taking the rest of the text, each converted by the parameter's type
  hint (:class:`MinimalFormat`; its brackets can be changed).

A call that cannot be read (an unclosed block, bad JSON, arguments that do not fit the signature,
a name no tool has) is *malformed*: counted apart, and answered with an error message the policy
reads (:mod:`proximal.agents.env`). The calls run in worker processes (:mod:`proximal.agents.worker`).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from transformers.utils import get_json_schema

from proximal.config import ConfigError
from proximal.specs import import_spec

#: The call formats: ``tools.format``.
FORMATS = ("hermes", "minimal")


@dataclass(frozen=True)
class ToolCall:
    """A call read from the policy's text: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Malformed:
    """Text that was meant as a call and cannot be one: what was written and why it fails."""

    text: str
    reason: str


Call = ToolCall | Malformed


# ----------------------------------------------------------------------------------------------
# Loading tools and their schemas
# ----------------------------------------------------------------------------------------------


def load_tools(
    specs: Sequence[str | Callable], field: str = "tools.functions"
) -> dict[str, Callable]:
    """``{name: function}`` for ``tools.functions``: each ``module:function`` imported (a callable
    taken as it is, :func:`~proximal.specs.import_spec`), named by its ``__name__`` as the model
    calls it, its schema made once here (:func:`tool_schemas`). ConfigError naming the entry —
    ``tools.functions[2] 'mod:calc': ...`` — for one that cannot be imported, is not a plain
    function a worker process can import, has no schema (a docstring or type hint missing), or
    shares its name with another."""
    out: dict[str, Callable] = {}
    for i, spec in enumerate(specs):
        where = f"{field}[{i}]"
        fn = import_spec(spec, where)
        shown = spec if isinstance(spec, str) else getattr(fn, "__qualname__", repr(fn))
        name = getattr(fn, "__name__", None)
        if not inspect.isfunction(fn) or name is None or name == "<lambda>":
            raise ConfigError(
                f"{where} {shown!r}: expected a plain function defined at the top of a module (a "
                f"worker process imports it by name), got {type(fn).__name__}"
            )
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
            raise ConfigError(
                f"{where}: tool {name!r} is defined in {fn.__module__}.{fn.__qualname__}, which a "
                "worker process cannot import; define it at the top of an importable module"
            )
        if name in out:
            raise ConfigError(
                f"{where}: two tools are named {name!r}; a tool's name is how it is called"
            )
        try:
            tool_schemas({name: fn})
        except ConfigError as e:
            raise ConfigError(f"{where} {shown!r}: {e}") from None
        out[name] = fn
    return out


def environment_tools(cls: type) -> dict[str, Callable]:
    """An environment class's tools, TRL's rule: its public methods other than ``reset``, ``step``,
    ``get_reward`` and ``close`` — ``{name: the function (unbound)}``."""
    return {
        name: member
        for name, member in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


#: Methods of an environment that are its interface, never tools.
NOT_TOOLS = ("reset", "step", "get_reward", "close")


def tool_schemas(functions: dict[str, Callable]) -> list[dict]:
    """Each tool's JSON schema (``{"type": "function", "function": {...}}``), for the chat
    template's ``tools=``; an environment's methods are read without ``self``. ConfigError naming
    the tool when its docstring or type hints cannot make a schema."""
    out = []
    for name, fn in functions.items():
        target = _without_self(fn)
        try:
            out.append(get_json_schema(target))
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(
                f"tool {name!r}: no schema can be made from it ({e}); give every argument a type "
                "hint and a Google-style docstring with an 'Args:' section"
            ) from e
    return out


def _without_self(fn: Callable) -> Callable:
    params = list(inspect.signature(fn).parameters)
    if not params or params[0] != "self":
        return fn

    def bound(*args, **kwargs):  # a stand-in with the method's signature less ``self``
        raise NotImplementedError

    sig = inspect.signature(fn)
    bound.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    bound.__name__, bound.__doc__ = fn.__name__, fn.__doc__
    bound.__annotations__ = {k: v for k, v in get_type_hints(fn).items() if k != "self"}
    return bound


# ----------------------------------------------------------------------------------------------
# Call formats
# ----------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, tools: dict[str, Callable] | None = None) -> list[Call]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text``, in order.

    ``arguments`` may also be a JSON string holding the object (some models write it so); a block
    without its closing tag (the turn was cut), with JSON that does not parse, or without a string
    ``name`` and an object ``arguments`` is :class:`Malformed`. ``tools`` is not needed (the JSON
    names its arguments) and is accepted for the common signature."""
    calls: list[Call] = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(Malformed(m.group(0), "no closing </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(Malformed(m.group(0), f"not JSON ({e.msg})"))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(Malformed(m.group(0), 'expected {"name": str, "arguments": {...}}'))
        elif not isinstance(args, dict):
            calls.append(Malformed(m.group(0), "'arguments' is not an object"))
        else:
            calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass(frozen=True)
class MinimalFormat:
    """``[name arg1 arg2 ...]``: a format a character-level model can write in a few tokens.

    Between ``open`` and ``close``: the tool's name, whitespace, then its arguments in the order of
    its parameters, separated by whitespace; the last parameter takes the rest of the text (so a
    one-argument tool gets everything after the name: ``[calculator 12 * 3]`` →
    ``calculator(expression="12 * 3")``). Each argument is converted by its type hint (``int``,
    ``float``, ``bool`` as ``true``/``false``; anything else stays a string)."""

    open: str = "["
    close: str = "]"

    def format(self, name: str, *args: Any) -> str:
        return self.open + " ".join([name, *(str(a) for a in args)]) + self.close

    def parse(self, text: str, tools: dict[str, Callable] | None = None) -> list[Call]:
        calls: list[Call] = []
        at = 0
        while (start := text.find(self.open, at)) >= 0:
            end = text.find(self.close, start + len(self.open))
            if end < 0:
                calls.append(Malformed(text[start:], f"no closing {self.close!r}"))
                break
            calls.append(self._call(text[start : end + len(self.close)], tools or {}))
            at = end + len(self.close)
        return calls

    def _call(self, whole: str, tools: dict[str, Callable]) -> Call:
        inner = whole[len(self.open) : len(whole) - len(self.close)].strip()
        name, _, rest = inner.partition(" ")
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            return Malformed(whole, f"{name!r} is not a tool name")
        if name not in tools:  # its parameters are needed to read the arguments
            return ToolCall(name, {})  # the caller reports the unknown name
        params = [
            p
            for p in inspect.signature(_without_self(tools[name])).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        rest = rest.strip()
        values = rest.split(None, len(params) - 1) if params and rest else []
        required = [p for p in params if p.default is p.empty]
        if len(values) < len(required) or (not params and rest):
            return Malformed(whole, f"{name} takes {len(params)} argument(s), got {len(values)}")
        hints = get_type_hints(_without_self(tools[name]))
        args = {}
        for p, v in zip(params, values):
            try:
                args[p.name] = _convert(v, hints.get(p.name))
            except ValueError:
                return Malformed(
                    whole, f"argument {p.name} = {v!r} is not of type {hints[p.name].__name__}"
                )
        return ToolCall(name, args)


def _convert(value: str, hint: Any) -> Any:
    if hint is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(value)
        return value.lower() == "true"
    if hint in (int, float):
        return hint(value)
    return value


def call_parser(format: str, open: str = "[", close: str = "]") -> Callable[..., list[Call]]:
    """``parse(text, tools) -> [ToolCall | Malformed]`` for ``tools.format``."""
    if format == "hermes":
        return parse_hermes
    if format == "minimal":
        return MinimalFormat(open, close).parse
    raise ConfigError(f"tools.format = {format!r}; expected one of {', '.join(FORMATS)}")
