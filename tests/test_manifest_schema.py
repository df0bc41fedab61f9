"""One manifest schema (issue 34, item 5): ``specdec_rt.manifest_schema`` defines every constant
the exporter and the runtime agree on, nothing else defines one, it imports nothing, and what the
exporter writes the runtime reads."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_rt import manifest_schema as schema
from specdec_rt.errors import ModelLoadError

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "specdec_rt" / "manifest_schema.py"


def _sources():
    for pkg in ("specdec_rt", "export"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def assigned_names(tree: ast.AST) -> list[tuple[str, int]]:
    """``(name, line)`` of every plain name bound by an assignment anywhere in ``tree``."""
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    found.append((sub.id, node.lineno))
    return found


def redefinitions() -> list[str]:
    """Assignments to a schema constant's name outside the schema module."""
    names = set(schema.__all__)
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _sources()
        if path != SCHEMA_FILE
        for name, line in assigned_names(ast.parse(path.read_text()))
        if name in names
    ]


def test_each_schema_constant_is_defined_once():
    assert redefinitions() == []
    own = [name for name, _ in assigned_names(ast.parse(SCHEMA_FILE.read_text())) if name in schema.__all__]
    assert sorted(own) == sorted(schema.__all__)  # each once, here


def test_the_scan_sees_a_second_definition():
    tree = ast.parse("MAX_MANIFEST_BYTES = 1 << 20\nclass A:\n    SCHEMA_VERSION: int = 2\n")
    assert [n for n, _ in assigned_names(tree)] == ["MAX_MANIFEST_BYTES", "SCHEMA_VERSION"]


def test_the_schema_imports_nothing():
    """A leaf: the exporter reads it without the ONNX Runtime backend, torch or numpy."""
    imports = [n for n in ast.walk(ast.parse(SCHEMA_FILE.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [getattr(n, "module", None) for n in imports] == ["__future__"]
    code = (
        "import sys; import specdec_rt.manifest_schema; "
        "print(sorted(m for m in ('onnxruntime', 'torch', 'specdec_rt.ort') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_exporter_shares_only_the_schema_with_the_runtime():
    """Module-level imports of ``specdec_rt`` in ``export/``: the schema and the rule of which
    drafts may serve a target, alone (validation and the draft trainer's evaluation go through the
    runtime inside functions)."""
    shared = set()
    for path in sorted((ROOT / "export").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec_rt"):
                shared.add(node.module)
            elif isinstance(node, ast.Import):
                shared |= {a.name for a in node.names if a.name.startswith("specdec_rt")}
    assert shared == {"specdec_rt.manifest_schema", "specdec_rt.text.vocab_match"}


def test_text_tags_are_the_tool_call_tags():
    from specdec_rt.text.codec import TEXT_TAGS
    from specdec_rt.text.tools import CALL_CLOSE, CALL_OPEN

    assert TEXT_TAGS is schema.TEXT_TAGS and schema.TEXT_TAGS == {CALL_OPEN, CALL_CLOSE}


def test_the_size_limit_holds_a_template_at_its_bound():
    """The one size limit fits the largest legitimate manifest: a chat template of
    ``MAX_TEMPLATE_CHARS`` control characters (6 bytes each in JSON) plus the rest."""
    worst = json.dumps({"tokenizer": {"chat_template": "\x01" * schema.MAX_TEMPLATE_CHARS}})
    assert len(worst.encode()) + (64 << 10) <= schema.MAX_MANIFEST_BYTES


@pytest.mark.export
def test_the_exporter_writes_and_the_runtime_reads_the_current_version(tiny_llama, tmp_path):
    from specdec_rt.ort.manifest import load_manifest

    written = json.loads((tiny_llama / schema.MANIFEST).read_text())
    assert written["schema_version"] == schema.SCHEMA_VERSION
    assert load_manifest(tiny_llama, verify_hashes="never").raw["schema_version"] == schema.SCHEMA_VERSION
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("draft-*"))
    for version in (schema.SCHEMA_VERSION + 1, schema.SCHEMA_VERSION - 1, "1", None):
        (folder / schema.MANIFEST).write_text(json.dumps({**written, "drafts": [], "schema_version": version}))
        with pytest.raises(
            ModelLoadError, match=f"schema_version {version!r}, this runtime reads {schema.SCHEMA_VERSION}"
        ):
            load_manifest(folder, verify_hashes="never")
