"""Fake OpenAI replicas and a loopback uvicorn runner for the router's tests.

`FakeReplica` answers /health, /v1/models, /v1/completions and /v1/chat/completions like
`sits serve` does in shape (a stream: a role chunk, one chunk per token, a usage chunk when
asked, [DONE]) and misbehaves on demand through `behaviour` ("ok", "draining", "engine_dead",
"status_500", "overloaded" = a 503 shedding, "hang", "cut:N" = stream N token chunks then
drop the connection, "sleep:S" = wait S seconds before answering). It records every request
it got. `serve(app)` runs an ASGI app under uvicorn on 127.0.0.1 on a free port in a thread,
and returns once it accepts connections.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class FakeReplica:
    """A scriptable replica (see the module docstring)."""

    model: str = "fake-model"
    num_tokens: int = 4
    behaviour: str = "ok"
    seen: list[dict[str, Any]] = field(default_factory=list)
    released: asyncio.Event | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            if self.behaviour == "draining":
                return _error(503, "draining")
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "max_model_len": 1024}]}

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.seen.append({"headers": dict(request.headers), "body": body})
            return await self._answer(body)

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        return app

    async def _answer(self, body: dict[str, Any]) -> Response:
        behaviour = self.behaviour
        if behaviour.startswith("sleep:"):
            await asyncio.sleep(float(behaviour.split(":")[1]))
        elif behaviour in ("draining", "engine_dead"):
            return _error(503, behaviour)
        elif behaviour == "status_500":
            return _error(500, "internal")
        elif behaviour == "overloaded":
            return _error(503, "overloaded")
        elif behaviour == "hang":
            await asyncio.sleep(3600)
        cut = int(behaviour.split(":")[1]) if behaviour.startswith("cut:") else None
        prompt_tokens = 3
        if not body.get("stream"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.num_tokens}
            usage["total_tokens"] = prompt_tokens + self.num_tokens
            text = "".join(f"t{i}" for i in range(self.num_tokens))
            return JSONResponse({"choices": [{"index": 0, "text": text}], "usage": usage})
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True
        return StreamingResponse(
            self._frames(prompt_tokens, include_usage, cut), media_type="text/event-stream"
        )

    async def _frames(self, prompt_tokens: int, include_usage: bool, cut: int | None) -> Any:
        yield _frame({"choices": [{"index": 0, "text": ""}], "usage": None})
        for i in range(self.num_tokens):
            if cut is not None and i == cut:
                raise ConnectionResetError("cut by the test")  # uvicorn drops the connection
            yield _frame({"choices": [{"index": 0, "text": f"t{i}"}], "usage": None})
            await asyncio.sleep(0)
        if include_usage:
            total = prompt_tokens + self.num_tokens
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.num_tokens}
            yield _frame({"choices": [], "usage": {**usage, "total_tokens": total}})
        yield "data: [DONE]\n\n"


def _frame(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _error(status: int, code: str) -> JSONResponse:
    body = {"error": {"message": code, "type": "service_unavailable_error", "param": None}}
    body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` on a free loopback port; yields its base URL; stops it at the end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # readiness: uvicorn sets it once it accepts connections
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until(predicate: Any, what: str, bound_s: float = 60.0) -> None:
    """Poll `predicate` until it holds (the router accounts a stream in its close callback, just
    after the client read the last byte); `bound_s` only guards against a hang."""
    end = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
