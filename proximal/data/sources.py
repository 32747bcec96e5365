"""One reader for every command's data: JSONL, JSON, Parquet, CSV, Arrow, ``save_to_disk`` directories
and data set names in the local Hugging Face cache.

:func:`read_rows` yields ``(where, record)``; ``where`` names the file and row the way every error
message does: ``file:line`` for JSONL (a line number, 1-based, as an editor shows it), ``file[row N]``
for JSON lists and table files (N counts data rows from 0, as ``datasets`` indexes them),
``dir[split][row N]`` for a ``DatasetDict`` saved with ``save_to_disk`` and ``name[split][row N]``
for a cached data set.

JSONL and JSON lists are read with the standard library; the other formats need the optional
``datasets`` package (``pip install 'proximal-rlhf[datasets]'``). A data set name is looked up in the
local cache only: this module never downloads (the hub is switched off while it loads).

From Python, rows may also be given in the config itself (a :class:`proximal.config.PythonObject`):
a list of dicts, a ``datasets.Dataset`` or ``DatasetDict`` or a pandas ``DataFrame``; each row is
then named by the field it was given in, ``data.train_file[row N]`` (N from 0).

``reasoning-gym://NAME?...`` names rows a reasoning-gym generator makes (:mod:`proximal.data.gym`),
``reasoning-gym://NAME[split][row N]``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from proximal.config import PythonObject, close_path, could_be_local, missing_path, python_name
from proximal.data import gym
from proximal.data.jsonl import DataError, read_jsonl

#: File suffixes read by :func:`read_rows`, and what reads them.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SUFFIXES = (*JSONL_SUFFIXES, ".json", *TABLE_SUFFIXES)
KNOWN = (
    "JSONL (.jsonl), JSON (.json: a list of objects, or one object per line), Parquet (.parquet), "
    "CSV (.csv), Arrow (.arrow), a directory written by datasets' save_to_disk, or the name of a "
    "data set in the local Hugging Face cache"
)
INSTALL = "pip install 'proximal-rlhf[datasets]'"
#: What a hub data set id looks like: ``name`` or ``owner/name`` (letters, digits, ``-_.``).
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def read_rows(
    path: str | Path | PythonObject,
    *,
    split: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` for every row of a data file, directory or cached data set.

    Args:
        path: a file (the format is chosen by its suffix; a ``.json`` file by its first character),
            a ``save_to_disk`` directory, or a data set name found in the local Hugging Face cache;
            or rows given from Python (module docstring).
        split: the split of a ``DatasetDict`` (a directory or a cached name); None = ``"train"``. A
            single file is one split, ``"train"``.
        columns: canonical field → column name (``{"prompt": "question"}``), applied to every row:
            the row gets the canonical field with that column's value, and loses the column.

    Raises DataError naming the file (and row, where there is one) for a missing file, an unknown
    format, a missing split, a column mapping naming a column the data lacks, or a malformed row.
    """
    columns = dict(columns or {})
    if isinstance(path, PythonObject):
        rows = _python_rows(path.value, path.field, split)
    elif gym.is_gym_source(path):
        rows = gym.rows(str(path), split)
    else:
        rows = _rows(Path(path), str(path), split)
    for where, record in rows:
        yield where, _renamed(record, columns, where) if columns else record


def is_data_source(path: str | Path) -> bool:
    """Whether :func:`read_rows` would read ``path`` as data (rather than, say, a plain text file):
    a known suffix, a directory, or a name that is not an existing file; rows given from Python."""
    if isinstance(path, PythonObject) or gym.is_gym_source(path):
        return True
    p = Path(path)
    return p.suffix.lower() in SUFFIXES or p.is_dir() or not p.exists()


def source_problem(path: str, field: str) -> str | None:
    """A config problem for a data path that is neither an existing file/directory nor a name in the
    local Hugging Face cache; None when it can be read (its rows are checked when it is), as rows
    given from Python can. A ``reasoning-gym://`` source is parsed (:mod:`proximal.data.gym`)."""
    if gym.is_gym_source(path):
        return gym.problem(path, field)
    if (
        isinstance(path, PythonObject)
        or Path(path).exists()
        or (_looks_like_name(path) and _cached(path))
    ):
        return None
    if could_be_local(path):
        return f"{field}: {missing_path(path, 'file or directory')}"
    where = f" (looked in {datasets_cache()})" if _looks_like_name(path) else ""
    return f"{field}: {path!r} does not exist{where}"


