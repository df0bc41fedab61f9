"""The code's shape, kept: calls that read, short functions, few attribute probes
(CONTRIBUTING.md). Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec_rt", "export")
# array and graph helpers whose long positional signatures are their libraries' own
HELPER_ROOTS = {"np", "numpy", "onnx", "helper", "oh", "torch", "nn", "F"}
MAX_LINES, LONG_LINES, MAX_LONG = 80, 50, 12
MAX_PROBES = 25  # getattr/hasattr lines in specdec_rt: only on objects that are truly foreign


def _trees() -> list[tuple[Path, ast.Module]]:
    files = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    return [(path.relative_to(ROOT), ast.parse(path.read_text(), str(path))) for path in files]


def _root_name(func: ast.expr) -> str | None:
    while isinstance(func, ast.Attribute):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None


def positional_calls(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """Calls passing 6 or more positional arguments, outside the array and graph helpers."""
    found = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _root_name(node.func) not in HELPER_ROOTS:
                count = sum(1 for arg in node.args if not isinstance(arg, ast.Starred))
                if count >= 6:
                    found.append(f"{path}:{node.lineno} {ast.unparse(node.func)}({count} positional)")
    return found


def function_lengths(trees: list[tuple[Path, ast.Module]]) -> dict[str, int]:
    """Every function's length in lines (docstring included), by ``path:line name``."""
    return {
        f"{path}:{node.lineno} {node.name}": (node.end_lineno or node.lineno) - node.lineno + 1
        for path, tree in trees
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


@pytest.fixture(scope="module")
def trees() -> list[tuple[Path, ast.Module]]:
    return _trees()


def test_no_call_passes_six_or_more_positional_arguments(trees):
    assert positional_calls(trees) == []


def test_functions_are_short(trees):
    lengths = function_lengths(trees)
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
    long = sorted((n, name) for name, n in lengths.items() if n > LONG_LINES)
    assert len(long) <= MAX_LONG, long


def test_attribute_probes_are_few():
    lines = [
        line
        for path in (ROOT / "specdec_rt").rglob("*.py")
        for line in path.read_text().splitlines()
        if "getattr(" in line or "hasattr(" in line
    ]
    assert len(lines) <= MAX_PROBES, len(lines)


def test_the_counters_catch_what_they_count():
    tree = ast.parse("def f(a):\n" + "    x = 1\n" * 90 + "    g(1, 2, 3, 4, 5, 6)\n    np.pad(1, 2, 3, 4, 5, 6)\n")
    trees = [(Path("x.py"), tree)]
    assert positional_calls(trees) == ["x.py:92 g(6 positional)"]
    assert function_lengths(trees) == {"x.py:1 f": 93}
