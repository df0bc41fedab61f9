"""``python -m specdec_rt bench --agreement``: how far each quantized target is from the float32
one, beside llama.cpp's quantizations of the same model, on the same token windows.

Teacher-forced over held-out text (``--text FILE``; default ``tooling/data/heldout.txt``, ~4,300
SmolLM2 tokens of plain prose and code written for this). The text is cut as ``llama-perplexity``
cuts it: the tokens (with BOS in front when the model adds one) go in windows of ``--window`` (its
``-c``, default 512) consecutive tokens, as many whole windows as fit (at least two), each fed from
position 0 with a fresh cache and its first token replaced by BOS when the model adds one; the
positions scored are the second half of each window, ``window // 2 .. window - 2`` (each one's
distribution over the next token). For each position and each quantized target of the model
(the folder's quantized draft copies and built sibling recipes ``<model>-q8`` / ``<model>-q4``, one
row per distinct weight file) against the float32 target:

* top-1 agreement: the two distributions' most likely tokens are the same (``argmax``, first
  index on a tie, as llama.cpp counts its "Same top p");
* ``KL(p_f32 || p_quant)``, in nats, with llama.cpp's rule of summing only over the tokens whose
  float32 log-probability is above -16 (the rest add < 1e-7 each);
* perplexity of both on the text's next tokens.

With ``--llama-cpp BIN_DIR`` the same is measured for llama.cpp: ``llama-perplexity
--kl-divergence-base`` on the F32 file, then ``--kl-divergence`` on Q8_0 and Q4_1 (the files
``bench --llama-cpp`` makes with ``llama-quantize``, or ``--llama-gguf``), whose "Mean KLD" and
"Same top p" lines are read. The base file llama.cpp writes holds the token ids it scored and its
F32 log-probabilities (16 bits each): our token ids are checked against them (where they differ,
ours are replaced by llama.cpp's, so the windows stay the same, and the report says so), and our
float32 target is compared with llama.cpp's F32 on the same positions.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InvalidInputError, SpecDecError
from .args import bench_args

if TYPE_CHECKING:
    from ...ort.manifest import Manifest
    from ...ort.model import OrtModel

__all__ = [
    "DEFAULT_TEXT",
    "DEFAULT_WINDOW",
    "Agreement",
    "KldBase",
    "LlamaKld",
    "log_softmax",
    "kl_rows",
    "windows",
    "parse_perplexity",
    "read_kld_base",
    "quantized_targets",
    "measure",
    "format_agreement",
    "check_agreement_args",
    "run_agreement",
]

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "heldout.txt"
DEFAULT_WINDOW = 512  # llama-perplexity's default -c
LOGP_FLOOR = -16.0  # llama.cpp's KL sums over base log-probabilities above this
ROW_BLOCK = 64  # positions per float64 block (a [64, 49152] float64 array is 25 MB)


def _log(msg: str) -> None:
    print(f"[agreement] {msg}", file=sys.stderr, flush=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``[n, V]`` logits -> float64 log-probabilities ``[n, V]``."""
    x = np.asarray(logits, dtype=np.float64)  # [n, V]
    m = x.max(axis=-1, keepdims=True)  # [n, 1]
    logp: np.ndarray = x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))
    return logp


def kl_rows(base_logp: np.ndarray, logp: np.ndarray, floor: float = LOGP_FLOOR) -> np.ndarray:
    """``KL(p_base || p)`` per row ``[n]`` from log-probabilities ``[n, V]``, summed over the tokens
    whose base log-probability is above ``floor`` (llama.cpp's rule)."""
    keep = base_logp > floor  # [n, V]
    terms = np.where(keep, np.exp(base_logp) * (base_logp - logp), 0.0)  # [n, V]
    kl: np.ndarray = terms.sum(axis=-1)
    return kl


