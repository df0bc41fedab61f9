"""An OpenAI-compatible HTTP server over :class:`specdec_rt.Engine` (``python -m specdec_rt serve``).

Needs the ``serve`` extra (Starlette, uvicorn, prometheus-client); importing ``specdec_rt`` does
not. ``create_app(engine_or_loader, AppConfig(...))`` (or its fields by keyword) builds the ASGI app to run under
any ASGI server or to test with ``httpx.ASGITransport``; see docs/serving.md.
"""

from typing import Any

__all__ = ["create_app", "begin_drain"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # Starlette is imported only when the app is built
        from . import app

        return {"create_app": app.create_app, "begin_drain": app.begin_drain}[name]
    raise AttributeError(f"module 'specdec_rt.serve' has no attribute {name!r}")
