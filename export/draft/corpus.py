"""Corpus for teacher-forced distillation: text already on this machine, read once by the target.

Sources (``--corpus NAME,NAME``; each records its licence, files, bytes and tokens):

    python-stdlib  the Python standard library's ``.py`` sources (PSF-2.0)
    python-docs    installed packages' READMEs (the long description in their ``METADATA``) and the
                   docstrings of their ``.py`` files; only packages whose metadata declares a
                   permissive licence (MIT, BSD, Apache, PSF, ISC, ...) are read
    man            English manual pages (roff markup stripped), licences as their packages'
    doc            README / ``.txt`` / ``.md`` files under ``/usr/share/doc``, licences per package
    licenses       licence texts (``/usr/share/common-licenses`` and packages' licence files)

Documents are tokenised, cut into windows of ``window`` tokens, deduplicated, and every window
sharing a token 8-gram with a benchmark prompt (:func:`benchmark_texts`) is dropped. The windows
of all sources are interleaved (seeded), so any prefix of the corpus mixes every source.

Teacher forcing (:func:`corpus_shards`): the target reads each window once (one forward, the
prefill path), and every position keeps its normalised hidden state and top-k next-token
distribution, in the answer shards' format (:class:`~export.draft.data.Shard`) with a prompt
length of 1, so every predicted position is trainable.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from .data import TOPK, Shard, last_hidden, load_shards, save_shard, shard_path, top_k

__all__ = [
    "SOURCES",
    "CorpusRoots",
    "SourceStats",
    "Corpus",
    "parse_sources",
    "collect_documents",
    "build_corpus",
    "benchmark_texts",
    "overlap_ngrams",
    "corpus_shards",
    "load_corpus",
    "save_corpus",
]

SOURCES = ("python-stdlib", "python-docs", "man", "doc", "licenses")
NGRAM = 8
MIN_WINDOW = 32  # a document's last window shorter than this is dropped
MAX_FILE_BYTES = 400_000
PERMISSIVE = re.compile(
    r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Zlib|Unlicense|CC0|HPND|MIT-CMU|"
    r"Historical Permission|0BSD|Public Domain)\b",
    re.IGNORECASE,
)
COPYLEFT = re.compile(r"\b(GPL|LGPL|AGPL|MPL|Mozilla|EUPL|CDDL|EPL)\b", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class CorpusRoots:
    """Where each source is read from (tests point these at temporary folders)."""

    stdlib: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))
    site_packages: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["purelib"]))
    man: Path = Path("/usr/share/man")
    doc: Path = Path("/usr/share/doc")
    common_licenses: Path = Path("/usr/share/common-licenses")


@dataclass(kw_only=True)
class SourceStats:
    """One source's record in the report: what was read and what survived the filters."""

    name: str
    licence: str
    files: int = 0
    bytes: int = 0
    tokens: int = 0  # tokens of the windows kept
    windows: int = 0
    duplicates: int = 0  # windows dropped as exact duplicates
    benchmark_overlap: int = 0  # windows dropped for sharing an 8-gram with a benchmark prompt
    licences: dict[str, int] = field(default_factory=dict)  # licence -> files (per-package sources)
    skipped: dict[str, int] = field(default_factory=dict)  # why -> packages or files left out


@dataclass(kw_only=True)
class Corpus:
    """Windows of token ids (``tokens`` concatenated, ``starts`` [W+1] offsets, ``source`` [W]
    index into ``stats``) and the per-source record."""

    tokens: np.ndarray
    starts: np.ndarray
    source: np.ndarray
    stats: list[SourceStats]

    def window(self, index: int) -> np.ndarray:
        return self.tokens[int(self.starts[index]) : int(self.starts[index + 1])]

    def __len__(self) -> int:
        return int(self.starts.size - 1)

    @property
    def positions(self) -> int:
        """Trainable positions: every window of T tokens predicts T - 1 of them."""
        return int(self.tokens.size - len(self))


