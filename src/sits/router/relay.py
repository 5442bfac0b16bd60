"""Relaying a replica's event stream to the client, frame by frame, as the frames arrive.

`StreamRelay` splits the replica's raw bytes into whole SSE frames (`data: ...\\n\\n`) and hands
each on at once (a frame is held only until its last byte arrives, so the client never gets half
a frame, and an error event can always follow). On the way it notes what the router needs: the
time of the first and last frames (TTFT and TPOT for the predictor and the canary), the stream's
`usage` (for the tenant's token budget), and removes the usage chunk when the router asked for it
on the client's behalf. A stream that breaks after frames were sent is never replayed elsewhere
(its tokens would be duplicated): it ends with an OpenAI error event and `data: [DONE]`, as
`sits serve` ends a failed stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from sits.admission import Clock
from sits.router.attempt import error_code
from sits.server.errors import ServerError, error_body
from sits.server.jobs import DONE_EVENT, sse_event

_DONE_FRAME = DONE_EVENT.encode()
_USAGE_MARK = b'"choices":[]'
_ERROR_MARK = b'data: {"error"'


class StreamRelay:
    """The frames of one upstream stream.

    Args:
        first_chunk: the bytes already read by the attempt.
        chunks: the rest of the upstream body.
        clock: time source of the frame times.
        strip_usage: drop the usage-only chunk (the client did not ask for it).
        on_first_frame: called with the first data frame's clock time as it passes (the TTFT
            reaches the predictor before the stream ends).

    Attributes (read after the stream ends):
        first_frame_s, last_frame_s: clock times of the first and last data frames.
        num_frames: data frames relayed (not counting [DONE]).
        total_tokens: the usage chunk's `total_tokens`, or None.
        failed: the upstream broke off before [DONE], or sent an error event (other than a
            drain's).
        saw_done: the upstream's `data: [DONE]` arrived.
    """

    def __init__(
        self,
        first_chunk: bytes,
        chunks: AsyncIterator[bytes],
        clock: Clock,
        *,
        strip_usage: bool,
        on_first_frame: Callable[[float], None] | None = None,
    ) -> None:
        self._first = first_chunk
        self._chunks = chunks
        self._clock = clock
        self._strip_usage = strip_usage
        self._on_first_frame = on_first_frame
        self.first_frame_s: float | None = None
        self.last_frame_s: float | None = None
        self.num_frames = 0
        self.total_tokens: int | None = None
        self.failed = False
        self.saw_done = False

    def tpot_s(self) -> float | None:
        """Mean seconds between data frames after the first; None with fewer than 3 frames."""
        if self.num_frames < 3 or self.first_frame_s is None or self.last_frame_s is None:
            return None
        return (self.last_frame_s - self.first_frame_s) / (self.num_frames - 1)

    async def frames(self) -> AsyncIterator[bytes | str]:
        """The client's frames; ends with an error event if the upstream breaks off.

        Fast path: a chunk that holds only whole token frames (the usual case: the replica
        flushes one event per write) passes on as it came, with no split or copy."""
        buffer = b""
        pending = self._first
        while True:
            if pending and not buffer and _plain(pending):
                self._note_frames(pending.count(b"\n\n"))
                yield pending
            elif pending:
                buffer += pending
                while True:
                    end = buffer.find(b"\n\n")
                    if end < 0:
                        break
                    frame, buffer = buffer[: end + 2], buffer[end + 2 :]
                    out = self._take(frame)
                    if out is not None:
                        yield out
            try:
                pending = await anext(self._chunks)
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.failed = True
                yield _cut_frame(f"{type(exc).__name__}")
                yield DONE_EVENT
                return
        if not self.saw_done:
            self.failed = True
            yield _cut_frame("the stream ended without [DONE]")
            yield DONE_EVENT

    def _take(self, frame: bytes) -> bytes | None:
        if frame.strip() == _DONE_FRAME.strip():
            self.saw_done = True
            return frame
        if frame.startswith(_ERROR_MARK) and _error_code(frame) != "draining":
            self.failed = True  # the replica failed the stream itself (its breaker counts it)
        if _USAGE_MARK in frame:
            usage = _usage_of(frame)
            if usage is not None:
                total = usage.get("total_tokens")
                if isinstance(total, int):
                    self.total_tokens = total
                if self._strip_usage:
                    return None
        self._note_frames(1)
        return frame

    def _note_frames(self, num_frames: int) -> None:
        now_s = self._clock.monotonic()
        if self.first_frame_s is None:
            self.first_frame_s = now_s
            if self._on_first_frame is not None:
                self._on_first_frame(now_s)
        self.last_frame_s = now_s
        self.num_frames += num_frames


def _plain(chunk: bytes) -> bool:
    """True for a chunk of whole token frames with nothing the relay must look at (no [DONE],
    usage chunk or error event)."""
    return (
        chunk.endswith(b"\n\n")
        and _USAGE_MARK not in chunk
        and b"[DONE]" not in chunk
        and b'{"error"' not in chunk
    )


def _usage_of(frame: bytes) -> dict[str, Any] | None:
    """The `usage` object of a usage-only chunk frame, else None."""
    text = frame.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    try:
        chunk = json.loads(text[5:])
    except ValueError:
        return None
    if (
        isinstance(chunk, dict)
        and chunk.get("choices") == []
        and isinstance(chunk.get("usage"), dict)
    ):
        return chunk["usage"]
    return None


def _error_code(frame: bytes) -> str | None:
    """The `error.code` of an error event frame, or None."""
    return error_code(frame.decode("utf-8", "replace").strip()[5:].encode())


def _cut_frame(why: str) -> str:
    """The error event of a stream whose replica broke off after tokens were sent."""
    err = ServerError(
        502,
        f"The replica serving this stream failed ({why}); the tokens sent so far are all there "
        "is. Retry the request.",
        type="service_unavailable_error",
        code="replica_failed",
    )
    return sse_event(error_body(err))