@dataclass
class Agreement:
    """Running totals of one model against a base over scored positions."""

    positions: int = 0
    same_top: int = 0
    kl_sum: float = 0.0
    kl_sq: float = 0.0
    nll_sum: float = 0.0  # the compared model's negative log-likelihood of the next tokens
    nll_base_sum: float = 0.0

    def add(self, base_logp: np.ndarray, logp: np.ndarray, next_ids: np.ndarray) -> None:
        """Add positions: base and compared log-probabilities ``[n, V]``, the tokens that follow
        ``[n]``."""
        if base_logp.shape != logp.shape or base_logp.shape[0] != np.size(next_ids):
            raise SpecDecError(f"shapes differ: base {base_logp.shape}, other {logp.shape}, {np.size(next_ids)} ids")
        kl = kl_rows(base_logp, logp)  # [n]
        rows = np.arange(base_logp.shape[0])
        self.positions += base_logp.shape[0]
        self.same_top += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
        self.kl_sum += float(kl.sum())
        self.kl_sq += float((kl * kl).sum())
        self.nll_sum -= float(logp[rows, next_ids].sum())
        self.nll_base_sum -= float(base_logp[rows, next_ids].sum())

    def summary(self) -> dict[str, Any]:
        """``top1`` (fraction), ``kl_mean`` and its standard error, both perplexities."""
        n = self.positions
        if n == 0:
            raise SpecDecError("no positions were scored")
        mean = self.kl_sum / n
        var = self.kl_sq / n - mean * mean
        return {
            "positions": n,
            "top1": self.same_top / n,
            "kl_mean": mean,
            "kl_stderr": math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0,
            "ppl": math.exp(self.nll_sum / n),
            "ppl_base": math.exp(self.nll_base_sum / n),
        }


def windows(tokens: list[int] | np.ndarray, window: int, bos: int | None) -> np.ndarray:
    """llama-perplexity's chunks: ``[n_chunks, window]`` whole windows of ``tokens`` (at least
    two), each one's first token replaced by ``bos`` when the model adds one (``bos`` not None)."""
    ids = np.asarray(tokens, dtype=np.int64)
    if window < 4:
        raise InvalidInputError(f"--window must be >= 4, got {window}")
    if ids.size < 2 * window:
        raise InvalidInputError(
            f"the text is {ids.size} tokens: it needs at least {2 * window} for windows of {window} "
            "(llama-perplexity's rule); give a longer --text or a smaller --window"
        )
    n = ids.size // window
    out: np.ndarray = ids[: n * window].reshape(n, window).copy()
    if bos is not None:
        out[:, 0] = bos
    return out


# llama-perplexity's output: the base run's estimate, the KL run's summary lines (± or +/-)
_PM = r"\s*(?:±|\+/-)\s*"
_F = r"(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|nan|inf)"
_PATTERNS = {
    "ppl_final": re.compile(rf"Final estimate: PPL = {_F}{_PM}{_F}"),
    "ppl": re.compile(rf"Mean PPL\(Q\)\s*:\s*{_F}{_PM}{_F}"),
    "ppl_base": re.compile(rf"Mean PPL\(base\)\s*:\s*{_F}{_PM}{_F}"),
    "kl_mean": re.compile(rf"Mean\s+KLD:\s*{_F}{_PM}{_F}"),
    "kl_median": re.compile(rf"Median\s+KLD:\s*{_F}"),
    "kl_max": re.compile(rf"Maximum KLD:\s*{_F}"),
    "top1": re.compile(rf"Same top p:\s*{_F}{_PM}{_F}\s*%"),
}
_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)")


@dataclass
class LlamaKld:
    """What one llama-perplexity run printed (None where it printed no such line)."""

    chunks: int | None = None
    window: int | None = None
    ppl: float | None = None
    ppl_base: float | None = None
    kl_mean: float | None = None
    kl_stderr: float | None = None
    kl_median: float | None = None
    kl_max: float | None = None
    top1: float | None = None  # a fraction (llama.cpp prints a percentage)
    top1_stderr: float | None = None


def parse_perplexity(log: str) -> LlamaKld:
    """Read a ``llama-perplexity`` log: a ``--kl-divergence-base`` run (``Final estimate: PPL``) or
    a ``--kl-divergence`` run (``Mean PPL(Q)``, ``Mean KLD``, ``Same top p`` ...). A log with
    neither is an error quoting its end."""
    got = LlamaKld()
    m = _CHUNKS.search(log)
    if m:
        got.chunks, got.window = int(m.group(1)), int(m.group(2))
    found = {k: p.search(log) for k, p in _PATTERNS.items()}
    if found["ppl_final"]:
        got.ppl = float(found["ppl_final"].group(1))
    if found["ppl"]:
        got.ppl = float(found["ppl"].group(1))
    if found["ppl_base"]:
        got.ppl_base = float(found["ppl_base"].group(1))
    if found["kl_mean"]:
        got.kl_mean, got.kl_stderr = float(found["kl_mean"].group(1)), float(found["kl_mean"].group(2))
    if found["kl_median"]:
        got.kl_median = float(found["kl_median"].group(1))
    if found["kl_max"]:
        got.kl_max = float(found["kl_max"].group(1))
    if found["top1"]:
        got.top1, got.top1_stderr = float(found["top1"].group(1)) / 100, float(found["top1"].group(2)) / 100
    if got.ppl is None and got.kl_mean is None:
        raise SpecDecError("llama-perplexity printed no 'Final estimate' / 'Mean KLD' lines: " + repr(log[-600:]))
    return got