def same_rows(
    path: str | Path | PythonObject,
    split: str | None,
    other: str | Path | PythonObject,
    other_split: str | None,
) -> bool:
    """Whether two data paths, each at its split, name the same rows (read from neither): the same
    file; the same split of a ``save_to_disk`` DatasetDict, whether given as the directory and the
    split or as the split's own subdirectory; the same cached name and split; the same object
    given from Python."""
    return _identity(path, split) == _identity(other, other_split)


def same_rows_note(path: str | Path | PythonObject, split: str | None) -> str:
    """The line said when the held-out data is the training data (:func:`same_rows`)."""
    splits = _saved_splits(Path(path)) if not isinstance(path, PythonObject) else []
    others = f" (its splits: {', '.join(splits)})" if len(splits) > 1 else ""
    return (
        f"data.eval_file reads the very rows data.train_file reads ({path}, split "
        f"{split or 'train'!r}): the held-out metrics measure training rows; set data.eval_split"
        f"{others} or another data.eval_file"
    )


def _identity(path: str | Path | PythonObject, split: str | None) -> tuple:
    split = split or "train"
    if isinstance(path, PythonObject):
        return ("python", id(path.value), split)
    p = Path(path)
    if not p.exists():
        return ("name", str(path), split)
    if p.is_dir() and (p / "dataset_dict.json").is_file():
        return ("path", (p / split).resolve(), "train")  # a split's rows: its subdirectory's
    return ("path", p.resolve(), split)


