"""``precision="auto"`` on a base model without a chat template (Gemma 3 270M's GGUF has none):
the tune measures on its prompts as plain text instead of refusing every configuration (which
left ``serve --model gemma3-270m`` unable to start)."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from tiny_models import build_tiny_gguf  # noqa: E402

from specdec_rt import Engine  # noqa: E402
from specdec_rt.engine import tune  # noqa: E402
from specdec_rt.engine.factory import home_manifest  # noqa: E402

pytestmark = pytest.mark.export


def test_tune_measures_a_model_without_a_chat_template(tmp_path):
    from export.pipeline import Request, run
    from export.ui import Reporter

    gguf_path = build_tiny_gguf(
        tmp_path / "gemma3.gguf",
        "gemma3_text",
        window=8,
        query_pre_attn_scalar=16,
        layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    folder = tmp_path / "onnx"
    run(Request(src=str(gguf_path), out=folder, draft_quant="int8", threads=1), Reporter(quiet=True))
    home = home_manifest(folder)
    assert home.chat_template is None
    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(
            folder, Engine.load, threads=1, slots=2, tokens=6, prompts=tune.TUNE_PROMPTS[:2], say=said.append
        )
    )
    assert len(result.rows) >= 2 and all(r.exact and r.tok_s_1 > 0 for r in result.rows), (result.rows, said)
    assert result.best is not None and not any(line.startswith("left out") for line in said)
