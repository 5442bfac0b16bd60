"""Deterministic audit records and a helper that writes a whole log (shared by the tests)."""

from __future__ import annotations

from pathlib import Path

from sits.obs.audit import AuditRecord, AuditSample, AuditTimings, AuditToken, InputDigest
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig

T0_UNIX_S = 1_700_000_000.0
TEST_SALT = bytes(range(32))
TEST_DIGEST = InputDigest(TEST_SALT)  # for bodies built outside a writer


def make_record(i: int, tenant: str = "acme", text: str | None = None) -> AuditRecord:
    """Record number `i`: 3 output tokens with logprobs and 2 alternatives each."""
    tokens = tuple(
        AuditToken(
            token_id=100 + i + j,
            logprob=-0.25 - 0.125 * j - i / 1024,
            rank=1,
            top=((100 + i + j, -0.25 - 0.125 * j - i / 1024), (7, -3.5 - j)),
        )
        for j in range(3)
    )
    sample = AuditSample(
        index=0,
        text=text if text is not None else f"answer number {i} for the auditors",
        token_ids=tuple(t.token_id for t in tokens),
        tokens=tokens,
        finish_reason="length",
    )
    return AuditRecord(
        request_id=f"req-{i}",
        tenant=tenant,
        model="tiny-llama",
        weights_digest="sha256:" + "ab" * 32,
        prompt_token_ids=(1, 2, 3, i),
        input_text=f"prompt {i}",
        store_input=i % 2 == 0,
        sampling={"temperature": 0.0, "max_tokens": 3, "logprobs": 2},
        samples=(sample,),
        timings=AuditTimings(T0_UNIX_S + i, T0_UNIX_S + i + 0.5, T0_UNIX_S + i + 1.25),
        trace_id=f"{i:032x}",
    )


def write_log(path: Path, num_records: int, **overrides: object) -> None:
    """Write records 0..num_records-1 to `path` with a fresh writer, then close it."""
    with AuditWriter(AuditWriterConfig(path=str(path), **overrides)) as writer:
        for i in range(num_records):
            assert writer.submit(make_record(i))
