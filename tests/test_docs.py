"""The docs stay true to the code: every command's page lists what its ``--help`` lists — each config
field in the page's tables with its current default and no row for a field that is gone, or, for a
command without config fields (``demo``, ``memory``), each option — every relative link between
pages resolves (to a file, and to a heading of it when it names one), and no page cites the design
document users never see.

Defaults are written in the tables as Python values in backticks (``repr``, with ``null`` for None and
``true``/``false`` for booleans) — the same rendering as the table generator used for the pages —
so changing a default in the code without changing its page fails here.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from proximal.cli import COMMANDS, main
from proximal.train.command import EXIT_TRAINING, EXIT_USER, TRAINING_ERRORS, USER_ERRORS

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: The commands whose ``--help`` lists config fields (a command that gains them joins the checks by
#: itself; this set only guards against a ``--help`` format the parser below no longer reads).
CONFIG_COMMANDS = {"sft", "rm", "ppo", "grpo", "dpo", "simpo", "distill", "compare"}


def render_default(value) -> str:
    """A default as the tables write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def table_default(shown: str) -> str:
    """A default as ``--help`` shows it (its ``repr``) → as the tables write it."""
    return {"None": "null", "True": "true", "False": "false"}.get(shown, shown)


def help_text(command: str) -> str:
    """What ``proximal COMMAND --help`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


#: A config field in ``--help``: ``  --section.key (type, default REPR)``.
FIELD = re.compile(r"^  --([\w.]+) \((.+?), default (.*)\)$", re.M)


def help_fields(text: str) -> dict[str, str]:
    """``{dotted name: default as the tables write it}`` for every config field of a ``--help``."""
    return {name: table_default(default) for name, _type, default in FIELD.findall(text)}


def help_options(text: str) -> set[str]:
    """The ``--options`` an argparse ``--help`` names (``--help`` itself left out)."""
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text)) - {"--help"}


def table_rows(text: str) -> dict[str, list[str]]:
    """``{first cell: [the row's lines]}`` for every markdown table row of ``text``."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("|"):
            first = line.strip().strip("|").split("|")[0].strip()
            rows.setdefault(first, []).append(line)
    return rows


def sync_problems(fields: dict[str, str], page_text: str) -> list[str]:
    """What a page's tables get wrong about ``fields`` (``{name: default as written}``): a field with
    no row, a row without the field's default, a row naming a field of one of the command's
    sections that does not exist."""
    rows = table_rows(page_text)
    problems = [f"no table row for {name}" for name in fields if f"`{name}`" not in rows]
    problems += [
        f"the row of {name} does not show its current default `{default}`"
        for name, default in fields.items()
        if f"`{name}`" in rows and not any(f"`{default}`" in line for line in rows[f"`{name}`"])
    ]
    sections = {name.split(".")[0] for name in fields}
    problems += [
        f"a row for {cell}, which is no config field"
        for cell in rows
        if re.fullmatch(r"`\w+\.[\w.]+`", cell)
        and cell.strip("`").split(".")[0] in sections
        and cell.strip("`") not in fields
    ]
    return problems


def test_every_command_has_a_page():
    assert not [c for c in COMMANDS if not (DOCS / f"{c}.md").is_file()]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_page_lists_what_its_command_help_lists(command):
    text = help_text(command)
    assert text.startswith(f"usage: proximal {command}"), text[:200]
    page = DOCS / f"{command}.md"
    fields = help_fields(text)
    assert bool(fields) == (command in CONFIG_COMMANDS), sorted(fields)[:5]
    if fields:
        problems = sync_problems(fields, page.read_text())
        assert not problems, f"docs/{page.name} is out of step with --help: {problems}"
    else:
        said = page.read_text()
        missing = sorted(
            o for o in help_options(text) if not re.search(re.escape(o) + r"(?![\w-])", said)
        )
        assert not missing, f"docs/{page.name} does not mention {missing} of --help"


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
    assert [table_default(repr(v)) for v in (None, True, "x", 0.0, [])] == [
        render_default(v) for v in (None, True, "x", 0.0, [])
    ]


def test_the_check_reads_help_and_catches_each_kind_of_drift():
    text = (
        "config fields (set in the YAML file, or override with --section.key value):\n"
        "  --optim.lr (float, default 1e-05)\n      Peak AdamW learning rate.\n"
        "  --data.eval_file (str or null, default None)\n"
        "  --optim.weights (dict[str, float], default {'a': 1.0})\n"
    )
    fields = help_fields(text)
    assert fields == {"optim.lr": "1e-05", "data.eval_file": "null", "optim.weights": "{'a': 1.0}"}
    page = (
        "| `optim.lr` | float | `1e-05` | rate |\n"
        "| `data.eval_file` | str | `null` | file |\n"
        "| `optim.weights` | dict | `{'a': 1.0}` | weights |\n"
        "| `metrics.jsonl` | file | | not a field: no section of the command |\n"
    )
    assert sync_problems(fields, page) == []
    assert sync_problems(fields, page.replace("`1e-05`", "`2e-05`")) == [
        "the row of optim.lr does not show its current default `1e-05`"
    ]
    assert sync_problems(fields, page.replace("`data.eval_file`", "`data.eval`")) == [
        "no table row for data.eval_file",
        "a row for `data.eval`, which is no config field",
    ]
    assert help_options("usage: x [-h] [--out OUT] [--dry-run]\n  -h, --help") == {
        "--out",
        "--dry-run",
    }


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
def test_no_page_holds_control_characters(page):
    """A LaTeX command written through a Python string unescaped (\\text, \\frac, \\right) turns into
    a tab, form feed or carriage return and breaks the equation."""
    lines = (DOCS / page).read_bytes().split(b"\n")
    found = [(n, line) for n, line in enumerate(lines, 1) if re.search(rb"[\x00-\x1f]", line)]
    assert not found, found


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