@dataclass
class KldBase:
    """A ``--kl-divergence-base`` file: the windows llama.cpp scored and its base log-probabilities."""

    window: int
    vocab: int
    tokens: np.ndarray  # int32 [chunks, window], as tokenized (BOS not yet put in)
    _data: np.ndarray  # uint16 [chunks, window - 1 - window // 2, nv]

    @property
    def chunks(self) -> int:
        return int(self.tokens.shape[0])

    def logp(self, chunk: int) -> np.ndarray:
        """The base log-probabilities of a chunk's scored positions, float64 ``[n, V]``: each row
        stores ``scale`` and ``min`` (two float32 in its first four uint16) and ``q`` per token,
        log p = scale * q + min."""
        rows = np.asarray(self._data[chunk])  # [n, nv]
        head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [n, 2]: scale, min log-prob
        q = rows[:, 4 : 4 + self.vocab].astype(np.float64)  # [n, V]
        return head[:, :1].astype(np.float64) * q + head[:, 1:2].astype(np.float64)


def read_kld_base(path: str | Path) -> KldBase:
    """Read llama-perplexity's ``--kl-divergence-base`` file (``_logits_``, n_ctx, n_vocab,
    n_chunk, the tokens, then per chunk ``n_ctx - 1 - n_ctx // 2`` rows of ``nv`` uint16)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 20 or raw[:8].tobytes() != b"_logits_":
        raise SpecDecError(f"{path}: not a llama-perplexity --kl-divergence-base file")
    window, vocab, chunks = (int(x) for x in raw[8:20].view(np.int32))
    if window < 4 or vocab < 1 or chunks < 1:
        raise SpecDecError(f"{path}: bad header (n_ctx {window}, n_vocab {vocab}, n_chunk {chunks})")
    nv = 2 * ((vocab + 1) // 2) + 4
    n = window - 1 - window // 2
    at = 20 + 4 * window * chunks
    want = at + 2 * chunks * n * nv
    if raw.size != want:
        raise SpecDecError(f"{path}: {raw.size} bytes, the header implies {want}")
    tokens = raw[20:at].view(np.int32).reshape(chunks, window)
    return KldBase(window, vocab, tokens, raw[at:].view(np.uint16).reshape(chunks, n, nv))


def quantized_targets(folder: Path, manifest: Manifest) -> list[tuple[str, list[str], Path]]:
    """``(label, names, folder)`` for each distinct quantized copy of the model: its quantized
    drafts (``draft-q8`` ...) and built sibling recipes (``<name>-q8``, ``<name>-q4``); copies with
    the same weight file (its sha256 in the manifest) are one row with every name."""
    from ...ort.manifest import load_manifest

    found: list[tuple[str, list[str], Path]] = []
    by_hash: dict[str, int] = {}
    candidates = [manifest.draft_dir(d["name"]) for d in manifest.drafts]
    candidates += [folder.parent / f"{manifest.name}-{q}" for q in ("q8", "q4")]
    for path in candidates:
        if path is None or not (path / "manifest.json").is_file():
            continue
        m = load_manifest(path)
        quant = m.quantization or {}
        if not quant.get("bits") or _source_id(m) != _source_id(manifest):
            continue  # a float draft, or a copy of another model
        name = path.name if path.parent == folder.parent else f"{folder.name}/{path.name}"
        data = m.raw["onnx"].get("data_file") or m.raw["onnx"]["file"]
        digest = ((m.raw.get("files") or {}).get(data) or {}).get("sha256") or str(path)
        if digest in by_hash:
            found[by_hash[digest]][1].append(name)
            continue
        by_hash[digest] = len(found)
        found.append((f"int{quant['bits']}", [name], path))
    return found


def _source_id(m: Manifest) -> str | None:
    """What a model was exported from: its source file's sha256, else its path or file name."""
    src = m.raw.get("source") or {}
    found = src.get("sha256") or src.get("path") or src.get("file")
    return None if found is None else str(found)


