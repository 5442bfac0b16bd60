"""Audit record types, canonical encoding and the hash chain of the audit log.

One finished request becomes one JSON line (`AuditRecord`); a generation request answered with
an error status becomes one too (`AuditRefusal`); every file of the log starts with a header
record (`header_body`). The line is the canonical JSON of the record (`canonical_json`: sorted
keys, no spaces, UTF-8, no NaN) including three chain fields:

    seq       = the record's 0-based position in the whole chain (headers included)
    prev_hash = the `hash` of the previous line (GENESIS_HASH for the very first record)
    hash      = HMAC-SHA256(chain key, prev_hash + canonical_json(record without "hash"))
                with a key (`sits.obs.audit_keys`), else
                SHA-256(prev_hash + canonical_json(record without "hash")) (an unkeyed log)

The header names the chain ("hmac-sha256" with the key's `key_id`, or "sha256") and, unkeyed,
the file's random `input_salt`: records store their input text and prompt token ids as
HMAC-SHA256 under the key's input key, or under that salt (`InputDigest`), never as a plain
hash, so a guessed prompt cannot be confirmed without the key (or the log's salt).

Invariants:
- a line's bytes are exactly `canonical_json(record) + "\\n"`, so any changed byte either breaks
  the JSON, changes a value (hash mismatch), or makes the line non-canonical;
- a rotated series `PATH.1, PATH.2, ..., PATH.k, PATH` (oldest first, see `audit_series`) is one
  chain: the first record of each file (its header) chains to the last record of the file
  before it, and `seq` runs on across the files.

This module is pure (no I/O but `audit_series`); the writer thread and the verifier build on it.
It imports nothing from higher layers: engine objects are read through small Protocols.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from sits.core.errors import SitsError
from sits.obs.audit_keys import hmac_hex

GENESIS_HASH = "0" * 64
SCHEMA = "sits.audit/2"
HASH_FIELD = "hash"
PREV_HASH_FIELD = "prev_hash"
SEQ_FIELD = "seq"
KIND_FIELD = "kind"
HEADER_KIND = "header"
REQUEST_KIND = "request"
REFUSED_KIND = "refused"
KEYED_CHAIN = "hmac-sha256"
UNKEYED_CHAIN = "sha256"
SALT_BYTES = 32
MAX_REFUSAL_MESSAGE_CHARS = 500


class AuditLogError(SitsError):
    """The audit log cannot be opened, continued or read (missing, locked, corrupt tail)."""


def canonical_json(obj: Any) -> str:
    """The canonical JSON text of `obj`: sorted keys, `,`/`:` separators, non-ASCII kept.

    Raises:
        ValueError: `obj` holds NaN or an infinity (not valid JSON).
        TypeError: `obj` holds a value JSON cannot encode.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def sha256_hex(data: str | bytes) -> str:
    """SHA-256 hex digest of `data` (a str is UTF-8 encoded)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def chain_hash(prev_hash: str, body: Mapping[str, Any], chain_key: bytes | None = None) -> str:
    """The record hash of `body` after `prev_hash`; `body` must not contain "hash".

    With `chain_key` (`AuditKey.chain`): HMAC-SHA256(chain_key, UTF-8 of prev_hash +
    canonical_json(body)); without: SHA-256 of the same bytes. `body` includes its own
    `prev_hash` field, so the link is covered twice on purpose (the field says where the record
    claims to sit; the prefix makes the digest depend on it).

    Raises:
        UnicodeEncodeError: a string holds a lone surrogate.
        ValueError, TypeError: as `canonical_json`.
    """
    assert HASH_FIELD not in body, "hash the record without its hash field"
    data = (prev_hash + canonical_json(body)).encode("utf-8")
    if chain_key is None:
        return sha256_hex(data)
    return hmac_hex(chain_key, data)


def seal(body: Mapping[str, Any], prev_hash: str, chain_key: bytes | None = None) -> dict[str, Any]:
    """Return `body` with `prev_hash` and `hash` added (the record as written to the log)."""
    record = dict(body)
    record.pop(HASH_FIELD, None)
    record[PREV_HASH_FIELD] = prev_hash
    record[HASH_FIELD] = chain_hash(prev_hash, record, chain_key)
    return record


class InputDigest:
    """How a log file stores inputs: HMAC-SHA256 under a key (`AuditKey.inputs`) or under the
    file's random salt (unkeyed logs; the salt is in the file's header).

    Args:
        key: the HMAC key (the input key, or the salt's bytes).
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def hex(self, data: str | bytes) -> str:
        """HMAC-SHA256 of `data` (a str is UTF-8 encoded), 64 hex digits."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        return hmac_hex(self._key, data)


def header_body(unix_s: float, key_id: str | None, input_salt: str | None) -> dict[str, Any]:
    """The header record that starts every file of the log (before `seq` and the chain fields).

    Args:
        unix_s: when the file was started.
        key_id: the key's id (`AuditKey.key_id`) of a keyed log; None for an unkeyed one.
        input_salt: hex of the unkeyed file's `SALT_BYTES` random salt; None when keyed.
    """
    return {
        "schema": SCHEMA,
        KIND_FIELD: HEADER_KIND,
        "time": utc_iso(unix_s),
        "chain": UNKEYED_CHAIN if key_id is None else KEYED_CHAIN,
        "key_id": key_id,
        "input_hash": "hmac-sha256",
        "input_salt": input_salt,
    }


def encode_line(record: Mapping[str, Any]) -> bytes:
    """The exact bytes of one log line: canonical JSON, UTF-8, then a newline."""
    return (canonical_json(record) + "\n").encode("utf-8")


def utc_iso(unix_s: float) -> str:
    """UTC ISO 8601 with microseconds and a `Z` suffix, e.g. `2025-01-02T03:04:05.000006Z`."""
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def audit_series(path: str | os.PathLike[str]) -> list[str]:
    """Files of the rotated log at `path`, oldest first: `PATH.1, PATH.2, ..., PATH`.

    Rotation renames the active file `PATH` to `PATH.<k+1>` (k = highest existing suffix), so a
    higher number is newer and each rotation is a single atomic rename. `PATH` is listed only if
    it exists. Other siblings (`PATH.lock`, `PATH.torn-*`) are not part of the series.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    base = os.path.basename(path)
    pattern = re.compile(re.escape(base) + r"\.([1-9][0-9]*)")
    numbered: list[tuple[int, str]] = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            m = pattern.fullmatch(name)
            if m:
                numbered.append((int(m.group(1)), os.path.join(directory, name)))
    files = [p for _, p in sorted(numbered)]
    if os.path.exists(path):
        files.append(path)
    return files


@dataclass(frozen=True, slots=True)
class AuditToken:
    """One generated token as audited.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability (None when unknown or not finite).
        rank: its 1-based rank in the vocabulary at that position, when known.
        top: up to k alternatives `(token_id, logprob)`, best first (may include `token_id`).
    """

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: tuple[tuple[int, float | None], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.token_id,
            "logprob": _finite(self.logprob),
            "rank": self.rank,
            "top": [[tid, _finite(lp)] for tid, lp in self.top],
        }


@dataclass(frozen=True, slots=True)
class AuditSample:
    """One sample (of n) of a finished request.

    Attributes:
        index: sample index in 0..n-1.
        text: the output text returned to the client.
        token_ids: the generated token ids.
        tokens: per generated token, its logprob and top-k alternatives; None when the engine
            computed no logprobs (then the record says `"tokens": null`).
        finish_reason: "stop", "length", "abort" or "error".
        stop_reason: the stop string or stop token id, if any.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    tokens: tuple[AuditToken, ...] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "tokens": None if self.tokens is None else [t.to_json() for t in self.tokens],
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


@dataclass(frozen=True, slots=True)
class AuditTimings:
    """Wall-clock times of one request, in Unix seconds (UTC).

    Attributes:
        arrival_unix_s: when the request reached the server.
        first_token_unix_s: when its first output token was produced; None if none was.
        finish_unix_s: when it finished (also the record's `time`).
    """

    arrival_unix_s: float
    first_token_unix_s: float | None
    finish_unix_s: float

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds, or None."""
        if self.first_token_unix_s is None:
            return None
        return self.first_token_unix_s - self.arrival_unix_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency in seconds."""
        return self.finish_unix_s - self.arrival_unix_s

    @classmethod
    def from_monotonic(
        cls,
        arrival_s: float,
        first_token_s: float | None,
        finish_s: float | None,
        *,
        now_unix_s: float | None = None,
        now_monotonic_s: float | None = None,
    ) -> AuditTimings:
        """Convert `time.monotonic()` stamps (as in `RequestMetrics`) to Unix seconds.

        `finish_s` None means "now". The offset between the clocks is read once, now; pass both
        `now_*` to make the conversion deterministic (tests).
        """
        now_unix = time.time() if now_unix_s is None else now_unix_s
        now_mono = time.monotonic() if now_monotonic_s is None else now_monotonic_s
        offset_s = now_unix - now_mono
        return cls(
            arrival_unix_s=arrival_s + offset_s,
            first_token_unix_s=None if first_token_s is None else first_token_s + offset_s,
            finish_unix_s=(now_mono if finish_s is None else finish_s) + offset_s,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "arrival": utc_iso(self.arrival_unix_s),
            "first_token": (
                None if self.first_token_unix_s is None else utc_iso(self.first_token_unix_s)
            ),
            "finish": utc_iso(self.finish_unix_s),
            "ttft_s": _finite(self.ttft_s),
            "e2e_s": _finite(self.e2e_s),
        }


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """Everything the audit log keeps about one finished request (before chaining).

    Hashing the input and encoding happen in the writer thread (`to_body`), not in the caller.

    Attributes:
        request_id: the user-visible request id.
        tenant: the tenant id.
        model: the served model name.
        weights_digest: an identifier of the exact weights (e.g. SHA-256 of the safetensors).
        prompt_token_ids: the prompt as the model saw it; only its HMAC and length are kept.
        input_text: the input text (prompt, or the rendered chat prompt); its HMAC is kept.
        store_input: the tenant's policy allows storing `input_text` itself in the log.
        sampling: the sampling parameters as a JSON-able dict (see `to_jsonable`).
        samples: one entry per sample.
        timings: wall-clock times.
        trace_id: the W3C trace id (32 hex), if the request was traced.
        precision: the weight set that produced the request's last token (`--precision-switch`:
            e.g. "bfloat16", "int4"); None without a switch, or when no token was produced.
        precision_switches: switches of the weight set while the request ran (0: every token
            came from `precision`).
    """

    request_id: str
    tenant: str
    model: str
    weights_digest: str
    prompt_token_ids: tuple[int, ...]
    input_text: str | None
    store_input: bool
    sampling: Mapping[str, Any]
    samples: tuple[AuditSample, ...]
    timings: AuditTimings
    trace_id: str | None = None
    precision: str | None = None
    precision_switches: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_body(self, digest: InputDigest) -> dict[str, Any]:
        """The JSON-able record without `seq`/`prev_hash`/`hash`; `digest` is the log file's
        (`InputDigest`: the key's input key, or the file header's salt).

        Keys: schema, kind ("request"), time (UTC ISO 8601 of the finish), request_id, tenant,
        model, weights_digest, input_hmac (of the UTF-8 input text; None without text), input
        (the text only when `store_input`, else None), prompt_token_ids_hmac (of the canonical
        JSON list), num_prompt_tokens, sampling, outputs, timings, trace_id, precision,
        precision_switches, extra. (Records of older logs lack some keys or carry plain
        SHA-256s instead of the HMACs; they verify all the same: the chain covers whatever keys
        a line has.)
        """
        text = self.input_text
        return {
            "schema": SCHEMA,
            KIND_FIELD: REQUEST_KIND,
            "time": utc_iso(self.timings.finish_unix_s),
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "weights_digest": self.weights_digest,
            "input_hmac": None if text is None else digest.hex(_valid_unicode(text)),
            "input": text if self.store_input else None,
            "prompt_token_ids_hmac": digest.hex(canonical_json(list(self.prompt_token_ids))),
            "num_prompt_tokens": len(self.prompt_token_ids),
            "sampling": to_jsonable(self.sampling),
            "outputs": [s.to_json() for s in self.samples],
            "timings": self.timings.to_json(),
            "trace_id": self.trace_id,
            "precision": self.precision,
            "precision_switches": self.precision_switches,
            "extra": to_jsonable(self.extra),
        }


@dataclass(frozen=True, slots=True)
class AuditRefusal:
    """A generation request answered with an error status (400, 401, 429, 503, ...): its
    status and reason, no input and no output.

    Attributes:
        request_id: the job's id when the engine had started the request (its request records
            share it), else a fresh id ("refused-" + 24 hex digits: the client got none).
        tenant: the authenticated tenant's id; None when authentication failed (401).
        route: method and path, e.g. "POST /v1/completions".
        status: the HTTP status sent.
        error_type, error_code, error_param, message: the OpenAI error body's fields (None
            when absent; the message is cut to `MAX_REFUSAL_MESSAGE_CHARS`).
        unix_s: when the answer was sent.
        engine_started: whether the engine had started the request.
        trace_id: the W3C trace id (32 hex) when the request was traced.
    """

    request_id: str
    tenant: str | None
    route: str
    status: int
    error_type: str | None
    error_code: str | None
    error_param: str | None
    message: str | None
    unix_s: float
    engine_started: bool = False
    trace_id: str | None = None

    def to_body(self, digest: InputDigest) -> dict[str, Any]:
        """The JSON-able record without the chain fields (`digest` is unused: nothing of the
        request's input is kept).

        Keys: schema, kind ("refused"), time, request_id, tenant, route, status, error (type,
        code, param, message), engine_started, trace_id.
        """
        del digest
        message = self.message
        if message is not None and len(message) > MAX_REFUSAL_MESSAGE_CHARS:
            message = message[:MAX_REFUSAL_MESSAGE_CHARS] + "…"
        return {
            "schema": SCHEMA,
            KIND_FIELD: REFUSED_KIND,
            "time": utc_iso(self.unix_s),
            "request_id": self.request_id,
            "tenant": self.tenant,
            "route": self.route,
            "status": self.status,
            "error": {
                "type": self.error_type,
                "code": self.error_code,
                "param": self.error_param,
                "message": message,
            },
            "engine_started": self.engine_started,
            "trace_id": self.trace_id,
        }


class LogprobLike(Protocol):
    """What `samples_from_outputs` reads of one logprob entry (`sits.core.outputs.Logprob`)."""

    logprob: float
    rank: int | None


class CompletionLike(Protocol):
    """What `samples_from_outputs` reads of one sample (`sits.core.outputs.CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def samples_from_outputs(
    outputs: Sequence[CompletionLike], max_top_logprobs: int
) -> tuple[AuditSample, ...]:
    """Snapshot finished `CompletionOutput`s as `AuditSample`s (call in the request's task).

    Per position, `logprobs[i]` maps token id -> Logprob (the chosen token plus the top-N the
    engine computed). The chosen token's logprob and rank come from its own entry; `top` keeps
    the `max_top_logprobs` best entries by rank (then by logprob), whatever the engine computed
    beyond that is dropped.

    Raises:
        ValueError: `max_top_logprobs` < 0.
    """
    if max_top_logprobs < 0:
        raise ValueError(f"max_top_logprobs must be >= 0, got {max_top_logprobs}")
    samples = []
    for out in outputs:
        tokens: tuple[AuditToken, ...] | None = None
        if out.logprobs is not None:
            tokens = tuple(
                _audit_token(tid, pos, max_top_logprobs)
                for tid, pos in zip(out.token_ids, out.logprobs, strict=False)
            )
        samples.append(
            AuditSample(
                index=out.index,
                text=out.text,
                token_ids=tuple(out.token_ids),
                tokens=tokens,
                finish_reason=None if out.finish_reason is None else str(out.finish_reason),
                stop_reason=out.stop_reason,
            )
        )
    return tuple(samples)


def _audit_token(token_id: int, position: Mapping[int, Any], k: int) -> AuditToken:
    chosen = position.get(token_id)

    def order(item: tuple[int, Any]) -> tuple[float, float]:
        lp = item[1]
        rank = lp.rank if lp.rank is not None else math.inf
        return (rank, -lp.logprob)

    best = sorted(position.items(), key=order)[:k]
    return AuditToken(
        token_id=token_id,
        logprob=None if chosen is None else float(chosen.logprob),
        rank=None if chosen is None else chosen.rank,
        top=tuple((int(tid), float(lp.logprob)) for tid, lp in best),
    )


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, enums, mappings, tuples and sets to plain JSON types.

    Used for `SamplingParams` (a dataclass with an enum field): enums become their `value`,
    non-finite floats become None, mapping keys become strings.
    """
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
        return [to_jsonable(v) for v in items]
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, str):
        return _valid_unicode(obj)
    return obj


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _valid_unicode(text: str) -> str:
    """`text` with lone surrogates replaced (they cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text
