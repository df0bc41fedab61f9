"""``python -m specdec_rt bench --llama-cpp BIN_DIR``: llama.cpp as a measured peer.

llama.cpp's command-line tools (``scripts/build-llama-cpp`` builds them) run as one subprocess per
prompt, on the same prompts, token budget and thread count as our modes; each GGUF file becomes a
bench mode ``llamacpp_<quant>`` (``llamacpp_f32``, ``llamacpp_q8_0``, ``llamacpp_q4_1``) that
``run_modes`` interleaves with ours. The prompt is ours: the prompt ids decoded with their special
tokens (the chat template already applied), given as a raw prompt (``-no-cnv``), greedy
(``--temp 0``). The times are llama.cpp's own (its ``prompt eval time`` / ``eval time`` lines): end
to end = generated tokens / (prompt eval + eval), decode only = eval runs / eval time. Process
start, model load and llama.cpp's warm-up run are outside both, as our model load is outside ours;
so is its sampling time (~0.2 ms a token, in the report), which ours includes.

With ``--llama-draft FILE`` and ``llama-speculative-simple`` (or ``llama-speculative``) in the bin
folder, ``llamacpp_<quant>_spec`` adds llama.cpp's speculative decoding (its default draft
settings) of the first target with that draft. Without ``--llama-gguf``, the modes are the model's
source GGUF (the file its manifest names: SmolLM2's Q4_1, Gemma 3 270M's Q4_K_M) and F32 / Q8_0 files
made from it once with ``llama-quantize``.

A model whose tokenizer adds a BOS to plain text (Gemma's ``<bos>``) has it first in our prompt ids;
llama.cpp adds its own (the GGUF's ``add_bos_token``, which our manifest copies), so the prompt text
leaves ours out and both count the same tokens (``prompt_tokens_match`` in the report).
"""

from __future__ import annotations

import re
import signal
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidInputError, SpecDecError

if TYPE_CHECKING:
    from ...ort.manifest import Manifest
    from ...text.codec import TextCodec
    from .runner import Sample

__all__ = [
    "LlamaTiming",
    "parse_completion",
    "parse_speculative",
    "find_tools",
    "quant_label",
    "resolve_ggufs",
    "llamacpp_modes",
    "summarize_llamacpp",
    "format_llamacpp",
]

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT = re.compile(rf"prompt eval time\s*=\s*{_NUM} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time\s*=\s*{_NUM} ms /\s*(\d+) runs")
_SAMPLING = re.compile(rf"sampling time\s*=\s*{_NUM} ms")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds")
_COUNT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")
COMPLETION_TOOLS = ("llama-completion", "llama-cli")  # older trees: llama-cli is the plain one
SPECULATIVE_TOOLS = ("llama-speculative-simple", "llama-speculative")
DEFAULT_QUANTS = ("F32", "Q8_0")  # made from the source GGUF, which is a mode too


@dataclass(kw_only=True)
class LlamaTiming:
    """One llama.cpp run, from its own timing lines."""

    prompt_tokens: int
    prompt_ms: float
    generated: int
    decode_tokens: int  # tokens the decode phase produced (eval runs; all of them for speculative)
    decode_ms: float
    sampling_ms: float | None = None
    drafted: int | None = None
    accepted: int | None = None

    @property
    def seconds(self) -> float:
        return (self.prompt_ms + self.decode_ms) / 1e3

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_ms * 1e3 if self.decode_ms > 0 else 0.0


def parse_completion(log: str) -> LlamaTiming:
    """The ``llama_perf_context_print`` lines of llama-completion (or llama-cli, llama-simple).
    Greedy sampling makes a token after the prompt and after each eval run but the last one's is
    not evaluated: generated = eval runs + 1."""
    p, e, s = _PROMPT.search(log), _EVAL.search(log), _SAMPLING.search(log)
    if not p or not e:
        raise SpecDecError("llama.cpp printed no 'prompt eval time' / 'eval time' lines: " + _tail(log))
    runs = int(e.group(2))
    return LlamaTiming(
        prompt_tokens=int(p.group(2)),
        prompt_ms=float(p.group(1)),
        generated=runs + 1,
        decode_tokens=runs,
        decode_ms=float(e.group(1)),
        sampling_ms=float(s.group(1)) if s else None,
    )


