"""The Engine: one batched step loop over a target and its drafter, streams, warm-up, loading.

``Engine``, ``EngineResult`` and ``StreamEvent`` are imported on first use (they bring in ONNX
Runtime through the factory).
"""

_LAZY = {"Engine": ".engine", "EngineResult": ".stream", "StreamEvent": ".stream"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "EngineResult", "StreamEvent"]