def _window_logits(model: OrtModel, window: np.ndarray) -> np.ndarray:
    """Logits ``[n, V]`` of a window's scored positions (``len // 2 .. len - 2``), from a fresh
    cache in one call."""
    size = window.size
    first = size // 2
    s = model.start()
    try:
        out: np.ndarray = s.run_sync(np.asarray(window, dtype=np.int64), size - first, 0)  # [size - first, V]
    finally:
        s.rollback(0)
        s.close()
    return out[:-1]


def measure(
    target: OrtModel,
    quants: Mapping[str, Any],
    chunks: np.ndarray,
    llama_base: KldBase | None = None,
    *,
    say: Callable[[str], object] = _log,
) -> dict[str, dict[str, Any]]:
    """Teacher-forced agreement over ``chunks`` ``[n, window]``: each of ``quants`` (label ->
    model) against ``target`` (float32), and ``target`` against ``llama_base`` (llama.cpp's F32
    log-probabilities of the same chunks) when given. Models: ``OrtModel``-like (``start()``
    sessions with ``run_sync``). Returns label -> :meth:`Agreement.summary`."""
    totals = {label: Agreement() for label in quants}
    if llama_base is not None:
        totals["f32_vs_llama_f32"] = Agreement()
    first = chunks.shape[1] // 2
    t0 = time.perf_counter()
    for c, window in enumerate(chunks):
        nxt = window[first + 1 :]  # [n] the tokens each scored position predicts
        base = _window_logits(target, window)  # [n, V]
        others = {label: _window_logits(m, window) for label, m in quants.items()}
        llama = llama_base.logp(c) if llama_base is not None else None
        for a in range(0, base.shape[0], ROW_BLOCK):  # float64 blocks
            b = slice(a, a + ROW_BLOCK)
            base_lp = log_softmax(base[b])
            for label, logits in others.items():
                totals[label].add(base_lp, log_softmax(logits[b]), nxt[b])
            if llama is not None:
                totals["f32_vs_llama_f32"].add(llama[b], base_lp, nxt[b])
        say(f"window {c + 1}/{len(chunks)} ({time.perf_counter() - t0:.0f} s)")
    return {label: t.summary() for label, t in totals.items()}


def _first_difference(ours: np.ndarray, theirs: np.ndarray) -> int | None:
    """The first index where two id sequences differ (a length counts), None where they are equal."""
    n = min(ours.size, theirs.size)
    differ = np.flatnonzero(ours[:n] != theirs[:n])
    if differ.size:
        return int(differ[0])
    return None if ours.size == theirs.size else n


