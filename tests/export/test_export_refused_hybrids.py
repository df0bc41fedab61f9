"""Families the graph has no block for are refused from their config alone, one line naming the
``model_type`` and why: the hybrids with state-space layers (Mamba, Jamba, Falcon-H1, Bamba,
Zamba, Granite 4 hybrids), convolution layers (LFM2), recurrent layers (RWKV, RecurrentGemma,
xLSTM), linear attention (Qwen3-Next) and multimodal towers, each with the
``config.json`` transformers writes for it (``AutoConfig.for_model(...).to_dict()``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from export.model_spec import SUPPORTED_FAMILIES  # noqa: E402

pytestmark = pytest.mark.export

CASES = {
    "mamba": "state-space layers",
    "mamba2": "state-space layers",
    "falcon_mamba": "state-space layers",
    "jamba": "state-space layers, mixture of experts",
    "falcon_h1": "state-space layers",
    "bamba": "state-space layers",
    "zamba": "state-space layers",
    "zamba2": "state-space layers",
    "granitemoehybrid": "state-space layers, mixture of experts",
    "lfm2": "convolution layers",
    "rwkv": "recurrent layers",
    "recurrent_gemma": "recurrent layers",
    "xlstm": "recurrent layers",
    "qwen3_next": "linear attention, mixture of experts",
    "lfm2_vl": "convolution layers, multimodal",  # its text model is LFM2
    "qwen2_vl": "multimodal",
    "llava": "multimodal",
    "mllama": "multimodal",
}


@pytest.mark.parametrize("family", list(CASES))
def test_each_hybrid_is_refused_naming_its_type_and_why(capsys, tmp_path, family):
    from transformers import AutoConfig

    from export.cli import main

    config = AutoConfig.for_model(family).to_dict()
    src = tmp_path / family
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    assert main([str(src), "--out", str(tmp_path / "o")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    model_type = config["model_type"]  # lfm2_vl's is "lfm2-vl"
    want = f"export: error: unsupported architecture {model_type} ({CASES[family]}); supported: "
    assert lines[0] == want + ", ".join(SUPPORTED_FAMILIES)
    assert not (tmp_path / "o").exists()
