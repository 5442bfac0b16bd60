"""`ServerAudit`: one tamper-evident audit record per engine request (`--audit-log`).

Every engine request a job starts is watched by a `RequestAudit`: it sees each output before the
handler does, joins the samples, and on the request's end (finished, abort, error) submits one
`AuditRecord` to the `AuditWriter` (a bounded, never-raising `submit`). A generation request
answered with an error status gets an `AuditRefusal` (`refused`, called by the server's
`sits.server.audit_refusals` middleware), so the log accounts for every request a tenant sent.

Invariants:
- the engine is asked for `max(user's logprobs, top_k)` logprobs; `trim` cuts every output
  back to what the user asked (None, or the chosen token plus the user's top N), so responses
  are byte-identical with auditing off;
- exactly one record per engine request: `finish` is idempotent;
- a traced request's records carry its trace id (`RequestTrace.trace_id`); None untraced;
- with `--precision-switch`, a record carries the weight set of the request's latest output
  and the number of switches while it ran (`RequestOutput.precision`,
  `RequestOutput.num_precision_switches`, as the engine counted them); None and 0 without;
- the weights digest (`weights_digest`) is computed once in a thread started at `start()`;
  records finished before it is known are submitted from that thread when it is;
- `close()` waits for the digest, then closes the writer (after the server's drain), which
  writes the shutdown checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from sits.core.outputs import CompletionOutput, RequestOutput
from sits.core.sampling_params import SamplingParams
from sits.obs import (
    AuditKey,
    AuditRecord,
    AuditRefusal,
    AuditTimings,
    AuditWriter,
    AuditWriterConfig,
    samples_from_outputs,
    to_jsonable,
)

logger = logging.getLogger(__name__)

UNKNOWN_DIGEST = "unknown"
# The request-state attribute holding the job id of a request whose engine requests are
# watched (so their records exist): set by the serving code, read by the refusal middleware.
AUDITED_STATE_KEY = "sits_audited_job"
_HASH_CHUNK_BYTES = 1 << 20


def weights_digest(model_dir: str | None) -> str:
    """SHA-256 hex over the hex SHA-256s of the `*.safetensors` files of `model_dir`, sorted
    by file name (each file hash hashed as ASCII, in order). "unknown" without such files."""
    if not model_dir or not os.path.isdir(model_dir):
        return UNKNOWN_DIGEST
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        return UNKNOWN_DIGEST
    outer = hashlib.sha256()
    for name in names:
        inner = hashlib.sha256()
        with open(os.path.join(model_dir, name), "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                inner.update(chunk)
        outer.update(inner.hexdigest().encode("ascii"))
    return outer.hexdigest()


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """The audit options of `sits serve`.

    Attributes:
        path: the log file (`--audit-log`).
        top_logprobs: alternatives kept per generated token (`--audit-top-logprobs`, >= 0).
        max_file_bytes: rotate past this size (`--audit-max-file-bytes`); None = writer default.
        store_input: store the input text itself for every tenant (`--audit-store-input`).
        key: the audit key (`--audit-key-file`, loaded by `sits.obs.audit_keys.load_key_file`);
            None = an unkeyed log.
        checkpoint_path: the checkpoint file (`--audit-checkpoint-file`); None = none.
        checkpoint_every_records: records between checkpoints (`--audit-checkpoint-interval`).
    """

    path: str
    top_logprobs: int = 5
    max_file_bytes: int | None = None
    store_input: bool = False
    key: AuditKey | None = field(default=None, repr=False)
    checkpoint_path: str | None = None
    checkpoint_every_records: int = 100


def trim_logprobs(output: RequestOutput, user_params: SamplingParams) -> RequestOutput:
    """`output` with its samples' logprobs cut back to what `user_params` asked for.

    None when the user asked none; else per position the chosen token (first key) and the
    entries ranked within the user's top N, in the engine's order.
    """
    num_top = user_params.logprobs
    outputs = []
    for sample in output.outputs:
        if sample.logprobs is None:
            outputs.append(sample)
            continue
        if num_top is None:
            outputs.append(dataclasses.replace(sample, logprobs=None, cumulative_logprob=None))
            continue
        trimmed = []
        for position in sample.logprobs:
            items = list(position.items())
            keep = dict(items[:1])
            for tid, lp in items[1:]:
                if lp.rank is not None and lp.rank <= num_top:
                    keep[tid] = lp
            trimmed.append(keep)
        outputs.append(dataclasses.replace(sample, logprobs=trimmed))
    return dataclasses.replace(output, outputs=outputs)


class ServerAudit:
    """The audit log of one server: writer, weights digest and per-request watchers.

    Args:
        settings: the audit options.
        model_name: the served model name (records' `model`).
        model_dir: the checkpoint directory hashed for the weights digest.

    Raises (start):
        AuditLogError, OSError: the log cannot be opened (see `AuditWriter`).
    """

    def __init__(self, settings: AuditSettings, model_name: str, model_dir: str | None) -> None:
        self.settings = settings
        self.model_name = model_name
        self.model_dir = model_dir
        self.writer: AuditWriter | None = None
        self._digest: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Open the writer and start hashing the weights in a thread."""
        settings = self.settings
        kwargs = {}
        if settings.max_file_bytes is not None:
            kwargs["max_file_bytes"] = settings.max_file_bytes
        config = AuditWriterConfig(
            path=settings.path,
            key=settings.key,
            checkpoint_path=settings.checkpoint_path,
            checkpoint_every_records=settings.checkpoint_every_records,
            **kwargs,
        )
        self.writer = AuditWriter(config)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "sits-audit-digest")
        self._digest = self._executor.submit(self._compute_digest)

    def _compute_digest(self) -> str:
        try:
            return weights_digest(self.model_dir)
        except OSError:
            logger.exception("cannot hash the weights in %s", self.model_dir)
            return UNKNOWN_DIGEST

    async def close(self) -> None:
        """Wait for the digest (pending records), then flush and close the writer."""
        if self.writer is None:
            return
        await asyncio.wrap_future(self._digest)
        assert self._executor is not None
        self._executor.shutdown(wait=True)
        await asyncio.to_thread(self.writer.close)

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """The params sent to the engine: logprobs raised to `top_logprobs` when below."""
        k = self.settings.top_logprobs
        if params.logprobs is not None and params.logprobs >= k:
            return params
        return dataclasses.replace(params, logprobs=k)

    def watch(
        self,
        request_id: str,
        tenant_id: str,
        token_ids: list[int],
        text: str | None,
        params: SamplingParams,
        trace_id: str | None = None,
    ) -> RequestAudit:
        """A watcher for one engine request (`params` are the user's; `trace_id` the W3C trace
        id, 32 lowercase hex digits, of the HTTP request when tracing is on, else None)."""
        return RequestAudit(self, request_id, tenant_id, token_ids, text, params, trace_id)

    def submit(self, record: AuditRecord) -> None:
        """Submit `record` with the weights digest (from the digest thread when not known)."""
        writer = self.writer
        assert writer is not None

        def done(fut: concurrent.futures.Future[str]) -> None:
            writer.submit(dataclasses.replace(record, weights_digest=fut.result()))

        self._digest.add_done_callback(done)

    def refused(
        self,
        *,
        tenant_id: str | None,
        route: str,
        status: int,
        error: dict[str, object] | None,
        job_id: str | None = None,
        trace_id: str | None = None,
    ) -> None:
        """Submit the record of a generation request answered with error `status`.

        Args:
            tenant_id: the authenticated tenant; None when authentication failed.
            route: method and path ("POST /v1/completions").
            status: the HTTP status sent.
            error: the OpenAI error object of the body (`{"message", "type", "param",
                "code"}`); None when the body held none.
            job_id: the job's id when the engine had started the request (its records share
                it); None gives the record a fresh id.
            trace_id: the W3C trace id (32 hex) when traced.
        """
        writer = self.writer
        if writer is None:
            return
        error = error or {}

        def text(name: str) -> str | None:
            value = error.get(name)
            return None if value is None else str(value)

        writer.submit(
            AuditRefusal(
                request_id=job_id or f"refused-{secrets.token_hex(12)}",
                tenant=tenant_id,
                route=route,
                status=status,
                error_type=text("type"),
                error_code=text("code"),
                error_param=text("param"),
                message=text("message"),
                unix_s=time.time(),
                engine_started=job_id is not None,
                trace_id=trace_id,
            )
        )


