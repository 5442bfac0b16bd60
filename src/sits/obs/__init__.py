"""Observability: the tamper-evident audit log (record, chain, writer, verifier), re-exported
here; and, imported by module, the server's metrics (`server_metrics`, `tenant_metrics`,
`cost_metrics`, `loop_lag`, `gc_pauses`), request timelines and dashboard data (`timeline`,
`dashboard_data`), the per-request audit (`request_audit`) and tracing (`tracing`,
`trace_spans`).

Layer L1 (`docs/layers.toml`): imports `sits.core`, `sits.config` and `sits.tenancy` only;
engine and server objects are read through Protocols or by attribute.
"""

from __future__ import annotations

from sits.obs.audit import (
    GENESIS_HASH,
    AuditLogError,
    AuditRecord,
    AuditRefusal,
    AuditSample,
    AuditTimings,
    AuditToken,
    audit_series,
    chain_hash,
    samples_from_outputs,
    to_jsonable,
)
from sits.obs.audit_keys import AuditKey, load_key_file
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
    "AuditKey",
    "AuditRecord",
    "AuditRefusal",
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
    "load_key_file",
    "samples_from_outputs",
    "to_jsonable",
    "verify_log",
]
