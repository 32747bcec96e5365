"""Prompt rows made by reasoning-gym generators: the data source ``reasoning-gym://NAME?...``.

A URL scheme, so that it cannot be mistaken for a file, a data set name or a ``module:function``
spec (``reasoning-gym:chain_sum`` would read as the function ``chain_sum`` of a module)::

    data.prompts: reasoning-gym://chain_sum?size=4000&seed=0&min_terms=2&max_terms=3
    eval.prompts: reasoning-gym://chain_sum?size=4000&seed=0&min_terms=2&max_terms=3
    eval.split: test
    data.prompts: reasoning-gym://chain_sum,basic_arithmetic?weights=3,1&chain_sum.max_terms=3

The part after ``//`` names one generator, or several (comma-separated) mixed by ``weights`` (one per
generator, default all 1) as reasoning-gym's ``CompositeDataset`` mixes them: item i draws its
generator from ``Random(seed + i)``. The query holds the fields:

- ``size`` (default 1000) and ``seed`` (default 0): the training split;
- ``eval_size`` (default 200): the held-out split's size before deduplication;
- ``instruction`` (default ``default``): the answer-format instruction put before each question, a
  key of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``direct``, ``simple``, ``DeepSeekZero``:
  each asks for the answer between ``<answer>`` tags, which ``proximal.rewards:reasoning_gym``
  reads) or ``none`` (the bare question);
- any other key: a field of the generator's config (``min_terms=2``); with several generators,
  ``NAME.field=value``. Values are read as JSON (``3``, ``0.5``, ``true``, ``[1,2]``), else as text.

**Splits.** ``train`` (the default, ``data.split: null``) is items 0 .. size-1 at ``seed``. ``test`` is
``eval_size`` items at the held-out seed ``seed + size + G`` (G: the number of generators), less
every item whose question text also occurs in the training split or earlier in the held-out one.
reasoning-gym seeds item i with ``Random(seed + i)`` (and a mixture's k-th generator with
``seed + k + 1``), so a set made "with the next seed" is the training set shifted by one item; the
held-out seed starts past every seed the training split used, and the questions are compared besides
(two seeds can draw the same expression). How many were dropped is said in one line.

Each row is ``{prompt, answer, metadata, generator_config?}``: the instruction and question, the
generator's gold answer, its metadata (``source_dataset`` names the generator; JSON-able: tuples
become lists) and, where the row's generator was given fields, those fields, so that
``proximal.rewards:reasoning_gym`` scores it with that generator's own ``score_answer``. Needs the
``reasoning`` extra: ``pip install 'proximal-rlhf[reasoning]'``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from proximal.data.jsonl import DataError

SCHEME = "reasoning-gym://"
INSTALL = "pip install 'proximal-rlhf[reasoning]'"
SPLITS = ("train", "test")
DEFAULTS = {"size": 1000, "seed": 0, "eval_size": 200, "instruction": "default"}


@dataclass(frozen=True)
class GymSource:
    """A parsed ``reasoning-gym://`` URL (module docstring)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    configs: dict[str, dict[str, Any]] = field(hash=False)  # generator → its given fields
    size: int = 1000
    seed: int = 0
    eval_size: int = 200
    instruction: str = "default"

    def held_out_seed(self) -> int:
        """The first seed of the ``test`` split: past every seed the training split used."""
        return self.seed + self.size + len(self.names)