@dataclass(frozen=True)
class DocRef:
    """A document to read: its file, its licence and how to turn the file into text."""

    path: Path
    licence: str
    kind: str  # "text", "roff" (a manual page), "metadata" (a package's README), "docstrings"


def parse_sources(spec: str) -> list[str]:
    """``"python-stdlib,man"`` -> the source names, checked; ``all`` is every source."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(SOURCES)
    bad = [n for n in names if n not in SOURCES]
    if bad or not names:
        raise UsageError(
            f"--corpus {spec!r}: unknown source(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SOURCES)}"
        )
    return list(dict.fromkeys(names))


# -- reading each source ----------------------------------------------------------------------


def _read_text(path: Path) -> str:
    raw = path.read_bytes() if path.suffix != ".gz" else gzip.decompress(path.read_bytes())
    return raw[:MAX_FILE_BYTES].decode("utf-8", errors="replace")


def _stdlib_docs(roots: CorpusRoots, stats: SourceStats) -> list[DocRef]:
    skip = {"site-packages", "test", "tests", "idle_test", "lib2to3", "__pycache__"}
    paths = sorted(roots.stdlib.rglob("*.py"))
    return [DocRef(p, "PSF-2.0", "text") for p in paths if not skip.intersection(p.relative_to(roots.stdlib).parts)]


def package_licence(meta: str) -> str:
    """The licence a package's METADATA declares (License-Expression, License, or the
    ``License ::`` classifiers), '' when none."""
    headers = HeaderParser().parsestr(meta, headersonly=True)
    expr = (headers.get("License-Expression") or "").strip()
    if expr:
        return expr
    classifiers = [c.split("::")[-1].strip() for c in headers.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " / ".join(classifiers)
    first = (headers.get("License") or "").strip().splitlines()
    return first[0][:80] if first else ""


def is_permissive(licence: str) -> bool:
    return bool(PERMISSIVE.search(licence)) and not COPYLEFT.search(licence)


def _docstrings(source: str) -> str:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    docs = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(d for d in docs if d and len(d) > 40)


def _package_docs(roots: CorpusRoots, stats: SourceStats) -> list[DocRef]:
    refs = []
    for dist in sorted(roots.site_packages.glob("*.dist-info")):
        meta_path = dist / "METADATA"
        if not meta_path.is_file():
            continue
        licence = package_licence(_read_text(meta_path))
        if not is_permissive(licence):
            key = "no licence declared" if not licence else f"not permissive ({licence[:40]})"
            stats.skipped[key] = stats.skipped.get(key, 0) + 1
            continue
        refs.append(DocRef(meta_path, licence, "metadata"))
        refs += [DocRef(path, licence, "docstrings") for path in _package_files(dist, roots.site_packages)]
    return refs


def _package_files(dist: Path, site: Path) -> list[Path]:
    record = dist / "RECORD"
    if not record.is_file():
        return []
    rows = [line.split(",")[0] for line in record.read_text(errors="replace").splitlines()]
    return [site / r for r in rows if r.endswith(".py") and ".." not in r and (site / r).is_file()]


ROFF_LINE = re.compile(r"^\.(?:[A-Za-z]{1,3})\s*")
ROFF_ESC = re.compile(r"\\f[BIRP]|\\f\(..|\\f\[[^]]*\]|\\s[-+]?\d|\\\*\(..|\\\*.|\\\(..|\\&|\\e")


def roff_to_text(src: str) -> str:
    """Manual-page markup to plain text: requests dropped (their arguments kept for headings
    and tagged paragraphs), font and size escapes removed."""
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", ".\\}")) or line.strip() in (".", ".PP", ".LP", ".P", ".br", ".sp"):
            continue
        if line.startswith((".", "'")):
            line = ROFF_LINE.sub("", line).replace('"', "")
        line = ROFF_ESC.sub("", line).replace("\\-", "-").replace("\\ ", " ")
        if line.strip():
            out.append(line)
    return "\n".join(out)


def _debian_licence(doc_root: Path, package: str, cache: dict[str, str]) -> str:
    """The first ``License:`` short name in /usr/share/doc/PKG/copyright, else 'unknown'."""
    if package not in cache:
        path = doc_root / package / "copyright"
        found = re.search(r"^License:\s*(\S+)", _read_text(path), re.MULTILINE) if path.is_file() else None
        cache[package] = found.group(1) if found else "unknown (see /usr/share/doc/PKG/copyright)"
    return cache[package]


def _man_package(path: Path) -> str:
    return path.name.split(".")[0]


def _man_docs(roots: CorpusRoots, stats: SourceStats) -> list[DocRef]:
    cache: dict[str, str] = {}
    paths = sorted(p for p in roots.man.glob("man[1-8]/*") if p.is_file() and not p.is_symlink())
    return [DocRef(p, _debian_licence(roots.doc, _man_package(p), cache), "roff") for p in paths]


DOC_NAME = re.compile(r"(^README|\.txt$|\.txt\.gz$|\.md$|\.md\.gz$|\.rst$)", re.IGNORECASE)


def _doc_docs(roots: CorpusRoots, stats: SourceStats) -> list[DocRef]:
    cache: dict[str, str] = {}
    refs = []
    for path in sorted(roots.doc.rglob("*")):
        if path.is_file() and DOC_NAME.search(path.name) and "copyright" not in path.name:
            package = path.relative_to(roots.doc).parts[0]
            refs.append(DocRef(path, _debian_licence(roots.doc, package, cache), "text"))
    return refs


def _licence_docs(roots: CorpusRoots, stats: SourceStats) -> list[DocRef]:
    paths = sorted(p for p in roots.common_licenses.glob("*") if p.is_file())
    paths += sorted(p for p in roots.site_packages.glob("*.dist-info/*") if re.match(r"(LICEN[CS]E|COPYING)", p.name))
    paths += sorted(p for p in roots.site_packages.glob("*.dist-info/licenses/**/*") if p.is_file())
    return [DocRef(p, "the licence text's own terms", "text") for p in paths if p.is_file()]


SOURCE_LICENCE = {
    "python-stdlib": "PSF-2.0",
    "python-docs": "per package, permissive only",
    "man": "per package (GPL, BSD, MIT, ...: trained on locally, not redistributed)",
    "doc": "per package (GPL, BSD, MIT, ...: trained on locally, not redistributed)",
    "licenses": "the licence texts' own terms",
}
READERS: dict[str, Callable[[CorpusRoots, SourceStats], list[DocRef]]] = {
    "python-stdlib": _stdlib_docs,
    "python-docs": _package_docs,
    "man": _man_docs,
    "doc": _doc_docs,
    "licenses": _licence_docs,
}


def load_document(ref: DocRef) -> str:
    """A document's plain text: a file as written, a manual page without markup, a package's
    long description (its METADATA body), or the docstrings of a Python file."""
    text = _read_text(ref.path)
    if ref.kind == "roff":
        return "" if text.startswith(".so ") else roff_to_text(text)
    if ref.kind == "metadata":
        return text.split("\n\n", 1)[1] if "\n\n" in text else ""
    if ref.kind == "docstrings":
        return _docstrings(text)
    return text


def collect_documents(name: str, roots: CorpusRoots, stats: SourceStats, *, seed: int = 0) -> Iterator[str]:
    """One source's documents in a seeded random order (read lazily, so a budget stops the
    reading), counting files, bytes and licences into ``stats``."""
    refs = READERS[name](roots, stats)
    random.Random(f"{seed}:{name}").shuffle(refs)
    for ref in refs:
        text = load_document(ref)
        if len(text.strip()) < 100:
            continue
        stats.files += 1
        stats.bytes += len(text.encode())
        stats.licences[ref.licence] = stats.licences.get(ref.licence, 0) + 1
        yield text


# -- benchmark overlap -------------------------------------------------------------------------


def benchmark_texts() -> list[str]:
    """Every text the project measures on: the message contents of the shipped prompt sets
    (``specdec_rt/tooling/data/*.jsonl``) and its held-out text files (``*.txt``)."""
    import importlib.resources

    root = importlib.resources.files("specdec_rt.tooling.data")
    out: list[str] = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".jsonl"):
            for line in entry.read_text().splitlines():
                if line.strip():
                    out += [m["content"] for m in json.loads(line).get("messages", []) if m.get("content")]
        elif entry.name.endswith(".txt"):
            out.append(entry.read_text())
    return out


def overlap_ngrams(texts: Sequence[str], encode: Callable[[str], list[int]], n: int = NGRAM) -> set[tuple[int, ...]]:
    """Token n-grams of ``texts``, each tokenised as written, after a space and line by line
    (the same words tokenise differently at a window's start or after a newline)."""
    grams: set[tuple[int, ...]] = set()
    for text in texts:
        for variant in [text, " " + text, *text.splitlines()]:
            ids = encode(variant)
            grams.update(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return grams


def encode_long(encode: Callable[[str], list[int]], text: str, piece: int = 50_000) -> list[int]:
    """Token ids of a long text, encoded in pieces of at most ``piece`` characters cut after a
    newline (a tokenizer may refuse one very long input)."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = len(text) if len(text) - start <= piece else text.rfind("\n", start, start + piece) + 1
        end = end if end > start else start + piece
        ids += encode(text[start:end])
        start = end
    return ids


def _overlaps(window: Sequence[int], grams: set[tuple[int, ...]], n: int = NGRAM) -> bool:
    return any(tuple(window[i : i + n]) in grams for i in range(len(window) - n + 1))


# -- building -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """What to build: sources, window length, a token budget per source, the shuffle seed."""

    sources: tuple[str, ...]
    window: int = 512
    max_tokens_per_source: int = 400_000
    seed: int = 0


def _source_windows(
    name: str,
    *,
    spec: CorpusSpec,
    roots: CorpusRoots,
    encode: Callable[[str], list[int]],
    grams: set[tuple[int, ...]],
    seen: set[bytes],
) -> tuple[SourceStats, list[np.ndarray]]:
    """One source's windows, in a seeded random order of its documents, up to its budget."""
    stats = SourceStats(name=name, licence=SOURCE_LICENCE[name])
    windows: list[np.ndarray] = []
    for text in collect_documents(name, roots, stats, seed=spec.seed):
        ids = encode_long(encode, text)
        for start in range(0, len(ids), spec.window):
            win = ids[start : start + spec.window]
            if len(win) < MIN_WINDOW:
                continue
            key = hashlib.sha1(np.asarray(win, np.int32).tobytes()).digest()
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            if _overlaps(win, grams):
                stats.benchmark_overlap += 1
                continue
            windows.append(np.asarray(win, np.int32))
            stats.tokens += len(win)
        if stats.tokens >= spec.max_tokens_per_source:
            break
    stats.windows = len(windows)
    return stats, windows


def build_corpus(
    spec: CorpusSpec,
    encode: Callable[[str], list[int]],
    *,
    roots: CorpusRoots | None = None,
    benchmark: Sequence[str] | None = None,
) -> Corpus:
    """Collect, tokenise, window, deduplicate and filter every source; interleave the windows."""
    roots = roots or CorpusRoots()
    grams = overlap_ngrams(benchmark_texts() if benchmark is None else benchmark, encode)
    seen: set[bytes] = set()
    stats, per_source = [], []
    for name in spec.sources:
        st, wins = _source_windows(name, spec=spec, roots=roots, encode=encode, grams=grams, seen=seen)
        stats.append(st)
        per_source.append(wins)
    order = [(i, j) for i, wins in enumerate(per_source) for j in range(len(wins))]
    random.Random(spec.seed).shuffle(order)
    windows = [per_source[i][j] for i, j in order]
    lengths = np.array([0] + [len(w) for w in windows], np.int64)
    return Corpus(
        tokens=np.concatenate(windows) if windows else np.zeros(0, np.int32),
        starts=np.cumsum(lengths),
        source=np.array([i for i, _ in order], np.int32),
        stats=stats,
    )


def save_corpus(folder: Path, corpus: Corpus) -> None:
    """``folder/windows.npz`` (token ids) and ``folder/sources.json`` (the per-source record)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "windows.tmp.npz"
    np.savez(tmp, tokens=corpus.tokens, starts=corpus.starts, source=corpus.source)
    (folder / "sources.json").write_text(json.dumps([asdict(s) for s in corpus.stats], indent=1))
    tmp.rename(folder / "windows.npz")


def load_corpus(folder: Path) -> Corpus | None:
    path = folder / "windows.npz"
    if not path.is_file():
        return None
    with np.load(path) as z:
        arrays = {k: z[k] for k in ("tokens", "starts", "source")}
    stats = [SourceStats(**s) for s in json.loads((folder / "sources.json").read_text())]
    return Corpus(**arrays, stats=stats)


# -- teacher forcing ----------------------------------------------------------------------------


def teacher_forced(model: Any, windows: Sequence[np.ndarray], *, micro_batch: int = 4, topk: int = TOPK) -> Shard:
    """One shard from windows of text: the target reads ``micro_batch`` windows per forward
    (right-padded: causal attention never lets a real position see the padding; positions
    0..T-1), and keeps h and the top-k distribution at every position but each window's last."""
    import torch

    dev = next(model.parameters()).device
    feats, ids_k, p_k = [], [], []
    with torch.inference_mode():
        for first in range(0, len(windows), micro_batch):
            group = windows[first : first + micro_batch]
            ids = torch.zeros((len(group), max(len(w) for w in group)), dtype=torch.long)
            for row, win in enumerate(group):
                ids[row, : len(win)] = torch.from_numpy(win.astype(np.int64))
            hidden, logits = last_hidden(model, input_ids=ids.to(dev))
            for row, win in enumerate(group):
                feats.append(hidden[row, : len(win) - 1].half().cpu().numpy())
                top_ids, top_p = top_k(logits[row, : len(win) - 1], topk)
                ids_k.append(top_ids)
                p_k.append(top_p)
    lengths = np.array([0] + [len(w) for w in windows], np.int64)
    return Shard(
        tokens=np.concatenate(windows).astype(np.int32),
        starts=np.cumsum(lengths),
        prompt_lens=np.ones(len(windows), np.int32),
        feats=np.concatenate(feats),
        topk_ids=np.concatenate(ids_k),
        topk_p=np.concatenate(p_k),
    )


def corpus_shards(
    model: Any,
    corpus: Corpus,
    data_dir: Path,
    *,
    per_shard: int,
    positions_goal: int,
    deadline: float | None,
    log: Callable[[str], None],
) -> int:
    """Write teacher-forced shards of ``per_shard`` windows each until ``positions_goal``
    positions exist, the windows run out, or ``deadline`` (time.monotonic) passes. Resumable:
    shard i always holds windows i*per_shard..; finished shards are skipped. Returns the
    positions on disk."""
    data_dir.mkdir(parents=True, exist_ok=True)
    have = sum(s.answer_tokens for s in load_shards(data_dir))
    n_shards = -(-len(corpus) // per_shard)
    t0, cpu0, made = time.monotonic(), time.process_time(), 0
    for index in range(n_shards):
        path = shard_path(data_dir, index)
        if path.exists():
            continue
        if have >= positions_goal:
            break
        if deadline is not None and time.monotonic() > deadline:
            log("corpus: time budget reached")
            break
        rows = range(index * per_shard, min(len(corpus), (index + 1) * per_shard))
        shard = teacher_forced(model, [corpus.window(i) for i in rows])
        save_shard(path, shard)
        have += shard.answer_tokens
        made += shard.answer_tokens
        rate = made / (time.monotonic() - t0)
        per_cpu = made / max(time.process_time() - cpu0, 1e-9)
        log(
            f"corpus: shard {index + 1}/{n_shards}, {have:,}/{positions_goal:,} positions, "
            f"{rate:.0f} positions/s ({per_cpu:.0f} per CPU-second), "
            f"ETA {(positions_goal - have) / max(rate, 1e-9) / 60:.1f} min"
        )
    return have
