"""A paced fake replica: an OpenAI-compatible streaming server with a fixed TTFT and ITL.

Benchmarks and tests of `sits router` need replicas whose own latency is known exactly and
costs almost no CPU, so that what is measured is the router. This server answers like
`sits serve` in shape:
- `GET /health` -> 200 `{"status": "ok"}`; `GET /v1/models` -> one model card
  (`id`, `max_model_len`);
- `POST /v1/completions` and `/v1/chat/completions`: n = min(`max_tokens`, `output_len`)
  tokens (`output_len` when the request gives no positive integer `max_tokens`). A stream
  (`"stream": true`) sends token chunk i (0-based) at `ttft_ms + i * itl_ms` after the request
  arrived (absolute times on the event loop's clock, so the spacing does not drift with load),
  then a usage chunk when `stream_options.include_usage` is true, then `data: [DONE]`. A
  non-streamed request gets one JSON answer at the time the last token would have been sent.
Frames are compact JSON (`sits.server.jobs.sse_event`), as `sits serve` sends them. The prompt's
token count is the number of ids of a token-id prompt, else the number of whitespace-separated
words (a text prompt, or the chat messages' contents). Every other request field is accepted and
ignored. No tokenizer, no model: it imports neither torch nor the engine.

Run: `python -m sits.testing.fake_replica --port 8001 [--ttft-ms 50] [--itl-ms 20]
[--output-len 32] [--model fake]` (binds 127.0.0.1 unless --host says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sits.server.jobs import DONE_EVENT, sse_event

DEFAULT_MODEL = "fake"


@dataclass(frozen=True, slots=True)
class FakeReplicaConfig:
    """How the fake replica answers.

    Attributes:
        model: the served model's name (`/v1/models`, the chunks' `model`).
        ttft_ms: milliseconds from a request's arrival to its first token chunk (>= 0).
        itl_ms: milliseconds between consecutive token chunks (>= 0).
        output_len: tokens per answer when the request asks for more or names no `max_tokens`
            (>= 1).
        max_model_len: the context length its model card advertises (tokens, >= 1).

    Raises:
        ValueError: a value out of range (the message names the field).
    """

    model: str = DEFAULT_MODEL
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    output_len: int = 32
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("output_len", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.model:
            raise ValueError("model must not be empty")


def num_output_tokens(body: dict[str, Any], output_len: int) -> int:
    """Tokens of the answer: min(`max_tokens`, `output_len`), `output_len` without a positive
    integer `max_tokens`."""
    asked = body.get("max_tokens")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1:
        return min(asked, output_len)
    return output_len


def num_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's token count as this fake counts it (see the module docstring)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(m["content"].split())
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    return 0


class _Answerer:
    """Builds the frames and bodies of one endpoint's answers."""

    def __init__(self, config: FakeReplicaConfig, chat: bool) -> None:
        self.config = config
        self.chat = chat
        self._ids = itertools.count()

    def _chunk(self, rid: str, created: int, i: int, last: bool) -> dict[str, Any]:
        finish = "length" if last else None
        if self.chat:
            delta: dict[str, Any] = {"content": f" t{i}"}
            if i == 0:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.config.model,
            "choices": [choice],
        }

    async def answer(self, body: dict[str, Any]) -> Response:
        arrived_s = asyncio.get_running_loop().time()
        n = num_output_tokens(body, self.config.output_len)
        prompt_tokens = num_prompt_tokens(body)
        rid = f"{'chatcmpl' if self.chat else 'cmpl'}-fake-{next(self._ids)}"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }
        if body.get("stream") is True:
            options = body.get("stream_options")
            with_usage = isinstance(options, dict) and options.get("include_usage") is True
            frames = self._frames(rid, arrived_s, n, usage if with_usage else None)
            return StreamingResponse(frames, media_type="text/event-stream")
        await _sleep_until(arrived_s + self._token_s(n - 1))
        text = "".join(f" t{i}" for i in range(n))
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        kind = "chat.completion" if self.chat else "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": int(time.time()),
                "model": self.config.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _token_s(self, i: int) -> float:
        """Seconds from arrival to token chunk i."""
        return (self.config.ttft_ms + i * self.config.itl_ms) / 1000.0

    async def _frames(
        self, rid: str, arrived_s: float, n: int, usage: dict[str, int] | None
    ) -> AsyncIterator[str]:
        created = int(time.time())
        for i in range(n):
            await _sleep_until(arrived_s + self._token_s(i))
            yield sse_event(self._chunk(rid, created, i, last=i == n - 1))
        if usage is not None:
            yield sse_event(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.config.model,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield DONE_EVENT


async def _sleep_until(deadline_s: float) -> None:
    """Sleep until the event loop's clock reads `deadline_s` (at once if it already passed)."""
    await asyncio.sleep(max(0.0, deadline_s - asyncio.get_running_loop().time()))


def _endpoint(answerer: _Answerer) -> Callable[[Request], Awaitable[Response]]:
    """The route handler of one generation endpoint (400 for a body that is not an object)."""

    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            error = {
                "message": "The body must be a JSON object.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_json",
            }
            return JSONResponse({"error": error}, status_code=400)
        return await answerer.answer(body)

    return generate


def build_fake_replica_app(config: FakeReplicaConfig) -> FastAPI:
    """The fake replica's FastAPI app (routes in the module docstring)."""
    app = FastAPI(title="sits fake replica")
    card = {
        "id": config.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sits-fake",
        "max_model_len": config.max_model_len,
    }

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        app.add_api_route(path, _endpoint(_Answerer(config, chat)), methods=["POST"])
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the fake replica under uvicorn until SIGTERM/SIGINT; returns the exit code (2: a
    bad flag)."""
    import uvicorn

    defaults = FakeReplicaConfig()
    p = argparse.ArgumentParser(
        prog="python -m sits.testing.fake_replica",
        description="A paced fake OpenAI streaming replica (fixed TTFT and ITL).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default=defaults.model, help="model name (default %(default)s)")
    p.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms, help="(%(default)g)")
    p.add_argument("--itl-ms", type=float, default=defaults.itl_ms, help="(%(default)g)")
    p.add_argument("--output-len", type=int, default=defaults.output_len, help="(%(default)d)")
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    try:
        config = FakeReplicaConfig(
            model=args.model,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            output_len=args.output_len,
            max_model_len=args.max_model_len,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        build_fake_replica_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
