"""Typed run configuration: nested dataclasses, a YAML file, and ``--section.key value`` overrides.

Every command's config is a dataclass whose fields are sections (dataclasses themselves) or plain
values. Each leaf field carries its documentation in ``metadata["help"]`` (use :func:`option`), so
``--help`` can list every field with its default, and every field is read somewhere — a config
field nobody consumes is a bug.

Loading order: dataclass defaults → YAML file → command-line overrides. All problems found while
loading (unknown keys, wrong types, failed ``validate()`` checks) are reported together in one
:class:`ConfigError` before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names every offending key and value."""


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple | None = None,
    default_factory: Any = dataclasses.MISSING,
    python: str | None = None,
    aliases: dict[str, Any] | None = None,
) -> Any:
    """A documented config field. ``choices`` restricts the allowed values and is checked on load;
    ``aliases`` maps other spellings (compared lower-case, YAML's booleans as ``true``/``false``) to
    one of them.
    ``python``: a field that names a checkpoint or data file also takes, from Python, the thing itself
    (:data:`PYTHON_KINDS`: ``"model"`` or ``"data"``; see :class:`PythonObject`)."""
    metadata = {"help": help, "choices": choices, "python": python, "aliases": aliases}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str = "", **defaults: Any) -> Any:
    """A nested config section, built from its own defaults and then ``defaults`` (the command's own,
    e.g. ``section(OptimSection, lr=1e-6)``)."""
    factory = (lambda: cls(**defaults)) if defaults else cls
    return dataclasses.field(default_factory=factory, metadata={"help": help, "choices": None})


def reworded(base: type, name: str, help: str) -> Any:
    """Field ``name`` of the section ``base`` — its default and its choices — with another ``--help``
    text: for a section that extends ``base`` and says what the field means for its own command
    (``path: str = reworded(ModelSection, "path", "The reward model's initial weights ...")``)."""
    f = base.__dataclass_fields__[name]
    return option(
        f.default,
        help,
        choices=f.metadata.get("choices"),
        default_factory=f.default_factory,
        python=f.metadata.get("python"),
        aliases=f.metadata.get("aliases"),
    )


def section_problems(cfg: Any) -> list[str]:
    """Every section's ``problems()`` of a command's config, in the order the sections are declared:
    the start of each config's ``validate()``, which then adds the checks across sections."""
    parts = (getattr(cfg, f.name) for f in dataclasses.fields(cfg))
    return [problem for part in parts if hasattr(part, "problems") for problem in part.problems()]


# ----------------------------------------------------------------------------------------------
# Objects given from Python (docs/python.md)
# ----------------------------------------------------------------------------------------------

#: What a field declared with ``option(python=KIND)`` takes from Python besides a path.
PYTHON_KINDS = {
    "model": "a loaded model (a transformers PreTrainedModel) or a (model, tokenizer) pair",
    "data": "rows: a list of dicts, a datasets.Dataset or DatasetDict, or a pandas DataFrame",
}
#: How config.yaml and every message write a value given from Python.
PLACEHOLDER = "<python object: "


class PythonObject:
    """A model or data set given from Python where a config file names a path (``option(python=)``).

    ``value`` is the object as given; ``field`` its dotted config name. It prints as a placeholder,
    ``<python object: Qwen2ForCausalLM>``, in messages and in the run's ``config.yaml``, which
    cannot hold the object; a config file holding such a placeholder is refused with a message
    saying how to continue the run (:func:`python_objects`). The loaders
    (:func:`proximal.models.loading.load_causal_lm`, :func:`proximal.data.sources.read_rows`, ...)
    take it where they take a path and use a copy of the object, never the object itself.
    """

    __slots__ = ("value", "field", "kind")

    def __init__(self, value: Any, field: str, kind: str):
        self.value, self.field, self.kind = value, field, kind

    def __str__(self) -> str:
        return f"{PLACEHOLDER}{python_name(self.value)}>"

    __repr__ = __str__

    def __deepcopy__(self, memo: dict) -> PythonObject:
        return self  # a config copied (dataclasses.asdict) must not copy a model


def python_name(value: Any) -> str:
    """A short description of a Python object: ``Qwen2ForCausalLM``, ``list of 64 rows``, ``function
    my_rewards.correct``."""
    if isinstance(value, PythonObject):
        return python_name(value.value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and _is_model(value[0]):
        if _is_tokenizer(value[1]):
            return f"{type(value[0]).__name__} with its tokenizer"
        return f"({type(value[0]).__name__}, {type(value[1]).__name__})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} rows"
    if isinstance(value, dict) and hasattr(value, "column_names"):  # a datasets.DatasetDict
        return f"{type(value).__name__} ({', '.join(map(str, value))})"
    if hasattr(value, "column_names") or hasattr(value, "iloc"):  # a Dataset, a DataFrame
        size = f" of {len(value)} rows" if hasattr(value, "__len__") else ""
        return f"{type(value).__name__}{size}"
    if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type):
        return f"function {getattr(value, '__module__', '?')}.{value.__qualname__}"
    return type(value).__name__


