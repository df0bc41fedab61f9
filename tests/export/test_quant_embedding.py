"""The embedding table of a quantized export (export.embedding.quantize_embedding): gathered by
GatherBlockQuantized from quantized blocks, no float32 copy; a tied table is the LM head's own
MatMulNBits blocks, stored once. Its rows are the dequantized blocks to the bit, so the graph's
logits equal those of the same graph gathering from the dequantized float32 table."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from export.embedding import EMBED_TABLE, quantize_embedding  # noqa: E402
from export.graph import _Graph  # noqa: E402
from export.grid import find_grid, grid_dequantize  # noqa: E402
from export.quant import QuantizedWeight, QuantSpec, dequantize, quantize  # noqa: E402
from export.weights import ExternalDataWriter  # noqa: E402

pytestmark = pytest.mark.export
MS = "com.microsoft"


def _session(nodes, inits, inputs, output: str):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])
    graph.initializer.extend(inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_gathers_exactly_the_dequantized_rows(bits, symmetric, block_size):
    rng = np.random.default_rng(bits + block_size)
    vocab, width = 300, 256
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    spec = QuantSpec(bits=bits, block_size=block_size, symmetric=symmetric)
    q = quantize(np.ascontiguousarray(table.T), spec)  # MatMulNBits' blocks of W = table.T
    rows = dequantize(q, spec).T  # [V, H]
    inits = [numpy_helper.from_array(q.packed.reshape(vocab, -1), "data"), numpy_helper.from_array(q.scales, "s")]
    inputs = ["data", "ids", "s"]
    if q.zero_points is not None:
        inits.append(numpy_helper.from_array(q.zero_points, "z"))
        inputs.append("z")
    node = helper.make_node(
        "GatherBlockQuantized", inputs, ["y"], domain=MS, bits=bits, block_size=block_size, gather_axis=0
    )
    ids = rng.integers(0, vocab, size=(2, 9))
    sess = _session([node], inits, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 9])], "y")
    np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], rows[ids])


def _q4_1_table(vocab=96, width=64, seed=0):
    """A float32 [V, H] table on Q4_1's grid (blocks of 32 along H): a weight with offsets."""
    t = np.random.default_rng(seed).standard_normal((vocab, width)).astype(np.float32) * 0.05
    kind = gguf.GGMLQuantizationType.Q4_1
    return gguf.quants.dequantize(gguf.quants.quantize(t, kind), kind).astype(np.float32)


@pytest.mark.parametrize("tied", [False, True])
def test_a_table_on_a_grid_with_offsets_is_gathered_exactly(tmp_path, tied):
    table = _q4_1_table()
    grid = find_grid(np.ascontiguousarray(table.T))
    assert grid is not None and grid.form == "q4_1" and grid.offsets is not None
    want = grid_dequantize(grid).T  # [V, H]: what MatMulNBits + offsets computes with
    with ExternalDataWriter(tmp_path / "m.onnx.data") as data:
        g = _Graph(data, QuantSpec(bits=4, source_grid=True), 1e-6)
        g.node("Gather", [EMBED_TABLE, "ids"], ["rows"], "/embed/Gather")
        if tied:
            g.linear("x", np.ascontiguousarray(table.T), "/lm_head", out="logits")
        record = quantize_embedding(g, table, table if tied else None)
    assert record["offsets"] is True and record["tied"] is tied and record["bits"] == 4
    assert EMBED_TABLE not in {t.name for t in g.inits}
    for t in g.inits:  # external data is read relative to the model: load it here
        if t.data_location == TensorProto.EXTERNAL:
            onnx.external_data_helper.load_external_data_for_tensor(t, str(tmp_path))
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
    ids = np.random.default_rng(1).integers(0, table.shape[0], size=(1, 11))
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 11])]
    inputs += [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 64])] if tied else []
    sess = _session(g.nodes, g.inits, inputs, "rows")  # the LM head's nodes too (tied: the same blocks)
    feed = {"ids": ids} | ({"x": np.zeros((1, 1, 64), np.float32)} if tied else {})
    np.testing.assert_array_equal(sess.run(["rows"], feed)[0], want[ids])