def is_gym_source(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def parse(url: str) -> GymSource:
    """The source a ``reasoning-gym://`` URL names; DataError naming the URL and the part that is
    wrong (an unknown generator or config field, a bad size, seed or weight, a missing package)."""
    try:
        # lazy: reasoning-gym is the optional `reasoning` extra, only a reasoning-gym source needs it
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS  # lazy: as the line above
    except ModuleNotFoundError as e:
        raise DataError(
            f"{url}: a reasoning-gym source needs reasoning-gym (module {e.name!r} is not "
            f"installed): {INSTALL}"
        ) from None
    parts = urlsplit(url)
    names = tuple(n.strip() for n in (parts.netloc + parts.path).split(",") if n.strip())
    if not names:
        raise DataError(f"{url}: no generator named (e.g. {SCHEME}chain_sum)")
    for n in names:
        if n not in DATASETS:
            close = sorted(d for d in DATASETS if n.split("_")[0] in d)[:5]
            raise DataError(
                f"{url}: {n!r} is not a reasoning-gym generator (the installed reasoning-gym "
                f"registers {len(DATASETS)}"
                + (f"; close: {', '.join(close)}" if close else "")
                + ")"
            )
    if len(set(names)) != len(names):
        raise DataError(f"{url}: a generator is named twice")
    # split by hand, not parse_qsl: its '+' means a space, and '+' is an operator (operators=["+"])
    query = [
        (unquote(k), unquote(v))
        for k, _, v in (p.partition("=") for p in parts.query.split("&") if p)
    ]
    values: dict[str, Any] = dict(DEFAULTS)
    configs: dict[str, dict[str, Any]] = {n: {} for n in names}
    weights: tuple[float, ...] = (1.0,) * len(names)
    for key, raw in query:
        value = _value(raw)
        if key in ("size", "seed", "eval_size"):
            low = 0 if key == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DataError(f"{url}: {key}={raw} must be an integer ≥ {low}")
            values[key] = value
        elif key == "instruction":
            if raw != "none" and raw not in SYSTEM_PROMPTS:
                raise DataError(
                    f"{url}: instruction={raw} is none or a key of reasoning-gym's SYSTEM_PROMPTS "
                    f"({', '.join(SYSTEM_PROMPTS)})"
                )
            values[key] = raw
        elif key == "weights":
            try:
                weights = tuple(float(w) for w in raw.split(","))
            except ValueError:
                weights = ()
            if len(weights) != len(names) or not all(w > 0 for w in weights):
                raise DataError(
                    f"{url}: weights={raw} must be {len(names)} positive number(s), one per "
                    f"generator ({', '.join(names)})"
                )
        else:
            name, dot, fld = key.rpartition(".")
            if not dot:
                if len(names) > 1:
                    raise DataError(
                        f"{url}: {key}={raw}: with several generators a config field is "
                        f"NAME.{key} (one of {', '.join(names)})"
                    )
                name = names[0]
            if name not in configs:
                raise DataError(f"{url}: {key}={raw}: {name!r} is not one of {', '.join(names)}")
            allowed = [f.name for f in dataclasses.fields(DATASETS[name][1])]
            allowed = [f for f in allowed if f not in ("seed", "size")]
            if fld not in allowed:
                raise DataError(
                    f"{url}: {key}={raw}: {name} has no config field {fld!r} (its fields: "
                    f"{', '.join(allowed)}; size and seed are the source's own)"
                )
            configs[name][fld] = value
    src = GymSource(names, weights, configs, **values)
    for n in names:  # the generator's own checks (min ≤ max, ...), now rather than mid-run
        try:
            _dataset(n, src.configs[n], 1, 0)
        except (AssertionError, ValueError, TypeError) as e:
            raise DataError(f"{url}: {n} rejects its config {configs[n]}: {e}") from None
    return src


def problem(url: str, field_name: str) -> str | None:
    """A config problem of a ``reasoning-gym://`` source (:func:`parse`'s message), else None."""
    try:
        parse(url)
    except DataError as e:
        return f"{field_name}: {e}"
    return None


def rows(url: str, split: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of split ``split`` (None = train) of the source ``url`` names."""
    src = parse(url)
    split = split or "train"
    if split not in SPLITS:
        raise DataError(f"{url}: no split {split!r} (a reasoning-gym source has train and test)")
    if split == "train":
        for i, entry in enumerate(entries(src, src.seed, src.size)):
            yield f"{url}[train][row {i}]", to_row(src, entry)
        return
    train = {question_hash(e["question"]) for e in entries(src, src.seed, src.size)}
    kept: list[dict] = []
    kept_hashes: set[str] = set()
    in_train = repeated = 0
    for entry in entries(src, src.held_out_seed(), src.eval_size):
        h = question_hash(entry["question"])
        if h in train:
            in_train += 1
        elif h in kept_hashes:
            repeated += 1
        else:
            kept_hashes.add(h)
            kept.append(entry)
    if in_train or repeated:
        _say(
            f"{url} [test]: {len(kept)} held-out questions kept of {src.eval_size} (seed "
            f"{src.held_out_seed()}): {in_train} also in the training split and {repeated} "
            "repeated were dropped"
        )
    if not kept:
        raise DataError(
            f"{url}: every held-out question also occurs in the training split; widen the "
            "generator's config or lower size"
        )
    for i, entry in enumerate(kept):
        yield f"{url}[test][row {i}]", to_row(src, entry)


def entries(src: GymSource, seed: int, size: int) -> list[dict]:
    """reasoning-gym's own entries: ``create_dataset(name, seed=, size=, **config)``'s, or for
    several generators its ``CompositeDataset``'s."""
    if len(src.names) == 1:
        name = src.names[0]
        return list(_dataset(name, src.configs[name], size, seed))
    # lazy: reasoning-gym is the optional `reasoning` extra (parse has checked it is installed)
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [
        DatasetSpec(name=n, weight=w, config=dict(src.configs[n]))
        for n, w in zip(src.names, src.weights)
    ]
    return list(CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs)))


def to_row(src: GymSource, entry: dict) -> dict[str, Any]:
    """A prompt row of an entry: the instruction and question, answer, metadata, config."""
    # lazy: reasoning-gym is the optional `reasoning` extra (parse has checked it is installed)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    meta = json.loads(json.dumps(entry["metadata"], default=str))  # tuples -> lists
    name = meta.get("source_dataset", src.names[0])
    prompt = entry["question"]
    if src.instruction != "none":
        prompt = SYSTEM_PROMPTS[src.instruction].strip() + "\n\n" + prompt
    row = {"prompt": prompt, "answer": str(entry["answer"]), "metadata": meta}
    if src.configs.get(name):
        row["generator_config"] = dict(src.configs[name])
    return row


def question_hash(question: str) -> str:
    """The content key of a question: SHA-256 of its text, whitespace at the ends stripped."""
    return hashlib.sha256(question.strip().encode()).hexdigest()


def _dataset(name: str, config: dict, size: int, seed: int):
    # lazy: reasoning-gym is the optional `reasoning` extra (parse has checked it is installed)
    from reasoning_gym import create_dataset

    return create_dataset(name, size=size, seed=seed, **config)


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _say(line: str) -> None:
    """One line to stderr, from the first process only (every process reads the same rows)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
