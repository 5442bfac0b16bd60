"""`sits audit verify PATH` and `sits audit show REQUEST_ID --log PATH`.

Exit codes of `verify`: 0 the chain is intact (a torn last line from a crash mid-write is
printed as a warning on stderr and still exits 0); 1 the chain breaks (the first breaking line
is named: file, line number, request id when readable, reason); 2 (from `sits.cli.main`) the log
does not exist. `show` prints every record of the request id a client got (a completion with
several prompts has one record per prompt, `ID-0`, `ID-1`, ...: all of them, in prompt order),
exit 1 if none: a summary of each by default (request, tenant, model, tokens in and out, finish
reasons, precision, latency, and whether the record matches its own hash), the whole record as
indented JSON with `--json` (per generated token its logprob and alternatives: hundreds of
lines for a short answer). A reader that stops early (`| head`) ends either quietly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from sits.core.errors import InvalidParameterError

_HEX64 = re.compile(r"[0-9a-f]{64}")


def add_audit_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sits audit` with its `verify` and `show` subcommands."""
    p = subparsers.add_parser("audit", help="check and read the tamper-evident audit log")
    sub = p.add_subparsers(dest="audit_command", required=True)
    v = sub.add_parser("verify", help="verify the hash chain of an audit log (and its rotations)")
    v.add_argument("path", help="the active log file (PATH.1, PATH.2, ... are found too)")
    v.add_argument(
        "--prev-hash",
        default=None,
        help="expected prev_hash of the oldest record (default: 64 zeros, the genesis value); "
        "give the last hash of older files archived elsewhere",
    )
    v.set_defaults(func=_quiet_on_broken_pipe(run_verify))
    s = sub.add_parser("show", help="print the audit record(s) of one request")
    s.add_argument(
        "request_id",
        help="the request id as returned to the client (a completion with several prompts "
        "shows the record of each prompt)",
    )
    s.add_argument("--log", required=True, dest="path", help="the audit log file")
    s.add_argument(
        "--json",
        action="store_true",
        help="print each whole record as indented JSON (default: a summary of each)",
    )
    s.set_defaults(func=_quiet_on_broken_pipe(run_show))


def _quiet_on_broken_pipe(
    run: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """`run`, ending with exit code 0 and no traceback when stdout's reader has gone."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            code = run(args)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            _discard_stdout()
            return 0

    return wrapped


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush cannot fail."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (captured output)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def run_verify(args: argparse.Namespace) -> int:
    """Verify the chain; print the record count (0) or the first break (1).

    Raises:
        AuditLogError: no log at the path.
        InvalidParameterError: `--prev-hash` is not 64 lowercase hex digits.
    """
    from sits.obs.audit import GENESIS_HASH
    from sits.obs.audit_verify import verify_log

    first = args.prev_hash or GENESIS_HASH
    if not _HEX64.fullmatch(first):
        raise InvalidParameterError("prev-hash", "--prev-hash must be 64 lowercase hex digits")
    result = verify_log(args.path, first_prev_hash=first)
    if result.torn_tail is not None:
        t = result.torn_tail
        print(
            f"warning: {t.path} line {t.line_number}: torn last line ({t.num_bytes} bytes, a "
            f"crash mid-write?); ignored, the chain is verified up to the line before it",
            file=sys.stderr,
        )
    b = result.chain_break
    if b is None:
        print(
            f"OK: {result.num_records} records in {len(result.files)} file(s); "
            f"last hash {result.last_hash}"
        )
        return 0
    rid = f" (request {b.request_id})" if b.request_id is not None else ""
    print(f"FAILED: {b.path} line {b.line_number}{rid}: {b.reason.value}: {b.detail}")
    print(f"{result.num_records} records verified before it")
    return 1


def run_show(args: argparse.Namespace) -> int:
    """Print the request's record(s) (`find_request_records`): summaries, or indented JSON
    with `--json`; 1 when there is none.

    Raises:
        AuditLogError: no log at the path.
    """
    from sits.obs.audit_verify import find_request_records

    records = find_request_records(args.path, args.request_id)
    if not records:
        print(f"no audit record for request {args.request_id} in {args.path}", file=sys.stderr)
        return 1
    for number, record in enumerate(records):
        if args.json:
            print(json.dumps(record, indent=2, ensure_ascii=False, sort_keys=True))
            continue
        if number:
            print()
        print(record_summary(record, args.path))
    return 0


def record_summary(record: dict[str, Any], log_path: str) -> str:
    """A few lines about one audit record (as parsed from the log `log_path`): request id,
    finish time, tenant, model and weights, tokens in and out, finish reasons, precision,
    latency, and whether the record matches its own hash."""
    outputs = record.get("outputs") or []
    out_tokens = [len(sample.get("token_ids") or ()) for sample in outputs]
    samples = f" ({len(outputs)} samples)" if len(outputs) > 1 else ""
    finish = ", ".join(str(sample.get("finish_reason")) for sample in outputs) or "-"
    precision = record.get("precision")
    switches = record.get("precision_switches") or 0
    timings = record.get("timings") or {}
    rows = [
        ("request", record.get("request_id")),
        ("time", record.get("time")),
        ("tenant", record.get("tenant")),
        ("model", f"{record.get('model')} (weights {record.get('weights_digest')})"),
        (
            "tokens",
            f"{record.get('num_prompt_tokens')} in, "
            f"{' + '.join(map(str, out_tokens)) or 0} out{samples}",
        ),
        ("finish", finish),
        (
            "precision",
            "none recorded (no --precision-switch, or no token)"
            if precision is None
            else f"{precision}, {switches} switch(es) while it ran",
        ),
        (
            "latency",
            f"ttft {_seconds(timings.get('ttft_s'))}, e2e {_seconds(timings.get('e2e_s'))}",
        ),
        ("hash", _hash_check(record, log_path)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _seconds(value: Any) -> str:
    return f"{value:.3f} s" if isinstance(value, int | float) else "-"


def _hash_check(record: dict[str, Any], log_path: str) -> str:
    """Whether `record` matches its own `hash` (its values unchanged since it was chained)."""
    from sits.obs.audit import HASH_FIELD, PREV_HASH_FIELD, chain_hash

    body = {key: value for key, value in record.items() if key != HASH_FIELD}
    ok = chain_hash(str(record.get(PREV_HASH_FIELD)), body) == record.get(HASH_FIELD)
    verdict = "ok, the record matches its hash" if ok else "MISMATCH: the record was altered"
    return f"{verdict}; `sits audit verify {log_path}` checks the whole chain"
