"""Observability: the tamper-evident audit log (record, chain, writer, verifier).

Layer L0: imports only `sits.core.errors`; engine objects are read through Protocols.
"""

from __future__ import annotations

from sits.obs.audit import (
    GENESIS_HASH,
    AuditLogError,
    AuditRecord,
    AuditSample,
    AuditTimings,
    AuditToken,
    audit_series,
    chain_hash,
    samples_from_outputs,
    to_jsonable,
)
from sits.obs.audit_verify import (
    BreakReason,
    ChainBreak,
    TornTail,
    VerifyResult,
    find_records,
    find_request_records,
    verify_log,
)
from sits.obs.audit_writer import AuditWriter, AuditWriterConfig, AuditWriterStats

__all__ = [
    "GENESIS_HASH",
    "AuditLogError",
    "AuditRecord",
    "AuditSample",
    "AuditTimings",
    "AuditToken",
    "AuditWriter",
    "AuditWriterConfig",
    "AuditWriterStats",
    "BreakReason",
    "ChainBreak",
    "TornTail",
    "VerifyResult",
    "audit_series",
    "chain_hash",
    "find_records",
    "find_request_records",
    "samples_from_outputs",
    "to_jsonable",
    "verify_log",
]
