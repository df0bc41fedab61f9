"""``precision="auto"`` on a base model without a chat template (Gemma 3 270M's GGUF has none):
the tune measures on its prompts as plain text instead of refusing every configuration (which
left ``serve --model gemma3-270m`` unable to start)."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from specdec_rt import Engine  # noqa: E402
from specdec_rt.engine import tune  # noqa: E402
from specdec_rt.engine.factory import home_manifest  # noqa: E402

pytestmark = pytest.mark.export


def test_tune_measures_a_model_without_a_chat_template(tiny_gemma3):
    folder = tiny_gemma3
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
