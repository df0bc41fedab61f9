"""``--kv-dtype float16``: the KV cache (and attention) in float16. The manifest says so, the
runtime's pool is half the bytes, the logits stay close to the float32-KV export of the same
checkpoint, and greedy speculative decoding is exact to this graph's own greedy decoding."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import export_tiny  # noqa: E402

from export.errors import UnsupportedModelError, UsageError  # noqa: E402
from export.graph import build_onnx  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.model_spec import ModelSpec  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402
from specdec_rt import SpecConfig  # noqa: E402
from specdec_rt.engine.engine import Engine  # noqa: E402

pytestmark = pytest.mark.export

PROMPTS = ["def add(a, b):", "Hello world! Hello world!", "the quick brown fox"]


@pytest.fixture(scope="module")
def half(tmp_path_factory) -> Path:
    """The tiny Llama of the ``tiny_llama`` fixture (same checkpoint), exported with a float16
    KV and an int4 quantized-copy draft."""
    return export_tiny(tmp_path_factory.mktemp("tiny-llama-kv16"), "llama", draft="int4", kv_dtype="float16")


def test_manifest_and_graph_say_float16(half):
    m = read_manifest(half)
    assert m["onnx"]["kv"]["dtype"] == "float16"
    assert "float16" in m["exact_to"]
    assert m["validation"]["greedy_agreement"] == 1.0
    graph = onnx.load(str(half / "model.onnx"), load_external_data=False).graph
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert kinds["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
    assert kinds["present.1.value"] == onnx.TensorProto.FLOAT16
    assert kinds["logits"] == onnx.TensorProto.FLOAT  # only attention changes type
    assert read_manifest(half / "draft-q4")["onnx"]["kv"]["dtype"] == "float16"


def test_pool_is_half_the_bytes(half, tiny_llama):
    pools = {}
    for folder in (half, tiny_llama):
        sess = KVSession(folder, read_manifest(folder), max_len=64)
        pool = sess.model.open_pool()
        pools[folder] = (pool.dtype, pool.slot_bytes, pool.token_bytes, pool.reserved_per_slot)
        sess.close()
    assert pools[half][0] == np.float16 and pools[tiny_llama][0] == np.float32
    assert [n * 2 for n in pools[half][1:]] == list(pools[tiny_llama][1:])
    assert pools[half][2] == 2 * 2 * 2 * 16 * 2  # layers x K, V x kv heads x head_dim x 2 bytes


def test_logits_stay_close_to_the_float32_kv_export(half, tiny_llama):
    ids = np.random.default_rng(7).integers(0, 384, 48)
    got = {}
    for folder in (half, tiny_llama):
        sess = KVSession(folder, read_manifest(folder), max_len=64)
        prefill = sess.forward(ids[:40], 0)
        steps = [sess.forward(ids[i : i + 1], i)[0] for i in range(40, 48)]  # decode from the cache
        got[folder] = np.concatenate([prefill, np.stack(steps)])
        sess.close()
    diff = np.abs(got[half] - got[tiny_llama]).max()
    scale = np.abs(got[tiny_llama]).max()
    assert 0 < diff < 2e-2 * scale, (diff, scale)  # float16 changes something, but little
    assert (got[half].argmax(-1) == got[tiny_llama].argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("draft", ["q4", "ngram"])
def test_greedy_spec_equals_greedy_ar_of_the_float16_graph(half, draft):
    async def main() -> None:
        async with await Engine.load(half, draft=draft, spec_config=SpecConfig(measure_costs=False)) as engine:
            for prompt in PROMPTS:
                ar = await engine.generate(prompt, max_new_tokens=30, mode="ar")
                spec = await engine.generate(prompt, max_new_tokens=30)
                assert spec.token_ids == ar.token_ids, prompt
                assert spec.stats.rounds > 0 and spec.stats.mode == "spec"

    anyio.run(main)


def test_unknown_kv_dtype_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="'bfloat16'"):
        run(Request(src=str(tmp_path), out=tmp_path / "out", kv_dtype="bfloat16"), Reporter(quiet=True))


def test_alibi_refuses_a_float16_kv(tmp_path):
    """ALiBi's bias is a slope times the key's slot: float16 rounds it by up to 2 past 4,096."""
    spec = ModelSpec(
        family="bloom",
        num_layers=1,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=1,
        vocab_size=8,
        max_positions=64,
        rms_eps=1e-5,
        alibi="absolute",
    )
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        build_onnx(None, spec, tmp_path, kv_dtype="float16")