# -- whole exports --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("llama", "int8"), ("llama", "int4"), ("mistral", "int4")])
def export(request, tmp_path_factory):
    """A tiny export (llama: tied embeddings; mistral: its own LM head) and its quantization."""
    from tiny_models import export_tiny

    family, quant = request.param
    out = export_tiny(tmp_path_factory.mktemp(f"{family}-{quant}"), family, quantize=quant)
    return out, family, quant


def _external(folder) -> dict[str, tuple[int, int]]:
    """name -> (offset, length) of every initializer in ``model.onnx.data``."""
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    spans = {}
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            spans[t.name] = (int(info["offset"]), int(info["length"]))
    return spans


def test_the_float32_table_is_gone_and_a_tied_table_is_stored_once(export):
    folder, family, quant = export
    manifest = json.loads((folder / "manifest.json").read_text())
    vocab, width = manifest["architecture"]["vocab_size"], manifest["architecture"]["hidden_size"]
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    names = {t.name: t for t in proto.graph.initializer}
    assert EMBED_TABLE not in names
    assert not [
        t.name for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT and list(t.dims) == [vocab, width]
    ]
    (gather,) = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    assert gather.output[0] == "/embed/output" and gather.input[1] == "input_ids"
    spans = _external(folder)
    (head,) = [n for n in proto.graph.node if n.name == "/lm_head/MatMulNBits"]
    if family == "llama":  # tied: the LM head's bytes, read as [V, H * bits / 8]
        assert spans[gather.input[0]] == spans[head.input[1]] and gather.input[2] == head.input[2]
        assert list(names[gather.input[0]].dims) == [vocab, width * int(quant[3:]) // 8]
    else:
        assert gather.input[0] == "embed_tokens.weight_q" and spans[gather.input[0]] != spans[head.input[1]]
    # the data file is the distinct spans, page-aligned: nothing else, no float32 table
    distinct = sorted(set(spans.values()))
    assert (folder / "model.onnx.data").stat().st_size == distinct[-1][0] + distinct[-1][1]
    assert vocab * width * 4 not in [length for _, length in distinct]
    assert len(distinct) == len(spans) - (family == "llama")  # one span read twice when tied


def _float_table_folder(folder, dst):
    """A copy of ``folder`` whose graph gathers from the dequantized float32 table instead."""
    shutil.copytree(folder, dst)
    proto = onnx.load(str(folder / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    (gbq,) = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    attrs = {a.name: helper.get_attribute_value(a) for a in gbq.attribute}
    data, scales = inits[gbq.input[0]], inits[gbq.input[2]]
    zero_points = inits[gbq.input[3]] if len(gbq.input) > 3 else None
    vocab, n_blocks = scales.shape
    width = n_blocks * attrs["block_size"]
    q = QuantizedWeight(data.reshape(vocab, n_blocks, -1), scales, zero_points, width, vocab)
    table = dequantize(q, QuantSpec(bits=attrs["bits"], block_size=attrs["block_size"])).T  # [V, H]
    at = list(proto.graph.node).index(gbq)
    proto.graph.node.remove(gbq)
    proto.graph.node.insert(at, helper.make_node("Gather", ["float_table", "input_ids"], ["/embed/output"], "/embed/G"))
    proto.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table), "float_table"))
    (dst / "model.onnx.data").unlink()
    onnx.save_model(proto, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return dst


def test_logits_and_greedy_tokens_equal_those_of_the_dequantized_float_table(export, tmp_path):
    from export.validate import KVSession

    folder, _, _ = export
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("files")
    reference = _float_table_folder(folder, tmp_path / "float-table")
    sessions = [KVSession(f, manifest, max_len=64, threads=1) for f in (folder, reference)]
    toks = np.random.default_rng(5).integers(3, 300, size=24)
    got, want = (s.forward(toks, 0) for s in sessions)
    np.testing.assert_array_equal(got, want)  # the same float32 rows: the same logits, to the bit
    greedy = []
    for s in sessions:
        ids = [int(toks[-1])]
        for step in range(12):
            ids.append(int(s.forward(ids[-1:], len(toks) + step).argmax()))
        greedy.append(ids)
        s.close()
    assert greedy[0] == greedy[1]
