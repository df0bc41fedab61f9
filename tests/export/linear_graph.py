"""One linear layer as the graph builder emits it, in an ONNX Runtime session (for the tests of
weight layouts: grids, scale types)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from export.graph import _Graph
from export.quant import QuantSpec
from export.weights import ExternalDataWriter


def linear_session(tmp_path: Path, w: np.ndarray, spec: QuantSpec) -> tuple[Any, _Graph]:
    """``y = x @ w`` (x ``[1, N, w.shape[0]]``) built by ``_Graph.linear`` under ``spec``, saved to
    ``tmp_path``; the session and the builder (its grids, forms and scale types)."""
    with ExternalDataWriter(tmp_path / "m.onnx.data") as data:
        g = _Graph(data, spec, 1e-6)
        g.linear("x", w, "/lin", out="y")
    graph = helper.make_graph(
        g.nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "N", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "N", w.shape[1]])],
        initializer=g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    onnx.save_model(model, str(tmp_path / "m.onnx"))
    return ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]), g