def _is_model(value: Any) -> bool:
    """A transformers model, by what it has (no import of torch or transformers here)."""
    return hasattr(value, "config") and hasattr(value, "save_pretrained") and callable(value)


def _is_tokenizer(value: Any) -> bool:
    return hasattr(value, "get_vocab") and hasattr(value, "decode")


def _python_kind_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` cannot stand where a ``kind`` path is expected (None: it can)."""
    if kind == "model":
        if _is_model(value):
            return None
        if isinstance(value, (list, tuple)) and len(value) == 2:
            if _is_model(value[0]) and _is_tokenizer(value[1]):
                return None
    elif kind == "data":
        if isinstance(value, (list, tuple)) or hasattr(value, "column_names"):
            return None
        if hasattr(value, "iloc") and hasattr(value, "to_dict"):
            return None
    return f"expected a path or, from Python, {PYTHON_KINDS[kind]}; got {python_name(value)}"


def python_objects(cfg: Any, prefix: str = "") -> list[str]:
    """Make a config built in Python (or loaded with ``base=``) ready to validate, in place: a value
    given where a field names a path — a model, rows — is wrapped in a :class:`PythonObject` (once);
    a ``pathlib.Path`` becomes its string. Returns the problems: an object a field cannot take, and
    a placeholder of an object that a config file (a run's ``config.yaml``) stands in for."""
    problems = []
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, where = getattr(cfg, f.name), prefix + f.name
        if _is_section(hints[f.name]):
            problems += python_objects(value, where + ".")
            continue
        if isinstance(value, os.PathLike):
            setattr(cfg, f.name, value := os.fspath(value))
        kind = f.metadata.get("python")
        if kind and value is not None and not isinstance(value, (str, PythonObject)):
            problem = _python_kind_problem(kind, value)
            if problem:
                problems.append(f"{where}: {problem}")
            else:
                setattr(cfg, f.name, PythonObject(value, where, kind))
        texts = value if isinstance(value, list) else [value]
        problems += [
            f"{where} = {text!r}: the run was given a Python object here, which a config file "
            "cannot hold; continue it from Python with the same objects (docs/python.md), or save "
            "the object (save_pretrained, a data file) and give its path"
            for text in texts
            if isinstance(text, str) and text.startswith(PLACEHOLDER)
        ]
    return problems


# ----------------------------------------------------------------------------------------------
# Local paths that do not exist
# ----------------------------------------------------------------------------------------------


def could_be_local(path: str) -> bool:
    """Whether ``path``, which does not exist, was meant as a local path rather than a hub id or a
    data set name: it starts with ``.``, ``/`` or ``~``, has more than one ``/`` (a hub id has one),
    or its first component is a directory here (``runs/stf`` where ``runs/`` exists: a typo of
    ``runs/sft``, not the hub's user ``runs``). A URL (``reasoning-gym://chain_sum``) is not."""
    if "://" in path:
        return False
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return True
    first, sep, _ = path.partition("/")
    return bool(sep) and Path(first).is_dir()


def missing_path(path: str, what: str = "directory") -> str:
    """``no directory runs/stf (did you mean runs/sft?)``: the path that does not exist, with the
    closest existing one (:func:`close_path`) when there is one. ``what``: ``"directory"`` (a
    checkpoint) or ``"file or directory"`` (data)."""
    guess = close_path(path, dirs_only=what == "directory")
    return f"no {what} {path}" + (f" (did you mean {guess}?)" if guess else "")


def close_path(path: str, *, dirs_only: bool = False) -> str | None:
    """The existing path closest to ``path``, which does not exist: its first missing component
    replaced by the closest name (difflib) among the entries of its deepest existing parent
    (``runs/stf`` → ``runs/sft``); None when no name is close."""
    node, tail = Path(path).expanduser(), []
    while not node.exists() and node != node.parent:
        tail.insert(0, node.name)
        node = node.parent
    if not tail or not node.is_dir():
        return None
    dirs_only = dirs_only or len(tail) > 1
    try:
        names = [c.name for c in node.iterdir() if not dirs_only or c.is_dir()]
    except OSError:
        return None
    close = difflib.get_close_matches(tail[0], names, n=1)
    return str(Path(node, close[0], *tail[1:])) if close else None


def local_path_problems(cfg: Any, prefix: str = "") -> list[str]:
    """``<field>: no directory runs/stf (did you mean runs/sft?)`` for every model or data path field
    (``option(python=...)``) that names a local path that does not exist (:func:`could_be_local`):
    found with the config, before anything loads or asks the hub."""
    problems = []
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, where = getattr(cfg, f.name), prefix + f.name
        if _is_section(hints[f.name]):
            problems += local_path_problems(value, where + ".")
        elif (
            f.metadata.get("python")
            and isinstance(value, str)
            and value
            and not value.startswith(PLACEHOLDER)
            and could_be_local(value)
            and not Path(value).expanduser().exists()
        ):
            what = "directory" if f.metadata["python"] == "model" else "file or directory"
            problems.append(f"{where}: {missing_path(value, what)}")
    return problems


# ----------------------------------------------------------------------------------------------
# Type handling
# ----------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is not None:  # list[str] → "list[str]"
        name = str(inner).replace("typing.", "")
    else:
        name = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
    return f"{name} or null" if optional else name


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to ``tp``; raise ConfigError if it can't."""
    inner, optional = _unwrap_optional(tp)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed (expected {_type_name(tp)})")
    origin = typing.get_origin(inner)
    try:
        if inner is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("false", "no", "0", "off"):
                return False
            raise ValueError
        if inner is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            if isinstance(value, str):
                f = float(value)  # accept "1e3"
                if not f.is_integer():
                    raise ValueError
                return int(f)
            return int(value)
        if inner is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if inner is str:
            if isinstance(value, os.PathLike):
                return os.fspath(value)
            if not isinstance(value, (str, int, float)):  # YAML's scalars; never str() of an object
                raise ValueError
            return str(value)
        if origin in (list, tuple):
            (item_tp, *_) = typing.get_args(inner) or (Any,)
            if isinstance(value, str):
                value = (
                    yaml.safe_load(value)
                    if value.strip().startswith("[")
                    else [v for v in value.split(",") if v]
                )
            if not isinstance(value, (list, tuple)):
                raise ValueError
            items = [
                _coerce(v, item_tp, f"{where}[{i}]") if item_tp is not Any else v
                for i, v in enumerate(value)
            ]
            return items if origin is list else tuple(items)
        if origin is dict or inner is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
        if inner is Any:
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {_shown(value)} is not a valid {_type_name(tp)}") from None
    return value


def _shown(value: Any) -> str:
    """A value in a message: its repr, or a placeholder for an object (a model's repr is pages long)."""
    if value is None or isinstance(value, (bool, int, float, str, list, tuple, dict)):
        return repr(value)
    return f"{PLACEHOLDER}{python_name(value)}>"


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def _apply(
    cfg: Any,
    data: dict,
    prefix: str,
    errors: list[str],
    renamed: dict[str, str],
    foreign: dict[str, str],
) -> None:
    hints = _hints(type(cfg))
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if where in renamed:
            errors.append(f"{where}: no longer a field; {renamed[where]}")
            continue
        if key not in fields and key in foreign:
            errors.append(f"{where}: a TRL/OpenRLHF name, not a field here; {foreign[key]}")
            continue
        if key not in fields:
            known = ", ".join(sorted(fields))
            errors.append(f"{where}: unknown key (known here: {known})")
            continue
        tp = hints[key]
        if fields[key].metadata.get("python") and not isinstance(value, (str, type(None))):
            setattr(cfg, key, value)  # a model or rows from Python: python_objects checks it
            continue
        if _is_section(tp):
            if not isinstance(value, dict):
                errors.append(f"{where}: expected a section (mapping), got {value!r}")
                continue
            _apply(getattr(cfg, key), value, where + ".", errors, renamed, foreign)
            continue
        aliases = fields[key].metadata.get("aliases") or {}
        spelled = str(value).strip().lower() if isinstance(value, (str, bool)) else None
        if spelled in aliases:
            value = aliases[spelled]
        try:
            coerced = _coerce(value, tp, where)
        except ConfigError as e:
            errors.append(str(e))
            continue
        choices = fields[key].metadata.get("choices")
        if choices is not None and coerced not in choices:
            errors.append(f"{where}: {coerced!r} is not one of {', '.join(map(repr, choices))}")
            continue
        setattr(cfg, key, coerced)


def _nest(dotted: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{key}: conflicts with another override")
        node[parts[-1]] = value
    return out


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--ppo.lr", "1e-5", "--rollout.top_k=5"]`` → ``{"ppo.lr": "1e-5", "rollout.top_k": "5"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key value")
        key = a[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key}: missing value")
            i += 1
            value = args[i]
        out[key.replace("-", "_")] = value
        i += 1
    return out


def load_config(
    cls: type,
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: Any | None = None,
    *,
    paths: bool = True,
) -> Any:
    """Build a ``cls`` config from defaults (or ``base``), a YAML file and dotted overrides, then validate.

    ``paths=False`` leaves out the check that local paths exist (:func:`local_path_problems`): for a
    config checked before an earlier stage writes what it reads (the demo's stages, each checked
    before the first trains); the trainer's :func:`check_valid` looks at them when the stage runs.

    Raises one ConfigError listing every problem found. A key listed in the class's ``RENAMED``
    (``{"old.path": "what to write instead"}``) is an error that names its new place, so an old config
    file never silently loses a setting; likewise an unknown key (at any level) listed in its
    ``FOREIGN_NAMES`` (another library's name → where it lives here: a TRL config's
    ``learning_rate``; :mod:`proximal.train.trl_names`).
    """
    cfg = base if base is not None else cls()
    renamed = dict(getattr(cls, "RENAMED", {}))
    foreign = dict(getattr(cls, "FOREIGN_NAMES", {}))
    errors: list[str] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p}: not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(
                f"config file {p}{line}: not valid YAML ({getattr(e, 'problem', e)})"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: the top level must be a mapping of sections")
        _apply(cfg, data, "", errors, renamed, foreign)
    if overrides:
        _apply(cfg, _nest(dict(overrides)), "", errors, renamed, foreign)
    errors.extend(_problems(cfg, paths=paths))  # fields that failed to load kept their defaults
    raise_if_invalid(errors)
    return cfg


def _problems(cfg: Any, *, paths: bool = True) -> list[str]:
    """A loaded config's problems: objects from Python a field cannot take, else the local paths that
    do not exist (:func:`local_path_problems`, unless ``paths`` is False) and ``validate()``'s checks
    (less its own word on a field already named for its path)."""
    problems = python_objects(cfg)
    if problems:
        return problems
    problems = local_path_problems(cfg) if paths else []
    named = {p.partition(":")[0] for p in problems}
    if hasattr(cfg, "validate"):
        problems += [e for e in cfg.validate() if e.partition(":")[0] not in named]
    return problems


def raise_if_invalid(errors: list[str]) -> None:
    """One ConfigError listing every problem found (none: nothing happens)."""
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def check_valid(cfg: Any) -> None:
    """``cfg.validate()``'s problems as one ConfigError: what a trainer called with a config built in
    code (not through :func:`load_config`) checks first. Objects given from Python are wrapped
    first (:func:`python_objects`)."""
    raise_if_invalid(_problems(cfg))


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML values, section by section; an object given from Python (a model,
    rows, a reward function) as its placeholder, ``<python object: ...>``."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return str(value) if isinstance(value, PythonObject) else f"{PLACEHOLDER}{python_name(value)}>"


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls: type, prefix: str = "", inst: Any = None) -> list[tuple[str, str, Any, str]]:
    """Every leaf field as ``(dotted name, type, default, help)``, for ``--help`` and the docs.

    Defaults are read from a default-built instance, so a command's own section defaults show."""
    rows = []
    inst = cls() if inst is None else inst
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            rows.extend(describe(tp, prefix + f.name + ".", getattr(inst, f.name)))
        else:
            help_ = f.metadata.get("help", "")
            if f.metadata.get("choices"):
                help_ += f" One of: {', '.join(map(str, f.metadata['choices']))}."
            rows.append((prefix + f.name, _type_name(tp), getattr(inst, f.name), help_))
    return rows


def help_text(cls: type) -> str:
    lines = ["config fields (set in the YAML file, or override with --section.key value):"]
    for name, tp, default, help_ in describe(cls):
        lines.append(f"  --{name} ({tp}, default {default!r})")
        if help_:
            lines.append(f"      {help_}")
    return "\n".join(lines)


def check_divides(
    errors: list[str], numerator_name: str, numerator: int, denominator_name: str, denominator: int
) -> None:
    """Append an error unless ``denominator`` divides ``numerator`` exactly (no silent flooring)."""
    if denominator <= 0:
        errors.append(f"{denominator_name} = {denominator} must be positive")
    elif numerator % denominator != 0:
        errors.append(
            f"{numerator_name} = {numerator} is not divisible by {denominator_name} = {denominator}"
        )
