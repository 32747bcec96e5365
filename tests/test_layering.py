"""The package's imports run one way (docs/architecture.md): each part of ``proximal`` imports only
from itself and from the layers below it, no two modules import each other (directly or around a
loop), and an import inside a function says why it is there (``# lazy: ...``).

The imports are read from the source (every ``import`` statement, at module level or inside a
function; those under ``if TYPE_CHECKING:`` are only for annotations and are skipped), so a lazy
import that breaks the layering fails here even if no test ever runs that function.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "proximal"

#: Each part of the package (a subpackage, or a top-level module) and its layer. A part may import
#: parts of lower layers only; two parts of one layer are independent of each other.
LAYERS: dict[str, int] = {
    # the foundation: pure math, the config machinery, the process group, the run's logs
    "proximal": 0,  # the package's own __init__: the version; the API's names, imported lazily
    "core": 0,
    "config": 0,
    "dist": 0,
    "logging": 0,
    "commands": 0,  # the one table of commands: names and module paths, as strings
    # data and models, independent of each other
    "data": 1,
    "models": 1,
    "specs": 1,  # import_spec: the one import path of user code (needs config's ConfigError)
    "rewards": 1,  # the field's reward functions (TRL's names), so that tasks and rollout can use them
    # what is built from them: rollouts, and the built-in tasks with their gold scores
    "rollout": 2,
    "tasks": 2,
    # what every trainer shares; multi-turn rollouts (environments, tools), built on rollout
    "train": 3,
    "agents": 3,
    # evaluations a trainer may run (so they never import a trainer)
    "evaluation": 4,
    "trainers": 5,
    # the methods as the comparison and the demo see them; the training commands as Python functions
    "methods": 6,
    "api": 6,
    # the applications
    "report": 7,
    "compare_report": 7,
    "memory": 7,
    "demo": 8,
    "compare": 9,
    "cli": 10,
    "__main__": 11,
}


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every import in the file; ``from X import
    name`` names the submodule ``X.name`` when there is one."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    where = root.parent / Path(*sub.split("."))
                    is_module = where.with_suffix(".py").exists() or where.is_dir()
                    found.append((sub if is_module else base, child.lineno, in_function))
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or is_function)

    visit(ast.parse(path.read_text()), False)
    return found


def _sources(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """Every import of a part from a part of the same or a higher layer, as ``file:line ...``."""
    wrong = []
    for path in _sources(root):
        here = _part(_module_name(path, root))
        for target, line, _ in _imports(path, root):
            if target.split(".")[0] != "proximal":
                continue
            there = _part(target)
            if there != here and LAYERS[there] >= LAYERS[here]:
                wrong.append(
                    f"{path.relative_to(root.parent)}:{line} imports {target} "
                    f"({here}, layer {LAYERS[here]} -> {there}, layer {LAYERS[there]})"
                )
    return wrong


def import_cycles(root: Path = PACKAGE) -> list[str]:
    """Each loop of modules importing one another, as ``a -> b -> a``."""
    graph = {
        _module_name(p, root): {m for m, _, _ in _imports(p, root) if m.split(".")[0] == "proximal"}
        for p in _sources(root)
    }
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] & graph.keys()):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def silent_lazy_imports(root: Path = PACKAGE) -> list[str]:
    """Imports inside functions without ``# lazy: <why>`` on their line or the line above."""
    silent = set()
    for path in _sources(root):
        lines = path.read_text().splitlines()
        for target, line, in_function in _imports(path, root):
            here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
            if in_function and "# lazy:" not in here and not above.strip().startswith("# lazy:"):
                silent.add(f"{path.relative_to(root.parent)}:{line} imports {target}")
    return sorted(silent)


def test_every_part_has_a_layer():
    parts = {_part(_module_name(p)) for p in _sources(PACKAGE)}
    assert parts == set(LAYERS), (
        "a new package or top-level module: give it a layer in LAYERS and docs/architecture.md"
    )


def test_imports_run_down_the_layers():
    wrong = upward_imports()
    assert not wrong, "imports against the layering (docs/architecture.md):\n" + "\n".join(wrong)


def test_no_import_cycles_between_modules():
    cycles = import_cycles()
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)


def test_an_import_inside_a_function_says_why():
    """Imports sit at the top of a module; one inside a function saves start-up time (``proximal
    --help`` does not load torch, a command loads only its own trainer, optional packages load only
    when asked for) and says so on its line or the line above: ``# lazy: <why>``."""
    silent = silent_lazy_imports()
    assert not silent, "imports inside functions without '# lazy: <why>':\n" + "\n".join(silent)


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the package's sources to plant violations in."""
    root = tmp_path / "proximal"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (
            "from proximal.trainers import ppo\n",
            "imports proximal.trainers.ppo (rollout, layer 2 -> trainers, layer 5)",
        ),
        (
            "import proximal.train.run\n",
            "imports proximal.train.run (rollout, layer 2 -> train, layer 3)",
        ),
        (
            "def f():\n    from ..tasks import digits  # lazy: x\n",
            "(rollout, layer 2 -> tasks, layer 2)",
        ),
    ],
)
def test_an_upward_import_is_found(copy, source, found):
    before = upward_imports(copy)
    (copy / "rollout" / "probe.py").write_text(source)
    (new,) = set(upward_imports(copy)) - set(before)
    assert new.startswith("proximal/rollout/probe.py:") and new.endswith(found)


def test_a_cycle_and_a_silent_lazy_import_are_found(copy):
    cycles, silent = import_cycles(copy), silent_lazy_imports(copy)
    (copy / "models" / "probe_a.py").write_text("from proximal.models import probe_b\n")
    (copy / "models" / "probe_b.py").write_text("def f():\n    from . import probe_a\n")
    assert set(import_cycles(copy)) - set(cycles) == {
        "proximal.models.probe_a -> proximal.models.probe_b -> proximal.models.probe_a"
    }
    assert set(silent_lazy_imports(copy)) - set(silent) == {
        "proximal/models/probe_b.py:2 imports proximal.models.probe_a"
    }