def _run_perplexity(tool: Path, args: list[str]) -> LlamaKld:
    proc = subprocess.run([str(tool), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SpecDecError(f"{tool.name} {' '.join(args[:2])} exited with {proc.returncode}: {log[-600:]!r}")
    return parse_perplexity(log)


def _llama_side(
    args: argparse.Namespace, text: Path, *, window: int, threads: int, manifest: Manifest, out: Path
) -> tuple[dict[str, Any], KldBase]:
    """llama-perplexity on F32 (the base) and each other GGUF; the base file read back."""
    from .llamacpp import find_tools, resolve_ggufs

    tools = find_tools(args.llama_cpp)
    tool = tools["completion"].parent / "llama-perplexity"
    if not tool.is_file():
        raise SpecDecError(
            f"--llama-cpp {args.llama_cpp}: no llama-perplexity (scripts/build-llama-cpp builds it, or "
            f"cmake --build {tools['completion'].parent.parent} --target llama-perplexity)"
        )
    ggufs = resolve_ggufs(args.llama_gguf, tools, manifest, _log)
    if "f32" not in ggufs:
        raise InvalidInputError(f"--llama-gguf needs an F32 file as the base; got {sorted(ggufs)}")
    common = ["-c", str(window), "-t", str(threads), "-tb", str(threads)]
    base_file = out / "llama-f32.kld"
    _log(f"llama-perplexity --kl-divergence-base on {ggufs['f32'].name}")
    runs: dict[str, Any] = {
        "f32": asdict(
            _run_perplexity(
                tool, ["-m", str(ggufs["f32"]), "-f", str(text), *common, "--kl-divergence-base", str(base_file)]
            )
        )
    }
    for label, path in ggufs.items():
        if label == "f32":
            continue
        _log(f"llama-perplexity --kl-divergence on {path.name}")
        runs[label] = asdict(
            _run_perplexity(tool, ["-m", str(path), *common, "--kl-divergence-base", str(base_file), "--kl-divergence"])
        )
    info = {
        "tool": str(tool),
        "gguf": {k: str(v) for k, v in ggufs.items()},
        "runs": runs,
    }
    base = read_kld_base(base_file)  # read into memory: the file (~200 MB for SmolLM2) goes
    base_file.unlink()
    return info, base


def check_agreement_args(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for ``--agreement``; raise :class:`InvalidInputError` naming the first
    flag that does not go with it (or ``--text`` / ``--window`` without it), before any model loads."""
    bench_args(args)
    if not args.agreement:
        for flag, value in (("--text", args.text), ("--window", args.window)):
            if value is not None:
                raise InvalidInputError(f"{flag} goes with --agreement")
        return False
    for flag, value in (
        ("--concurrency", args.concurrency),
        ("--prefix-cache", args.prefix_cache),
        ("--prefill", args.prefill),
        ("--serve", args.serve),
        ("--modes", args.modes),
        ("--categories", args.categories),
        ("--prompts", args.prompts),
        ("--limit", args.limit),
        ("--micro", args.micro),
        ("--cold", args.cold),
        ("--add-draft", args.add_draft),
        ("--draft", args.draft),
        ("--llama-draft", args.llama_draft),
        ("--repeats", args.repeats not in (None, 1)),
    ):
        if value:
            raise InvalidInputError(f"{flag} does not go with --agreement (it scores held-out text, teacher-forced)")
    if args.llama_gguf and not args.llama_cpp:
        raise InvalidInputError("--llama-gguf needs --llama-cpp BIN_DIR")
    if args.window is not None and args.window < 4:
        raise InvalidInputError(f"--window must be >= 4, got {args.window}")
    if args.text is not None and not Path(args.text).expanduser().is_file():
        raise InvalidInputError(f"--text {args.text}: no such file")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out} is a file, not a folder")
    return True


def run_agreement(args: argparse.Namespace) -> int:
    """The ``bench --agreement`` command (see the module docstring): a table on stdout,
    ``<out>/agreement.json`` and ``agreement.md``."""
    from ...engine.loading import ensure_built
    from ...ort import default_threads
    from ...ort.manifest import load_manifest
    from ...text.codec import TextCodec
    from ..reports import write_report
    from .runner import machine_info

    window = args.window or DEFAULT_WINDOW
    text = Path(args.text).expanduser() if args.text else DEFAULT_TEXT
    if not text.is_file():
        raise InvalidInputError(f"--text {args.text}: no such file")
    if args.llama_cpp:
        from .llamacpp import find_tools

        find_tools(args.llama_cpp)  # a wrong folder fails before any model loads
    folder = ensure_built(args.model, say=_log)
    manifest = load_manifest(folder)
    if manifest.quantization:
        raise InvalidInputError(f"--model {args.model} is quantized: --agreement compares against a float32 target")
    codec = TextCodec.from_manifest(manifest)
    tokens = codec.encode(text.read_text(encoding="utf-8"))
    bos = codec.bos_id if codec.add_bos else None
    threads = args.threads or default_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "model": manifest.name,
        "text": str(text),
        "text_tokens": len(tokens),
        "window": window,
        "machine": machine_info(threads),
    }
    chunks = windows(tokens, window, bos)  # the text is checked before anything runs
    llama_base = None
    if args.llama_cpp:
        report["llama_cpp"], llama_base = _llama_side(
            args, text, window=window, threads=threads, manifest=manifest, out=out
        )
        chunks = _llama_chunks(report, llama_base, tokens, chunks=chunks, bos=bos)
    rows = _score(folder, manifest, chunks, threads=threads, llama_base=llama_base)
    report["rows"] = rows + (_llama_rows(report, positions=_positions(chunks)) if llama_base is not None else [])
    table = format_agreement(report)
    write_report(out, "agreement", report, table, as_json=args.json)
    _log(f"wrote {out / 'agreement.json'}, {out / 'agreement.md'}")
    return 0


def _positions(chunks: np.ndarray) -> int:
    """Positions scored: the second half of each window, less its last token."""
    window = chunks.shape[1]
    return int(chunks.shape[0] * (window - 1 - window // 2))


def _llama_chunks(
    report: dict[str, Any], llama_base: KldBase, tokens: list[int], *, chunks: np.ndarray, bos: int | None
) -> np.ndarray:
    """The windows to score: ours, or llama.cpp's token ids where ours differ (the report says
    where); :class:`SpecDecError` when llama.cpp scored other windows."""
    theirs = llama_base.tokens.astype(np.int64)  # [chunks, window]
    diff = _first_difference(np.asarray(tokens[: theirs.size], dtype=np.int64), theirs.reshape(-1))
    report["token_ids_match_llama_cpp"] = diff is None
    if diff is not None:
        _log(f"our token ids differ from llama.cpp's (first at index {diff}): scoring llama.cpp's")
        report["token_ids_first_difference"] = diff
        chunks = theirs.copy()
        if bos is not None:
            chunks[:, 0] = bos
    window = chunks.shape[1]
    if llama_base.window != window or llama_base.chunks != chunks.shape[0]:
        raise SpecDecError(
            f"llama.cpp scored {llama_base.chunks} windows of {llama_base.window}, ours are {chunks.shape[0]} of {window}"
        )
    return chunks


def _score(
    folder: Path, manifest: Manifest, chunks: np.ndarray, *, threads: int, llama_base: KldBase | None
) -> list[dict[str, Any]]:
    """Our rows: each quantized copy against the float32 target (and that against llama.cpp's F32)."""
    from ...ort.model import OrtModel

    copies = quantized_targets(folder, manifest)
    if not copies:
        raise SpecDecError(
            f"{manifest.name} has no quantized copy (draft-q8 / draft-q4 or {manifest.name}-q8 / -q4): nothing to compare"
        )
    window = chunks.shape[1]
    _log(
        f"{chunks.shape[0]} windows of {window} tokens, {_positions(chunks)} positions; "
        f"float32 against {', '.join('+'.join(n) for _, n, _ in copies)}"
    )
    target = OrtModel(folder, max_length=window, slots=1, threads=threads)
    labels = [c[0] for c in copies]
    quants = {
        label if labels.count(label) == 1 else f"{label}:{names[0]}": OrtModel(
            path, max_length=window, slots=1, threads=threads
        )
        for label, names, path in copies
    }
    ours = measure(target, quants, chunks, llama_base)
    rows = [
        {"side": "ours", "model": key, "vs": "ours f32", "names": names, **ours[key]}
        for (_, names, _), key in zip(copies, quants)
    ]
    if llama_base is not None:
        base = {"side": "ours", "model": "f32", "vs": "llama.cpp F32", "names": [manifest.name]}
        rows.append({**base, **ours["f32_vs_llama_f32"]})
    return rows


def _llama_rows(report: dict[str, Any], *, positions: int) -> list[dict[str, Any]]:
    """llama.cpp's rows: each of its quantizations against its F32, from llama-perplexity's lines."""
    rows = []
    for label, run in report["llama_cpp"]["runs"].items():
        if label == "f32":
            continue
        rows.append(
            {
                "side": "llama.cpp",
                "model": label.upper(),
                "vs": "llama.cpp F32",
                "names": [Path(report["llama_cpp"]["gguf"][label]).name],
                "positions": positions,
                "top1": run["top1"],
                "kl_mean": run["kl_mean"],
                "kl_stderr": run["kl_stderr"],
                "ppl": run["ppl"],
                "ppl_base": run["ppl_base"],
            }
        )
    return rows


def _kl(v: float | None) -> str:
    """A KL divergence for the table: 5 decimals, or 2 significant digits below 1e-4."""
    if v is None:
        return "-"
    return f"{v:.5f}" if abs(v) >= 1e-4 else f"{v:.1e}"


def format_agreement(report: dict[str, Any]) -> str:
    """Markdown: one row per quantized model, against its float32 base."""

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"Agreement with float32: {report['model']}, {report['text_tokens']} tokens of "
        f"{Path(report['text']).name}, windows of {report['window']} (second halves scored)",
        "",
        "| side | model | against | positions | top-1 agreement | mean KL (nats) | PPL | PPL of base |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        kl = _kl(r.get("kl_mean")) + (f" ± {_kl(r['kl_stderr'])}" if r.get("kl_stderr") else "")
        lines.append(
            f"| {r['side']} | {r['model']} ({', '.join(r['names'])}) | {r['vs']} | {r.get('positions', '-')} | "
            f"{f(r.get('top1') and 100 * r['top1'], '.2f')}% | {kl} | {f(r.get('ppl'), '.3f')} | "
            f"{f(r.get('ppl_base'), '.3f')} |"
        )
    if "token_ids_match_llama_cpp" in report:
        lines += ["", f"token ids equal llama.cpp's: {'yes' if report['token_ids_match_llama_cpp'] else 'no'}"]
    return "\n".join(lines)
