"""What the client measured for one request: the input of every metric.

Invariants (kept by `sits.bench.client`): times are seconds on one monotonic clock
(`time.perf_counter`), `arrival_s` and `start_s` are offsets from the run's start, and
`ttft_s <= e2e_s` whenever both are set; `itl_s` holds one gap per content chunk after the
first, so `len(itl_s) == num_chunks - 1`. Failed requests keep whatever was measured before the
failure, but metrics only read the timings of successful ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request's measurements.

    Attributes:
        index: position in the run's schedule (0-based, in arrival order).
        tenant: the client tenant that sent it ("default" outside a tenants mix).
        arrival_s: scheduled send time, seconds after the run's start.
        input_len: prompt length asked for, in tokens.
        output_len: `max_tokens` sent.
        slo_ttft_ms, slo_tpot_ms: the request's SLOs in milliseconds; None = no such SLO.
        start_s: actual send time, seconds after the run's start (later than `arrival_s` when
            `--max-concurrency` held it back).
        ok: the server answered 200 and the stream ended normally.
        status: HTTP status; None when no response arrived (connection error, timeout).
        error: why it failed (the server's error message or the exception); None when ok.
        prompt_tokens: prompt tokens from the usage chunk; None when the server sent none.
        output_tokens: completion tokens from the usage chunk, else the content chunks counted.
        num_chunks: content chunks received (chunks with non-empty text).
        ttft_s: time to the first content chunk, from `start_s`; None if none came.
        e2e_s: time to the end of the stream (or to the failure), from `start_s`.
        itl_s: gaps between consecutive content chunks, in seconds.
        connect_s: time to the TCP connection's establishment (httpx's trace), from `start_s`;
            None when none was made. The kernel completes the handshake before the server
            accepts, so a wait in the accept queue shows in the report's TTFT outside the server
            (`sits.bench.report.outside_server_ms`), not here
            (only an overflowing queue, through SYN retries, makes connect slow).
        sent_s: time until the request's body was written, from `start_s`; None if never.
        processing_s: the server's `openai-processing-ms` header (receipt -> response start:
            the TTFT from receipt for a sits stream); None when the server sent none.
    """

    index: int
    tenant: str
    arrival_s: float
    input_len: int
    output_len: int
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    start_s: float = 0.0
    ok: bool = False
    status: int | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    num_chunks: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    connect_s: float | None = None
    sent_s: float | None = None
    processing_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), seconds.

        None unless the request succeeded with at least two output tokens.
        """
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values (times in milliseconds, like the summaries)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000.0, 3)

        tpot = self.tpot_s
        return {
            "index": self.index,
            "tenant": self.tenant,
            "arrival_ms": ms(self.arrival_s),
            "start_ms": ms(self.start_s),
            "input_len": self.input_len,
            "output_len": self.output_len,
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "num_chunks": self.num_chunks,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(tpot),
            "e2e_ms": ms(self.e2e_s),
            "connect_ms": ms(self.connect_s),
            "sent_ms": ms(self.sent_s),
            "processing_ms": ms(self.processing_s),
            "itl_ms": [ms(gap) for gap in self.itl_s],
        }