class RequestAudit:
    """Watches one engine request and submits its record once (see the module docstring)."""

    def __init__(
        self,
        audit: ServerAudit,
        request_id: str,
        tenant_id: str,
        token_ids: list[int],
        text: str | None,
        params: SamplingParams,
        trace_id: str | None = None,
    ) -> None:
        self.audit = audit
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.token_ids = list(token_ids)
        self.text = text
        self.params = params
        self.trace_id = trace_id
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        self.samples = [CompletionOutput(index=i) for i in range(params.n)]
        self.precision: str | None = None
        self.num_precision_switches = 0
        self._done = False

    def on_output(self, output: RequestOutput) -> RequestOutput:
        """Join one DELTA output (with the audit's logprobs); return it trimmed for the user."""
        if output.metrics is not None:
            self.arrival_s = output.metrics.arrival_time
            self.first_token_s = output.metrics.first_token_time
        self.precision = output.precision or self.precision
        self.num_precision_switches = output.num_precision_switches
        for delta in output.outputs:
            self.samples[delta.index].add_delta(delta)
        if output.finished:
            self.finish(None)
        return trim_logprobs(output, self.params)

    def finish(self, reason: str | None) -> None:
        """Submit the record (once); `reason` ("abort", "error") marks unfinished samples."""
        if self._done:
            return
        self._done = True
        if self.first_token_s is None and any(s.token_ids for s in self.samples):
            self.first_token_s = time.monotonic()
        for sample in self.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason
        settings = self.audit.settings
        record = AuditRecord(
            request_id=self.request_id,
            tenant=self.tenant_id,
            model=self.audit.model_name,
            weights_digest=UNKNOWN_DIGEST,
            prompt_token_ids=tuple(self.token_ids),
            input_text=self.text,
            store_input=settings.store_input,
            sampling=to_jsonable(self.params),
            samples=samples_from_outputs(self.samples, settings.top_logprobs),
            timings=AuditTimings.from_monotonic(self.arrival_s, self.first_token_s, None),
            trace_id=self.trace_id,
            precision=self.precision,
            precision_switches=self.num_precision_switches,
        )
        self.audit.submit(record)
