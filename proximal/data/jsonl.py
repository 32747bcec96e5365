"""Reading JSONL files with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """Bad input data; the message names the file, the line and the offending value."""


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for every non-blank line; line numbers start at 1.

    Raises DataError for a missing or unreadable file, a line that is not JSON, or a line that is
    not a JSON object.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: file not found")
    if not p.is_file():
        raise DataError(f"{p}: not a file")
    try:
        fh = p.open("rb")
    except OSError as e:
        raise DataError(f"{p}: cannot read ({e.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{p}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            yield lineno, record


def require_str(record: dict, key: str, where: str) -> str:
    """``record[key]`` as a string, or a DataError naming ``where`` (``file:line``) and the key."""
    if key not in record:
        raise DataError(
            f"{where}: missing field {key!r} (fields present: {', '.join(sorted(record)) or 'none'})"
        )
    value = record[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.60}"
        )
    return value


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