def parse_speculative(log: str) -> LlamaTiming:
    """The ``encoded ... / decoded ...`` lines and counters of llama-speculative(-simple)."""
    enc, dec = _ENCODED.search(log), _DECODED.search(log)
    if not enc or not dec:
        raise SpecDecError("llama.cpp printed no 'encoded ... / decoded ...' lines: " + _tail(log))
    counts = dict(_COUNT.findall(log))
    n = int(dec.group(1))
    return LlamaTiming(
        prompt_tokens=int(enc.group(1)),
        prompt_ms=float(enc.group(2)) * 1e3,
        generated=n,
        decode_tokens=n,
        decode_ms=float(dec.group(2)) * 1e3,
        drafted=int(counts["n_drafted"]) if "n_drafted" in counts else None,
        accepted=int(counts["n_accept"]) if "n_accept" in counts else None,
    )


def _tail(text: str, n: int = 600) -> str:
    return repr(text[-n:]) if text else "(no output)"


def find_tools(bin_dir: str | Path) -> dict[str, Path]:
    """``completion`` (required), ``speculative`` and ``quantize`` (when present) in ``bin_dir``."""
    d = Path(bin_dir).expanduser()
    if not d.is_dir():
        raise SpecDecError(
            f"--llama-cpp {bin_dir}: no such folder (build llama.cpp with "
            "scripts/build-llama-cpp; it prints the bin folder)"
        )
    tools: dict[str, Path] = {}
    for key, names in (
        ("completion", COMPLETION_TOOLS),
        ("speculative", SPECULATIVE_TOOLS),
        ("quantize", ("llama-quantize",)),
    ):
        found = next((d / n for n in names if (d / n).is_file()), None)
        if found is not None:
            tools[key] = found
    if "completion" not in tools:
        raise SpecDecError(f"--llama-cpp {bin_dir}: holds none of {', '.join(COMPLETION_TOOLS)}")
    return tools


