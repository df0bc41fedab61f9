"""The declared layer order of ``specdec_rt`` (docs/architecture.md), enforced on every import.

Each layer may import its own modules and the layers below it, never a layer above, and never a
peer on the same rung (``drafters`` and ``ort`` know nothing of each other). Function-level
imports count: they tie two modules together as much as top-level ones. The graph comes from
tests/test_imports.py (read from the source, so nothing is imported here).
"""

from __future__ import annotations

import pytest
from test_imports import import_graph

# Lowest first. A unit is a subpackage (``sampling`` = specdec_rt/sampling/) or a root module.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "logs", "manifest_schema"),  # manifest_schema: shared with the exporter, imports nothing
    ("checks",),
    ("sampling",),
    ("types", "text"),
    ("policy", "kvcache"),
    ("request",),
    ("speculation",),
    ("spec",),  # the deprecated alias of speculation and request
    ("batching",),
    ("drafters", "ort"),
    ("engine",),
    ("serve",),
    ("tooling",),
    ("cli", "testing"),
    ("__main__", ""),  # "" is specdec_rt/__init__: the public API
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# Above ort, only these modules may import it (the engine's factory builds the models; the public
# API re-exports the backend's classes; the tools measure the backend itself).
ORT_USERS = ("specdec_rt.engine.factory", "specdec_rt", "specdec_rt.tooling", "specdec_rt.cli")


def may_use_ort(module: str) -> bool:
    return (
        any(module == user or module.startswith(user + ".") for user in ORT_USERS if user != "specdec_rt")
        or module == "specdec_rt"
    )


def unit_of(module: str) -> str | None:
    """``specdec_rt.speculation.scheduler`` -> ``spec``; ``specdec_rt`` -> ``""``; other packages: None."""
    if module == "specdec_rt":
        return ""
    if not module.startswith("specdec_rt."):
        return None
    return module.split(".")[1]


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for mod, imported in sorted(graph.items()):
        me = unit_of(mod)
        if me is None:
            continue
        if me not in RANK:
            found.append(f"{mod}: {me!r} is in no declared layer (add it to LAYERS and docs/architecture.md)")
            continue
        for dep in sorted(imported):
            other = unit_of(dep)
            if other is None:
                if dep.split(".")[0] == "export" and mod != "specdec_rt.engine.loading":
                    found.append(f"{mod} imports the exporter ({dep})")
                continue
            if other == me:
                continue
            if RANK.get(other, -1) >= RANK[me]:
                found.append(f"{mod} ({me}, layer {RANK[me]}) imports {dep} ({other}, layer {RANK.get(other)})")
            elif other == "ort" and RANK[me] > RANK["ort"] and not may_use_ort(mod):
                found.append(f"{mod} imports the ONNX Runtime backend ({dep}); only the engine's factory may")
    return found


def test_every_import_points_down_the_layers():
    assert violations(import_graph()) == []


def test_every_subpackage_is_in_a_layer():
    units = {unit_of(m) for m in import_graph()} - {None}
    assert units <= set(RANK), sorted(units - set(RANK))


@pytest.mark.parametrize(
    ("graph", "why"),
    [
        ({"specdec_rt.sampling.tree": {"specdec_rt.speculation.context"}}, "imports"),  # up
        ({"specdec_rt.drafters.ngram": {"specdec_rt.ort.model"}}, "imports"),  # a peer
        ({"specdec_rt.serve.app": {"specdec_rt.ort.model"}}, "only the engine's factory"),  # ort from above
        ({"specdec_rt.newthing.x": set()}, "no declared layer"),
        ({"specdec_rt.ort.model": {"export.graph"}}, "the exporter"),
    ],
)
def test_the_checker_catches(graph, why):
    found = violations(graph)
    assert len(found) == 1 and why in found[0], found


def test_the_checker_allows_downward_imports():
    assert (
        violations(
            {
                "specdec_rt.engine.factory": {"specdec_rt.ort.model", "specdec_rt.speculation.protocols"},
                "specdec_rt.speculation.scheduler": {"specdec_rt.policy.acceptance", "specdec_rt.errors"},
                "specdec_rt": {"specdec_rt.engine"},
            }
        )
        == []
    )


def test_root_holds_few_modules():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "specdec_rt"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= 12, modules


def exporter_violations(graph: dict[str, set[str]]) -> list[str]:
    """The exporter shares two torch-free modules with the runtime, each importing nothing of it:
    the manifest schema and the rule of which drafts may serve a target (text.vocab_match); its
    validation step (export.validate) also runs the export through the runtime's ONNX Runtime
    backend. ``export.draft`` (train-draft) evaluates a draft by running the scheduler, so it may
    use the runtime's public parts."""
    found = []
    for mod, imported in sorted(graph.items()):
        if not mod.startswith("export.") or mod.startswith("export.draft"):
            continue
        allowed = {"specdec_rt.manifest_schema", "specdec_rt.text.vocab_match"}
        if mod == "export.validate":
            allowed |= {"specdec_rt.errors", "specdec_rt.ort"}
        for dep in sorted(imported):
            if (
                dep.startswith("specdec_rt")
                and dep not in allowed
                and not ("specdec_rt.ort" in allowed and dep.startswith("specdec_rt.ort."))
            ):
                found.append(
                    f"{mod} imports {dep} (the exporter shares only the manifest schema and the vocabulary rule)"
                )
    return found


def test_the_exporter_shares_only_the_manifest_schema():
    graph = import_graph()
    assert exporter_violations(graph) == []
    for shared in ("specdec_rt.manifest_schema", "specdec_rt.text.vocab_match"):
        assert {d for d in graph[shared] if d.startswith("specdec_rt")} == set(), shared
    assert exporter_violations({"export.graph": {"specdec_rt.text.codec"}}) != []  # the checker bites
    assert exporter_violations({"export.validate": {"specdec_rt.ort.model"}}) == []


def test_the_graph_sees_imports_by_string(tmp_path):
    """``importlib.import_module("specdec_rt.engine")`` ties two modules as an import does."""
    import ast

    from test_imports import _dynamic_import

    calls = [
        'importlib.import_module("specdec_rt.engine.factory")',
        '__import__("specdec_rt.engine")',
        'import_module(".engine", __name__)',
    ]
    found = [_dynamic_import(ast.parse(c).body[0].value) for c in calls]  # type: ignore[attr-defined]
    assert found == ["specdec_rt.engine.factory", "specdec_rt.engine", None]
