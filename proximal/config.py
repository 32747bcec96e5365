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
) -> Any:
    """A documented config field. ``choices`` restricts the allowed values and is checked on load."""
    metadata = {"help": help, "choices": choices}
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
    )


def section_problems(cfg: Any) -> list[str]:
    """Every section's ``problems()`` of a command's config, in the order the sections are declared:
    the start of each config's ``validate()``, which then adds the checks across sections."""
    parts = (getattr(cfg, f.name) for f in dataclasses.fields(cfg))
    return [problem for part in parts if hasattr(part, "problems") for problem in part.problems()]


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
            if isinstance(value, (dict, list)):
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
        raise ConfigError(f"{where}: {value!r} is not a valid {_type_name(tp)}") from None
    return value


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def _apply(cfg: Any, data: dict, prefix: str, errors: list[str], renamed: dict[str, str]) -> None:
    hints = _hints(type(cfg))
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if where in renamed:
            errors.append(f"{where}: no longer a field; {renamed[where]}")
            continue
        if key not in fields:
            known = ", ".join(sorted(fields))
            errors.append(f"{where}: unknown key (known here: {known})")
            continue
        tp = hints[key]
        if _is_section(tp):
            if not isinstance(value, dict):
                errors.append(f"{where}: expected a section (mapping), got {value!r}")
                continue
            _apply(getattr(cfg, key), value, where + ".", errors, renamed)
            continue
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
) -> Any:
    """Build a ``cls`` config from defaults (or ``base``), a YAML file and dotted overrides, then validate.

    Raises one ConfigError listing every problem found. A key listed in the class's ``RENAMED``
    (``{"old.path": "what to write instead"}``) is an error that names its new place, so an old config
    file never silently loses a setting.
    """
    cfg = base if base is not None else cls()
    renamed = dict(getattr(cls, "RENAMED", {}))
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
        _apply(cfg, data, "", errors, renamed)
    if overrides:
        _apply(cfg, _nest(dict(overrides)), "", errors, renamed)
    if hasattr(cfg, "validate"):  # fields that failed to load kept their (valid) defaults
        errors.extend(cfg.validate())
    raise_if_invalid(errors)
    return cfg


def raise_if_invalid(errors: list[str]) -> None:
    """One ConfigError listing every problem found (none: nothing happens)."""
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def check_valid(cfg: Any) -> None:
    """``cfg.validate()``'s problems as one ConfigError: what a trainer called with a config built in
    code (not through :func:`load_config`) checks first."""
    raise_if_invalid(cfg.validate())


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


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