def quant_label(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``q4_1``: the last ``.``- (else ``-``-) part of the stem."""
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    part = stem.rsplit(".", 1)[-1] if "." in stem else stem.rsplit("-", 1)[-1]
    return re.sub(r"[^a-z0-9_]+", "_", part.lower()).strip("_") or "model"


def resolve_ggufs(
    spec: str | None,
    tools: dict[str, Path],
    manifest: Manifest | None = None,
    say: Callable[[str], object] = print,
) -> dict[str, Path]:
    """``label -> file`` from ``--llama-gguf`` (comma-separated files, or a folder of ``*.gguf``);
    without it, F32 / Q8_0 files made from the model's source GGUF (once, cached) and the source."""
    if spec:
        files: list[Path] = []
        for part in (s.strip() for s in spec.split(",") if s.strip()):
            p = Path(part).expanduser()
            if p.is_dir():
                files += sorted(p.glob("*.gguf"))
            elif p.is_file():
                files.append(p)
            else:
                raise SpecDecError(f"--llama-gguf {part}: no such file or folder")
        if not files:
            raise SpecDecError(f"--llama-gguf {spec}: no .gguf files")
        out = {quant_label(f): f for f in files}
        if len(out) != len(files):
            raise InvalidInputError(
                f"--llama-gguf {spec}: two files share a quantization label: {[f.name for f in files]}"
            )
        return out
    return _default_ggufs(tools, manifest, say)


def _default_ggufs(tools: dict[str, Path], manifest: Manifest | None, say: Callable[[str], object]) -> dict[str, Path]:
    from ...ort.manifest import cache_root

    name = ((manifest.raw.get("source") or {}).get("file") if manifest is not None else None) or ""
    source = cache_root() / "downloads" / name
    if not name.endswith(".gguf") or not source.is_file():
        raise SpecDecError(
            "--llama-cpp without --llama-gguf needs the model's source GGUF "
            f"(looked for {source}); pass --llama-gguf FILES_OR_FOLDER"
        )
    if "quantize" not in tools:
        raise SpecDecError(
            f"no llama-quantize in {tools['completion'].parent} to make the GGUF files; "
            "pass --llama-gguf FILES_OR_FOLDER"
        )
    folder = cache_root() / "llama.cpp" / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    base = source.name[:-5].rsplit(".", 1)[0]
    own = quant_label(source)
    out: dict[str, Path] = {own: source}  # the source itself (SmolLM2's Q4_1, Gemma 3 270M's Q4_K_M)
    for q in DEFAULT_QUANTS:  # F32 = the dequantized weights our runtime uses; Q8_0 from F32
        dst, src = folder / f"{base}.{q}.gguf", out.get("f32", source)
        if q.lower() in out:
            continue
        if not dst.is_file():
            say(f"llama-quantize {src.name} -> {dst.name}")
            tmp = dst.with_suffix(".part")
            proc = subprocess.run(
                [str(tools["quantize"]), "--allow-requantize", str(src), str(tmp), q], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SpecDecError(f"llama-quantize {q} failed: {_tail(proc.stderr)}")
            tmp.replace(dst)
        out[q.lower()] = dst
    return {**{q.lower(): out[q.lower()] for q in DEFAULT_QUANTS}, own: source}


def _exit_words(code: int) -> str:
    """How a tool ended: ``exited with 1``, or ``was killed by SIGSEGV`` (and where that is known)."""
    if code >= 0:
        return f"exited with {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = (
        (
            " (on a CPU with AMX, llama.cpp's AMX kernels crash: rebuild with scripts/build-llama-cpp, "
            "which leaves them out)"
        )
        if name == "SIGSEGV"
        else ""
    )
    return f"was killed by {name}{hint}"


def llamacpp_modes(
    bin_dir: str | Path,
    gguf_spec: str | None,
    draft: str | None,
    codec: TextCodec,
    *,
    threads: int,
    ctx_size: int,
    manifest: Manifest | None = None,
    say: Callable[[str], object] = print,
) -> tuple[dict[str, LlamaRunner], dict[str, Any]]:
    """Bench runners ``llamacpp_<label>`` (and ``llamacpp_<label>_spec`` with a draft file) and
    an info dict for the report. A runner returns ``(ids, seconds, None, extra)``: ``ids`` are
    llama.cpp's text encoded by our tokenizer, ``extra["tokens"]`` the count llama.cpp made."""
    tools = find_tools(bin_dir)
    ggufs = resolve_ggufs(gguf_spec, tools, manifest, say)
    common = ["--temp", "0", "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size)]
    modes = {}
    for label, path in ggufs.items():
        cmd = [str(tools["completion"]), "-m", str(path), "-no-cnv", "--no-display-prompt", "--simple-io"]
        modes[f"llamacpp_{label}"] = LlamaRunner(cmd, common, codec, spec=False)
    if draft and not Path(draft).expanduser().is_file():
        raise SpecDecError(f"--llama-draft {draft}: no such file")
    if draft and "speculative" in tools:
        label = "f32" if "f32" in ggufs else next(iter(ggufs))  # our spec: the f32 target
        cmd = [str(tools["speculative"]), "-m", str(ggufs[label]), "-md", str(Path(draft).expanduser())]
        cmd += ["-td", str(threads), "-tbd", str(threads), *_spec_type(tools["speculative"])]
        modes[f"llamacpp_{label}_spec"] = LlamaRunner(cmd, common, codec, spec=True)
    elif draft:
        say(f"no {' or '.join(SPECULATIVE_TOOLS)} in {tools['completion'].parent}: no llama.cpp speculative mode")
    info = {
        "bin_dir": str(Path(bin_dir).expanduser()),
        "tools": {k: v.name for k, v in tools.items()},
        "gguf": {k: str(v) for k, v in ggufs.items()},
        "draft": draft,
        "threads": threads,
        "ctx_size": ctx_size,
        "version": _version(tools["completion"]),
    }
    return modes, info


class LlamaRunner:
    """A bench runner over one llama.cpp tool: ``cmd`` (the tool and its model flags) with
    ``common`` flags, the prompt given as text (our ids decoded by ``codec``); ``spec``: a
    speculative tool (its own timing lines, and it echoes the prompt)."""

    def __init__(self, cmd: list[str], common: list[str], codec: TextCodec, *, spec: bool) -> None:
        self.cmd, self.common, self.codec, self.spec = cmd, common, codec, spec

    async def __call__(self, ids: list[int], n: int) -> tuple[list[int], float, None, dict[str, Any]]:
        import anyio

        codec = self.codec
        text_ids = list(ids)
        if codec.add_bos and text_ids and text_ids[0] == codec.bos_id:
            text_ids = text_ids[1:]  # llama.cpp adds the BOS itself, as the GGUF says
        prompt = codec.tokenizer.decode(text_ids, skip_special_tokens=False)
        proc = await anyio.run_process(
            [*self.cmd, "-p", prompt, "-n", str(n), *self.common], check=False, stdin=subprocess.DEVNULL
        )
        out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        if proc.returncode != 0:
            raise SpecDecError(f"{Path(self.cmd[0]).name} {_exit_words(proc.returncode)}: {_tail(err)}")
        timing = parse_speculative(out + err) if self.spec else parse_completion(err + out)
        # the speculative tools echo the prompt as they tokenized it: with the BOS they added
        echo = codec.tokenizer.decode(list(ids), skip_special_tokens=False)
        text = _generated_text(out, echo if self.spec else None)
        new: list[int] = codec.tokenizer.encode(text, add_special_tokens=False).ids
        extra = {
            "tokens": timing.generated,
            "text": text,
            "llama": asdict(timing),
            "decode_tokens_per_s": timing.decode_tokens_per_s,
            "prompt_tokens_ours": len(ids),
        }
        return new, timing.seconds, None, extra


def _generated_text(out: str, prompt: str | None) -> str:
    """stdout less llama.cpp's end marker (and, for the speculative tools, the echoed prompt)."""
    text = out.strip("\n") if prompt is not None else out
    if prompt is not None and text.startswith(prompt):
        text = text[len(prompt) :]
    text = text.rstrip()
    return text[: -len("[end of text]")].rstrip() if text.endswith("[end of text]") else text


def _spec_type(tool: Path) -> list[str]:
    """New trees speculate only when told how (``--spec-type``, default none); old ones lack it."""
    proc = subprocess.run([str(tool), "--help"], capture_output=True, text=True, timeout=30)
    return ["--spec-type", "draft-simple"] if "--spec-type" in proc.stdout + proc.stderr else []


def _version(tool: Path) -> str | None:
    try:
        proc = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version: ([^\n]+)", proc.stdout + proc.stderr)
    return m.group(1) if m else None


def summarize_llamacpp(samples: list[Sample], codec: TextCodec) -> list[dict[str, Any]]:
    """Medians per llama.cpp mode, and for our ``ar`` / ``spec`` too, per prompt: end-to-end and
    decode-only tokens/s, ours/theirs ratios, and whether the text equals our ``ar`` text (over
    the shorter of the two)."""
    by = {(s.mode, s.prompt, s.repeat): s for s in samples}  # ratios pair the runs of one pass
    ar_text = {p: codec.decode(s.token_ids) for (m, p, _), s in by.items() if m == "ar"}
    rows: list[dict[str, Any]] = []
    for mode in dict.fromkeys(s.mode for s in samples):
        if not (mode in ("ar", "spec") or mode.startswith("llamacpp_")):
            continue
        xs = [s for s in samples if s.mode == mode]
        row: dict[str, Any] = {
            "mode": mode,
            "tokens_per_s": statistics.median(s.tokens_per_s for s in xs),
            "decode_tokens_per_s": statistics.median(_decode_tps(s) for s in xs),
            "n": len(xs),
        }
        if mode.startswith("llamacpp_"):
            for ours in ("ar", "spec"):
                r = [
                    by[ours, s.prompt, s.repeat].tokens_per_s / s.tokens_per_s
                    for s in xs
                    if (ours, s.prompt, s.repeat) in by
                ]
                row[f"{ours}_vs_this"] = statistics.median(r) if r else None
            extras = [(s.prompt, s.extra or {}) for s in xs]  # a llama.cpp runner's details: always there
            same = [_agree(extra["text"], ar_text[prompt]) for prompt, extra in extras if prompt in ar_text]
            row["same_text_as_ar"] = f"{sum(same)}/{len(same)}" if same else None
            row["prompt_tokens_match"] = all(
                extra["llama"]["prompt_tokens"] == extra["prompt_tokens_ours"] for _, extra in extras
            )
        rows.append(row)
    return rows


def _agree(a: str, b: str) -> bool:
    """Same text over the shorter one (llama.cpp's speculative tools overshoot ``-n`` a little)."""
    a, b = a.strip(), b.strip()
    return a.startswith(b) or b.startswith(a)


def _decode_tps(s: Sample) -> float:
    """Tokens/s after the first emission: llama.cpp's eval phase; ours after the first round."""
    if s.extra and "decode_tokens_per_s" in s.extra:
        return float(s.extra["decode_tokens_per_s"])
    st = s.stats
    if st is None or st.time_to_first_token is None or not st.history:
        return 0.0
    t = st.time_total - st.time_to_first_token
    return (st.new_tokens - st.history[0].emitted) / t if t > 0 else 0.0


def format_llamacpp(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per mode, ours/theirs ratios on the llama.cpp rows."""

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| mode | tok/s end to end (median) | tok/s decode only | our ar / this | our spec / this "
        "| same text as our ar |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['mode']}` | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
            f"{f(r.get('ar_vs_this'), '.2f')} | {f(r.get('spec_vs_this'), '.2f')} | "
            f"{r.get('same_text_as_ar') or '-'} |"
        )
    return "\n".join(lines)
