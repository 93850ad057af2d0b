"""Test selection by what a test needs: the markers ``ray``, ``torch`` and ``slow`` (pyproject.toml).

Test modules declare their marks (``pytestmark = pytest.mark.torch``, or on a test). Doctests are
marked here like the module they are in: ``torch`` or ``ray`` when importing the module (with the
modules it imports at its top level, its packages included) imports that optional dependency, or
when the example imports it itself. A file whose every test a ``-m`` selection leaves out is not
collected at all, so ``pytest -m "not slow and not ray and not torch"`` (``make test-core``, the
core in seconds) imports neither torch nor Ray.
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
OPTIONAL = ("ray", "torch")
MARKS = ("ray", "torch", "slow")
_OURS = {"rlmetrics": ROOT / "src", "tests": ROOT, "examples": ROOT}


@functools.cache
def _top_level(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The modules importing ``path`` imports (top-level statements, ``try``/``if`` bodies,
    ``require("x", ...)`` and ``pytest.importorskip("x")`` calls), and the marks of its ``pytestmark``."""
    names: set[str] = set()
    marks: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.Assign, ast.Expr)):
                for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and n.args):
                    func, arg = ast.unparse(call.func), call.args[0]
                    if func.endswith(("require", "importorskip")) and isinstance(arg, ast.Constant):
                        names.add(str(arg.value))
                targets = getattr(node, "targets", [])
                if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                    text = ast.unparse(node.value)
                    marks.update(m for m in MARKS if f"mark.{m}" in text)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return frozenset(names), frozenset(marks)


def _files(module: str) -> list[Path]:
    """The files importing ``module`` (one of ours) runs: its packages' ``__init__`` and itself."""
    parts = module.split(".")
    base = _OURS[parts[0]]
    out = []
    for i in range(1, len(parts) + 1):
        stem = base.joinpath(*parts[:i])
        if (stem / "__init__.py").exists():
            out.append(stem / "__init__.py")
        elif stem.with_suffix(".py").exists():
            out.append(stem.with_suffix(".py"))
        else:  # an attribute of the module before
            break
    return out


@functools.cache
def needs(path: Path) -> frozenset[str]:
    """The optional dependencies (of :data:`OPTIONAL`) importing the module at ``path`` imports."""
    todo, seen, found = [path], {path}, set()
    for parent in path.parents:  # its packages run first
        if parent in (ROOT, ROOT / "src") or not (parent / "__init__.py").exists():
            break
        todo.append(parent / "__init__.py")
    while todo:
        names, _ = _top_level(todo.pop())
        for name in names:
            top = name.split(".")[0]
            if top in OPTIONAL:
                found.add(top)
            elif top in _OURS:
                new = [p for p in _files(name) if p not in seen]
                seen.update(new)
                todo.extend(new)
    return frozenset(found)


def _marks(path: Path) -> frozenset[str]:
    """The marks every test collected from ``path`` carries."""
    if path.name.startswith("test_"):
        return _top_level(path)[1]
    return needs(path)


def _may_select(markexpr: str, marks: frozenset[str]) -> bool:
    """Whether a test carrying ``marks`` (and maybe other marks of its own) can match ``markexpr``."""
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved it: collect everything, -m still deselects
        return True
    expr = Expression.compile(markexpr)
    others = [m for m in MARKS if m not in marks]
    extras = itertools.chain.from_iterable(itertools.combinations(others, k) for k in range(len(others) + 1))
    return any(expr.evaluate(lambda name, _e=extra, **_: name in marks or name in _e) for extra in extras)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or ROOT not in collection_path.parents:
        return None
    marks = _marks(collection_path)
    return True if marks and not _may_select(markexpr, marks) else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Doctests carry the marks of what their module, or their example, imports."""
    for item in items:
        if not isinstance(item, pytest.DoctestItem):
            continue
        marks = set(needs(Path(item.path)))
        source = "".join(example.source for example in item.dtest.examples)
        marks.update(m for m in OPTIONAL if f"import {m}" in source)
        for mark in sorted(marks):
            item.add_marker(mark)
