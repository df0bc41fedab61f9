"""No import cycles among the project's modules (``specdec_rt``, ``export``).

The graph is read from the source (AST): every ``import`` / ``from ... import``, including the
ones inside functions, which still tie two modules together. A module's own package
``__init__`` importing it is not an edge here (Python packages work that way), nor is an import
under ``if TYPE_CHECKING:`` (annotations only: no run executes it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec_rt", "export")


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_pkg) in mods.items():
        base = name if is_pkg else name.rpartition(".")[0]
        out = set()
        for node in _run_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    full = ".".join(parts + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                # `from pkg import submodule` imports the submodule; `from mod import name` the module
                out.update(
                    resolve(f"{full}.{a.name}") if f"{full}.{a.name}" in mods else resolve(full) for a in node.names
                )
            elif (dynamic := _dynamic_import(node)) is not None:  # import_module("x.y") / __import__("x.y")
                out.add(resolve(dynamic))
        out.discard(None)
        out.discard(name)
        graph[name] = out
    return graph


def _dynamic_import(node: ast.AST) -> str | None:
    """The absolute module a call ``importlib.import_module("a.b")`` or ``__import__("a.b")``
    names with a string literal (a relative name or a computed one is not resolved here)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    arg = node.args[0]
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return None if arg.value.startswith(".") else arg.value
    return None


def _run_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
    typing_only = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            typing_only.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in typing_only]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_imports():
    g = import_graph()
    assert "specdec_rt.engine.loading" in g["specdec_rt.tooling.demo"]
    assert "specdec_rt.tooling.demo" in g["specdec_rt.cli"]  # imported inside main()
    assert "export.errors" in g["export.draft.cli"]


def test_graph_leaves_out_imports_for_annotations_only():
    g = import_graph()
    assert "specdec_rt.ort.session" in g["specdec_rt.ort.model"]  # the model makes sessions
    # ... and a session's model is an OrtModel, imported under TYPE_CHECKING for its annotations
    assert "specdec_rt.ort.model" not in g["specdec_rt.ort.session"]
    assert "TYPE_CHECKING" in (ROOT / "specdec_rt/ort/session.py").read_text()


def test_no_import_cycles():
    assert cycles(import_graph()) == []
