"""The docs stay true to the code: every config field of ``sft``, ``rm`` and ``ppo`` is in its page's
tables with its current default, every relative link between pages resolves (to a file, and to a
heading of it when it names one), and no page cites the design document users never see.

Defaults are written in the tables as Python values in backticks (``repr``, with ``null`` for None and
``true``/``false`` for booleans) — the same rendering as the table generator used for the pages —
so changing a default in the code without changing its page fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proximal.compare import CompareConfig
from proximal.config import describe
from proximal.trainers.ppo import PPOConfig
from proximal.trainers.reward import RMConfig
from proximal.trainers.sft import SFTConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = {
    "sft": (SFTConfig, "sft.md"),
    "rm": (RMConfig, "rm.md"),
    "ppo": (PPOConfig, "ppo.md"),
    "compare": (CompareConfig, "compare.md"),
}


def render_default(value) -> str:
    """A default as the tables write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def table_rows(text: str) -> dict[str, list[str]]:
    """``{first cell: [the row's lines]}`` for every markdown table row of ``text``."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("|"):
            first = line.strip().strip("|").split("|")[0].strip()
            rows.setdefault(first, []).append(line)
    return rows


@pytest.mark.parametrize("command", sorted(PAGES))
def test_every_field_is_in_its_page_with_its_current_default(command):
    cls, page = PAGES[command]
    rows = table_rows((DOCS / page).read_text())
    missing, wrong_default = [], []
    for name, _type, default, _help in describe(cls):
        lines = rows.get(f"`{name}`")
        if not lines:
            missing.append(name)
        elif not any(f"`{render_default(default)}`" in line for line in lines):
            wrong_default.append(f"{name} (default now `{render_default(default)}`)")
    assert not missing, f"docs/{page} has no table row for: {', '.join(missing)}"
    assert not wrong_default, (
        f"docs/{page}: the row does not show the current default of: {', '.join(wrong_default)}"
    )


def test_the_check_catches_a_changed_default():
    rows = table_rows("| `optim.lr` | float | `1e-05` | Peak AdamW learning rate. | advice |\n")
    assert any("`1e-05`" in line for line in rows["`optim.lr`"])
    assert not any(f"`{render_default(2e-5)}`" in line for line in rows["`optim.lr`"])
    assert [render_default(v) for v in (None, True, "x", 0.0, [])] == [
        "null",
        "true",
        "'x'",
        "0.0",
        "[]",
    ]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def without_code(text: str) -> str:
    """``text`` without code blocks, math blocks and inline code (what they hold is not markdown)."""
    for pattern in (r"```.*?```", r"\$\$.*?\$\$", r"`[^`\n]*`"):
        text = re.sub(pattern, "", text, flags=re.S)
    return text


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped (hyphens and
    underscores kept), spaces to hyphens, ``-1``, ``-2`` … for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        m = re.match(r"#{1,6} +(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_rule_matches_github():
    assert anchors(
        "## Run directory and `--resume`\n## Metrics (`metrics.jsonl`)\n## A\n## A\n"
    ) == {"run-directory-and---resume", "metrics-metricsjsonl", "a", "a-1"}


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_point_to_existing_files(page):
    text = (DOCS / page).read_text()
    broken = []
    for target in LINK.findall(without_code(text)):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = DOCS / path if path else DOCS / page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"docs/{page} has broken links: {broken}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_no_page_cites_the_design_document(page):
    text = (DOCS / page).read_text()
    hits = [m.group(0) for m in re.finditer(r"seed(?:'s|’s)?\s*\(?§", text)]
    assert not hits, (
        f"docs/{page} cites the design document (a § of it): {hits[:5]}; cite the paper or docs/formulas.md"
    )


def test_errors_page_names_every_exception_of_the_exit_code_map():
    """docs/errors.md lists every user-facing error; each exception class the one exit-code map
    turns into a status (``proximal.train.command``) is named there, with that status."""
    from proximal.train.command import EXIT_TRAINING, EXIT_USER, TRAINING_ERRORS, USER_ERRORS

    text = (DOCS / "errors.md").read_text()
    missing = [
        cls.__name__ for cls in USER_ERRORS + TRAINING_ERRORS if f"`{cls.__name__}`" not in text
    ]
    assert not missing, f"docs/errors.md does not name {missing}; add them to its exit-status table"
    table = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if re.match(r"\| \d+ \|", line)
    }
    for status, classes in ((EXIT_USER, USER_ERRORS), (EXIT_TRAINING, TRAINING_ERRORS)):
        row = table.get(str(status), "")
        assert all(f"`{c.__name__}`" in row for c in classes), (
            f"exit status {status}'s row must name {classes}"
        )
