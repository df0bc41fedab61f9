"""An Engine inside your own Starlette app (FastAPI is the same: it is Starlette underneath).

    pip install 'specdec-rt[serve]'
    uvicorn --factory starlette_embed:build_app --app-dir examples      # SPECDEC_MODEL=... for another model
    curl -sN localhost:8000/generate -d '{"prompt": "def fib(n):", "max_new_tokens": 48}'

The app's lifespan loads the engine at startup and closes it at shutdown. ``POST /generate``
streams plain text as it is generated; bad arguments and prompts too long for the model are a
400 (the engine checks them before any model work: ``stream.ready()``); a client that
disconnects cancels its request, and closing the stream frees its KV slots at once. For the
whole OpenAI API instead, mount ``specdec_rt.serve.create_app(engine)``.
"""

from __future__ import annotations

import contextlib
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specdec_rt import Engine, InvalidInputError

ARGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "mode", "stop")


def build_app(model: str | None = None, **load) -> Starlette:
    model = model or os.environ.get("SPECDEC_MODEL", "smollm2-135m")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with await Engine.load(model, **load) as engine:  # closed when the app stops
            app.state.engine = engine
            yield

    async def generate(request: Request):
        body = await request.json()
        engine: Engine = request.app.state.engine
        try:
            stream = engine.stream(body.get("prompt"), **{k: body[k] for k in ARGS if k in body})
        except InvalidInputError as exc:  # the arguments, checked at once
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            await stream.ready()  # the prompt, encoded and checked (too long for the model?)
        except InvalidInputError as exc:
            await stream.aclose()
            return JSONResponse({"error": str(exc)}, status_code=400)

        async def text():
            async with contextlib.aclosing(stream):  # however the response ends, the request ends
                async for event in stream:
                    yield event.text

        return StreamingResponse(text(), media_type="text/plain; charset=utf-8")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)
