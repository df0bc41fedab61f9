"""The corpus stage of `train-draft`: sources with licences, windows, the benchmark-overlap
filter, and teacher-forced shards equal to what the data stage computes for the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from export.draft import corpus as C

pytestmark = pytest.mark.export

MIT_META = "Metadata-Version: 2.1\nName: goodpkg\nLicense: MIT\n\n" + "Goodpkg parses things. " * 20
GPL_META = "Metadata-Version: 2.1\nName: gplpkg\nClassifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)\n\n" + "Gplpkg text. " * 20  # fmt: skip
BENCH = "The lighthouse keeper wrote three lines in a ledger every evening."


def _encode(text: str) -> list[int]:
    """Words as tokens (a stable id per word), so n-grams are word n-grams."""
    return [sum(w.encode()) % 997 + 3 for w in text.split()]


def _roots(tmp: Path) -> C.CorpusRoots:
    site, lib, lic = tmp / "site", tmp / "lib", tmp / "licenses"
    for name, meta in (("goodpkg", MIT_META), ("gplpkg", GPL_META)):
        dist = site / f"{name}-1.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(meta)
        (site / name).mkdir()
        doc = f"The {name} module computes a result from its arguments and returns it unchanged. " * 3
        (site / name / "core.py").write_text(f'"""{doc}"""\n\ndef f():\n    """{doc}"""\n')
        (dist / "RECORD").write_text(f"{name}/core.py,,\n{name}-1.0.dist-info/METADATA,,\n")
    lib.mkdir()
    (lib / "plain.py").write_text("# " + " ".join(f"word{i}" for i in range(300)) + "\n")
    (lib / "leaky.py").write_text("# some words before. " + BENCH + " and more words after it " * 10 + "\n")
    (lib / "copy.py").write_text((lib / "plain.py").read_text())  # an exact duplicate
    (lib / "test").mkdir()
    (lib / "test" / "t.py").write_text("# a test file, left out " * 50)
    lic.mkdir()
    (lic / "MIT").write_text("Permission is hereby granted, free of charge, to any person " * 10)
    return C.CorpusRoots(stdlib=lib, site_packages=site, man=tmp / "man", doc=tmp / "doc", common_licenses=lic)


def test_corpus_sources_licences_dedupe_and_overlap_filter(tmp_path):
    roots = _roots(tmp_path)
    spec = C.CorpusSpec(sources=("python-stdlib", "python-docs", "licenses"), window=64)
    corpus = C.build_corpus(spec, _encode, roots=roots, benchmark=[BENCH])
    stats = {s.name: s for s in corpus.stats}
    std = stats["python-stdlib"]
    assert std.licence == "PSF-2.0" and std.files == 3  # test/ left out
    assert std.duplicates >= 1 and std.benchmark_overlap == 1
    docs = stats["python-docs"]
    assert set(docs.licences) == {"MIT"} and docs.files == 2  # README + docstrings of goodpkg
    assert any("not permissive" in k for k in docs.skipped)  # the GPL package is not read
    assert stats["licenses"].files == 1 and stats["licenses"].tokens > 0
    assert len(corpus) == sum(s.windows for s in corpus.stats)
    assert corpus.tokens.size == sum(s.tokens for s in corpus.stats)
    grams = C.overlap_ngrams([BENCH], _encode)
    for i in range(len(corpus)):
        win = corpus.window(i).tolist()
        assert len(win) <= 64
        assert not any(tuple(win[j : j + 8]) in grams for j in range(len(win) - 7))
    assert len({corpus.window(i).tobytes() for i in range(len(corpus))}) == len(corpus)
    assert {int(s) for s in corpus.source} == {0, 1, 2}
    # saved and loaded unchanged
    C.save_corpus(tmp_path / "c", corpus)
    again = C.load_corpus(tmp_path / "c")
    assert again is not None and np.array_equal(again.tokens, corpus.tokens) and again.stats == corpus.stats


def test_overlap_needs_a_whole_ngram():
    grams = C.overlap_ngrams([BENCH], _encode)
    words = BENCH.split()
    assert C._overlaps(_encode("x y " + " ".join(words[:8]) + " z"), grams)
    assert not C._overlaps(_encode("x y " + " ".join(words[:7]) + " z " + " ".join(words[8:])), grams)


def test_benchmark_texts_are_the_shipped_prompt_sets():
    texts = C.benchmark_texts()
    import importlib.resources

    first = importlib.resources.files("specdec_rt.tooling.data").joinpath("chat_general.jsonl").read_text()
    assert json.loads(first.splitlines()[0])["messages"][0]["content"] in texts
    assert len(texts) >= 60


def test_licence_rules_and_sources():
    assert C.is_permissive("MIT") and C.is_permissive("BSD License") and C.is_permissive("Apache-2.0")
    assert not C.is_permissive("GPLv3") and not C.is_permissive("MPL-2.0 AND MIT") and not C.is_permissive("")
    assert C.package_licence("Name: x\nClassifier: License :: OSI Approved :: MIT License\n\nbody") == "MIT License"
    assert C.parse_sources("all") == list(C.SOURCES)
    from export.errors import UsageError

    with pytest.raises(UsageError, match="nope"):
        C.parse_sources("man,nope")
    assert "NAME" in C.roff_to_text('.TH LS 1\n.SH NAME\n\\fBls\\fR \\- list\n.\\" a comment\n')
    assert "comment" not in C.roff_to_text('.TH LS 1\n.\\" a comment\n')


def test_teacher_forced_shards_equal_the_data_stage(tiny_llama, tmp_path):
    import torch

    from export.draft.data import _generate_batch, load_shards
    from export.draft.run import TrainDraftRequest, _load_torch, _target_dirs
    from export.ui import Reporter

    torch.set_num_threads(1)
    _, source = _target_dirs(TrainDraftRequest(target=str(tiny_llama)), Reporter(quiet=True))
    model = _load_torch(source)
    rng = np.random.default_rng(0)
    windows = [rng.integers(3, 200, n).astype(np.int32) for n in (40, 17, 40, 33, 9)]
    lengths = np.array([0] + [len(w) for w in windows])
    corpus = C.Corpus(tokens=np.concatenate(windows), starts=np.cumsum(lengths), source=np.zeros(5, np.int32), stats=[])
    data = tmp_path / "data"
    have = C.corpus_shards(model, corpus, data, per_shard=2, positions_goal=10**9, deadline=None, log=lambda s: None)
    assert have == corpus.positions == sum(len(w) - 1 for w in windows)
    shards = load_shards(data)
    assert len(shards) == 3
    seqs = [s for sh in shards for s in sh.sequences()]
    for win, (tok, plen, feats, ids, probs) in zip(windows, seqs):
        assert np.array_equal(tok, win) and plen == 1  # every predicted position trains
        # the data stage on the same tokens as a prompt: its rows 0..T-2 are the prompt's positions
        ref = _generate_batch(model, [win.tolist()], 1, {0}, topk=8)
        n = len(win) - 1
        np.testing.assert_allclose(feats.astype(np.float32), ref.feats[:n].astype(np.float32), atol=2e-3, rtol=2e-3)
        assert np.array_equal(ids, ref.topk_ids[:n])
        np.testing.assert_allclose(probs.astype(np.float32), ref.topk_p[:n].astype(np.float32), atol=2e-3)
    # resume: a missing shard is rebuilt identically, the others are kept
    before = (data / "shard-00001.npz").read_bytes()
    (data / "shard-00001.npz").unlink()
    C.corpus_shards(model, corpus, data, per_shard=2, positions_goal=10**9, deadline=None, log=lambda s: None)
    after = load_shards(data)[1]
    with np.load(data / "shard-00001.npz") as z:
        assert np.array_equal(z["feats"], shards[1].feats) and np.array_equal(z["topk_ids"], shards[1].topk_ids)
    assert after.answer_tokens == shards[1].answer_tokens and len(before) > 0


def test_train_draft_with_a_corpus_end_to_end(tiny_llama, tmp_path, monkeypatch):
    from export.cli import main

    roots = _roots(tmp_path / "roots")
    monkeypatch.setattr(C, "CorpusRoots", lambda: roots)
    args = ["train-draft", "--target", str(tiny_llama), "--out", str(tmp_path / "run"), "--tokens", "600"]
    args += ["--prompts", "64", "--batch", "32", "--max-new", "16", "--val-prompts", "32", "--epochs", "1"]
    args += ["--eval-prompts", "2", "--threads", "1", "--vocab-size", "200", "-q"]
    corpus = ["--corpus", "python-stdlib,python-docs,licenses", "--corpus-tokens", "400", "--corpus-window", "48"]
    assert main([*args, *corpus, "--time-budget", "0"]) == 3  # stopped during answer data
    assert main([*args, *corpus[:2], "--corpus-window", "40", "--resume"]) == 2  # corpus settings are fixed
    assert main([*args, *corpus, "--resume"]) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "done" and report["acceptance"]["exact"]
    got = {s["name"]: s for s in report["corpus"]["sources"]}
    assert got["python-docs"]["licences"] == {"MIT": 2} and got["python-stdlib"]["licence"] == "PSF-2.0"
    assert 400 <= report["corpus"]["positions_used"] <= report["corpus"]["positions_available"]


def test_long_documents_are_encoded_in_pieces():
    text = "".join(f"line {i} of a long file\n" for i in range(5000))
    calls = []

    def encode(piece: str) -> list[int]:
        calls.append(len(piece))
        return _encode(piece)

    assert C.encode_long(encode, text, piece=1000) == _encode(text)
    assert max(calls) <= 1000 and len(calls) > 10
    assert C.encode_long(_encode, "x" * 2500, piece=1000) == _encode("x" * 1000) * 2 + _encode("x" * 500)
