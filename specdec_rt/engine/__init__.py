"""The Engine: one batched step loop over a target and its drafter, streams, warm-up, loading.

``Engine``, ``EngineResult`` and ``StreamEvent`` are imported on first use (they bring in ONNX
Runtime through the factory).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name in ("EngineResult", "StreamEvent"):
        from . import stream

        return {"EngineResult": stream.EngineResult, "StreamEvent": stream.StreamEvent}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "EngineResult", "StreamEvent"]