def _saved_splits(p: Path) -> list[str]:
    """The splits of a ``save_to_disk`` DatasetDict at ``p`` ([] for anything else)."""
    try:
        return list(json.loads((p / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def datasets_cache() -> Path:
    """Where ``datasets`` keeps prepared data sets: ``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``,
    else ``~/.cache/huggingface/datasets`` (read from the environment at each call, so a test or
    a user can point it elsewhere after ``datasets`` was imported)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "datasets"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "datasets"


# ----------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------


def _rows(p: Path, name: str, split: str | None) -> Iterator[tuple[str, dict]]:
    if p.is_dir():
        return _saved(p, split)
    if not p.exists():
        local = could_be_local(name)
        if p.suffix.lower() not in SUFFIXES and _looks_like_name(name) and not local:
            return _cached_rows(name, split)
        guess = close_path(name)
        raise DataError(f"{p}: file not found" + (f" (did you mean {guess}?)" if guess else ""))
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{p}: unknown data format {suffix or '(no suffix)'!r}; expected {KNOWN}")
    _one_split(p, split)
    if suffix in JSONL_SUFFIXES or (suffix == ".json" and _first_char(p) != "["):
        return ((f"{p}:{n}", r) for n, r in read_jsonl(p))
    if suffix == ".json":
        return _json_list(p)
    return _table(p, TABLE_SUFFIXES[suffix])


def _python_rows(value: Any, name: str, split: str | None) -> Iterator[tuple[str, dict]]:
    """Rows given from Python: a list (or tuple) of dicts, a datasets ``Dataset`` or ``DatasetDict``,
    a pandas ``DataFrame``; ``name`` is the config field they were given in."""
    if isinstance(value, dict):  # a DatasetDict
        want = split or "train"
        if want not in value:
            raise DataError(
                f"{name}: no split {want!r} (splits: {', '.join(map(str, value))}); set data.split"
            )
        value, name = value[want], f"{name}[{want}]"
    elif split not in (None, "train"):
        raise DataError(
            f"{name}: no split {split!r} (rows given from Python are one split, 'train')"
        )
    if hasattr(value, "iloc") and hasattr(value, "to_dict"):  # a pandas DataFrame
        value = value.to_dict("records")
    for i, record in enumerate(value):
        if not isinstance(record, Mapping):
            raise DataError(
                f"{name}[row {i}]: expected a dict of the row's fields, got "
                f"{type(record).__name__} {record!r:.60}"
            )
        yield f"{name}[row {i}]", dict(record)


def _one_split(p: Path, split: str | None) -> None:
    if split not in (None, "train"):
        raise DataError(
            f"{p}: no split {split!r} in a single file (a file is one split, 'train'); set "
            "data.split: null or give a save_to_disk directory or data set name with that split"
        )


def _first_char(p: Path) -> str:
    """The first non-blank character of a file ('' for an empty one): '[' marks a JSON list."""
    with p.open("rb") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.lstrip().lstrip(b"\xef\xbb\xbf").lstrip()  # a UTF-8 BOM, if any
            if stripped:
                return stripped[:1].decode("latin-1")
    return ""


def _json_list(p: Path) -> Iterator[tuple[str, dict]]:
    try:
        data = json.loads(p.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: not valid UTF-8 (at byte {e.start}); save the file as UTF-8"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{p}[row {i}]: expected a JSON object, got {type(record).__name__}")
        yield f"{p}[row {i}]", record


def _datasets(p: Path | str):
    try:
        # lazy: the optional `datasets` extra, slow to import, for the formats that need it
        import datasets
    except ImportError:
        raise DataError(
            f"{p}: reading this format needs the `datasets` package ({INSTALL})"
        ) from None
    return datasets


def _table(p: Path, builder: str) -> Iterator[tuple[str, dict]]:
    datasets = _datasets(p)
    kwargs: dict[str, Any] = {}
    if builder == "csv":
        # Every cell as text: pandas would read an answer "42" as the integer 42 and an empty cell
        # as NaN, and a prompt or response must be a string.
        with p.open(newline="", encoding="utf-8-sig") as fh:
            header = next(csv.reader(fh), [])
        kwargs = dict(
            features=datasets.Features({c: datasets.Value("string") for c in header}),
            keep_default_na=False,
        )
    if p.stat().st_size == 0 or (builder == "parquet" and _parquet_rows(p) == 0):
        # pyarrow reads both as a damaged file (ArrowInvalid: 'BatchSize must be greater than 0')
        raise DataError(f"{p}: the file has no records (it is empty)")
    # streaming: rows are read from the file as they are needed, with no Arrow copy in the cache
    try:
        ds = datasets.load_dataset(
            builder, data_files={"train": str(p)}, split="train", streaming=True, **kwargs
        )
        for i, row in enumerate(ds):
            yield f"{p}[row {i}]", dict(row)
    except DataError:
        raise
    except Exception as e:  # pyarrow/pandas errors: name the file, keep the library's reason
        raise DataError(f"{p}: cannot read as {builder} ({type(e).__name__}: {e})") from None


def _saved(p: Path, split: str | None) -> Iterator[tuple[str, dict]]:
    """The rows of a ``save_to_disk`` directory: a ``DatasetDict``'s split (read from the split's own
    subdirectory, so another split's state does not matter) or a single ``Dataset``."""
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{p}: cannot read dataset_dict.json ({type(e).__name__}: {e})"
            ) from None
        want = split or "train"
        if want not in splits:
            raise DataError(f"{p}: no split {want!r} (splits: {', '.join(splits)}); set data.split")
        return _saved_dataset(p / want, f"{p}[{want}]")
    if not (p / "state.json").is_file():
        raise DataError(
            f"{p}: a directory that datasets' save_to_disk did not write (no dataset_dict.json or "
            f"state.json); expected {KNOWN}"
        )
    if split not in (None, "train"):
        raise DataError(f"{p}: no split {split!r} (a single Dataset, read as split 'train')")
    return _saved_dataset(p, str(p))


def _parquet_rows(p: Path) -> int | None:
    """The row count in a Parquet file's footer (None: unreadable; reading it says why)."""
    try:
        # lazy: pyarrow comes with the optional `datasets` extra, which _table has checked
        import pyarrow.parquet as pq

        return pq.read_metadata(p).num_rows
    except Exception:  # noqa: BLE001 - a damaged file: the read that follows names the error
        return None


def _saved_dataset(p: Path, name: str) -> Iterator[tuple[str, dict]]:
    """The rows of one ``Dataset`` written by ``save_to_disk``. An empty one (no Arrow files, which
    ``load_from_disk`` fails on with an IndexError) has no records."""
    try:
        files = json.loads((p / "state.json").read_text()).get("_data_files")
    except (OSError, ValueError, AttributeError):
        files = None  # load_from_disk names what is wrong
    if files == []:
        raise DataError(f"{name}: no records (an empty data set)")
    datasets = _datasets(p)
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # a damaged directory: name it, keep the library's reason
        raise DataError(f"{name}: cannot read ({type(e).__name__}: {e})") from None
    return ((f"{name}[row {i}]", dict(row)) for i, row in enumerate(ds))


def no_records(path: str | Path | PythonObject) -> str:
    """The message for data with no rows, naming the file, the directory or data set, or the field
    rows were given in from Python."""
    if isinstance(path, PythonObject):
        return f"{path.field}: no records ({python_name(path.value)} given from Python)"
    if Path(path).is_file():
        return f"{path}: the file has no records (it is empty or blank)"
    return f"{path}: no records"


def _splits(ds, name: str, split: str | None, datasets) -> Iterator[tuple[str, dict]]:
    if isinstance(ds, datasets.DatasetDict):
        want = split or "train"
        if want not in ds:
            raise DataError(f"{name}: no split {want!r} (splits: {', '.join(ds)}); set data.split")
        ds, name = ds[want], f"{name}[{want}]"
    elif split not in (None, "train"):
        raise DataError(f"{name}: no split {split!r} (a single Dataset, read as split 'train')")
    return ((f"{name}[row {i}]", dict(row)) for i, row in enumerate(ds))


def _looks_like_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


def _cache_dir(name: str) -> Path:
    """``owner/Name`` → ``<cache>/owner___name``, as ``datasets`` names a prepared data set."""
    parts = name.split("/")
    parts[-1] = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", parts[-1]).lower()  # CamelCase → snake
    return datasets_cache() / "___".join(parts)


def _cached(name: str) -> bool:
    # a prepared data set: <cache>/<owner___name>/<config>/<version>/<hash>/dataset_info.json
    return any(_cache_dir(name).glob("*/*/*/dataset_info.json"))


@contextmanager
def _offline(datasets):
    """The hub switched off while a cached name loads: ``datasets`` then reads its cache, and a name
    that is not there fails instead of being downloaded. (``HF_DATASETS_OFFLINE`` in the environment
    is read once, when ``datasets`` is imported, so the module's flag is set for the call.)"""
    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _cached_rows(name: str, split: str | None) -> Iterator[tuple[str, dict]]:
    cache = datasets_cache()
    if not _cached(name):
        raise DataError(
            f"{name}: file not found, and not a data set in the local Hugging Face cache (looked in "
            f"{_cache_dir(name)}; set HF_HOME or HF_DATASETS_CACHE to the cache that holds it). "
            "proximal never downloads data: load it once with datasets.load_dataset, or give a file"
        )
    datasets = _datasets(name)
    try:
        with _offline(datasets):
            ds = datasets.load_dataset(name, cache_dir=str(cache))
    except Exception as e:
        raise DataError(
            f"{name}: cannot load from the Hugging Face cache {cache} ({type(e).__name__}: {e})"
        ) from None
    return _splits(ds, name, split, datasets)


# ----------------------------------------------------------------------------------------------
# Columns
# ----------------------------------------------------------------------------------------------


def _renamed(record: dict, columns: dict[str, str], where: str) -> dict:
    """``record`` with each mapped column under its canonical name (all read before any is moved,
    so ``{prompt: completion, completion: prompt}`` swaps them)."""
    missing = [c for c in columns.values() if c not in record]
    if missing:
        raise DataError(
            f"{where}: data.columns names column {missing[0]!r}, which the data lacks (columns "
            f"present: {', '.join(sorted(record)) or 'none'})"
        )
    values = {canonical: record[column] for canonical, column in columns.items()}
    out = {k: v for k, v in record.items() if k not in columns.values()}
    out.update(values)
    return out


def columns_problems(columns: Mapping | None, field: str) -> list[str]:
    """Config problems of a ``data.columns`` mapping: string keys and values, no column used twice."""
    if columns is None:
        return []
    bad = [
        f"{k!r}: {v!r}"
        for k, v in columns.items()
        if not (isinstance(k, str) and isinstance(v, str))
    ]
    if bad:
        return [f"{field}: every canonical name and column must be a string, got {', '.join(bad)}"]
    twice = sorted({v for v in columns.values() if list(columns.values()).count(v) > 1})
    if twice:
        return [f"{field}: column {twice[0]!r} is mapped to more than one field"]
    return []
