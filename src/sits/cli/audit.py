"""`sits audit verify PATH` and `sits audit show REQUEST_ID --log PATH`.

`verify PATH [--key-file K] [--checkpoints FILE]` checks the chain (`sits.obs.audit_verify`):
with the log's key every record's HMAC (a record made or edited without the key fails), with
the checkpoint file every checkpoint's signature, and that the log still holds every record a
checkpoint counted with the hash it had (truncation, an emptied or removed log, a torn last
line inside the checkpointed part, a rewritten history). It prints OK with the counts and says
what the check could not see (an unkeyed chain, records after the last checkpoint), or FAILED
with the first bad record and why. Exit codes: 0 valid (a torn last line past the last
checkpoint, a crash mid-write, is a warning on stderr); 1 tampered (the first breaking line is
named: file, line number, request id when readable, reason); 2 (from `sits.cli.main`) a usage
error: no log, a keyed log or signed checkpoints without --key-file, a bad key file or
--prev-hash. `show` prints every record of the request id a client got (a completion with
several prompts has one record per prompt, `ID-0`, `ID-1`, ...: all of them, in prompt order),
exit 1 if none: a summary of each by default (request, tenant, model, tokens in and out, finish
reasons, precision, latency, and whether the record matches its own hash; a refused request's
status and reason), the whole record as indented JSON with `--json` (per generated token its
logprob and alternatives: hundreds of lines for a short answer). A reader that stops early
(`| head`) ends either quietly.
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
    v.add_argument(
        "--key-file",
        default=None,
        metavar="K",
        help="the log's key (the server's --audit-key-file): checks every record's HMAC",
    )
    v.add_argument(
        "--checkpoints",
        default=None,
        metavar="FILE",
        help="the checkpoint file (the server's --audit-checkpoint-file): detects truncation "
        "and rewritten history up to the last checkpoint",
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
    s.add_argument(
        "--key-file",
        default=None,
        metavar="K",
        help="the log's key, to check a keyed record's hash in the summary",
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
    """Verify the chain; print the counts and what was checked (0) or the first break (1).

    Raises:
        AuditLogError: no log at the path, or an unreadable checkpoint file.
        AuditKeyRequiredError: a keyed log or signed checkpoints and no --key-file.
        InvalidParameterError: `--prev-hash` is not 64 lowercase hex digits; a bad key file.
    """
    from sits.obs.audit import GENESIS_HASH
    from sits.obs.audit_verify import verify_log

    first = args.prev_hash or GENESIS_HASH
    if not _HEX64.fullmatch(first):
        raise InvalidParameterError("prev-hash", "--prev-hash must be 64 lowercase hex digits")
    key = _key_arg(args)
    result = verify_log(args.path, first, key=key, checkpoint_path=args.checkpoints)
    if result.torn_tail is not None and result.ok:
        t = result.torn_tail
        print(
            f"warning: {t.path} line {t.line_number}: torn last line ({t.num_bytes} bytes, a "
            f"crash mid-write?); ignored, the chain is verified up to the line before it",
            file=sys.stderr,
        )
    if result.checkpoint_torn:
        print(f"warning: {args.checkpoints}: torn last line ignored", file=sys.stderr)
    b = result.chain_break
    if b is None:
        print(
            f"OK: {result.num_records} records in {len(result.files)} file(s) "
            f"({result.num_headers} header(s), {result.num_requests} request(s), "
            f"{result.num_refusals} refused); last hash {result.last_hash}"
        )
        for line in _coverage(result, args.checkpoints):
            print(line)
        return 0
    rid = f" (request {b.request_id})" if b.request_id is not None else ""
    print(f"FAILED: {b.path} line {b.line_number}{rid}: {b.reason.value}: {b.detail}")
    print(f"{result.num_records} records verified before it")
    return 1


UNKEYED_WARNING = (
    "unkeyed: a plain SHA-256 chain (no --key-file), which proves the records' order and "
    "integrity only relative to a head hash kept elsewhere: whoever can write the log can drop "
    "its last records, empty it, append records, or edit a record and recompute every later "
    "hash, and this check cannot tell; serve with --audit-key-file and --audit-checkpoint-file"
)


def _coverage(result: Any, checkpoint_path: str | None) -> list[str]:
    """What a passing check covered and what it could not see."""
    lines = []
    if result.key_id is None:
        lines.append(UNKEYED_WARNING)
    else:
        lines.append(
            f"keyed: HMAC-SHA256 chain, key id {result.key_id}: no record was made or altered "
            "without the key"
        )
    if checkpoint_path is None:
        lines.append("no --checkpoints: records cut from the end of the log cannot be detected")
    elif not result.checkpoints:
        lines.append(f"checkpoints: none in {checkpoint_path}")
    else:
        last = result.checkpoints[-1]
        signed = (
            "signed"
            if last.signed
            else "UNSIGNED: they anchor the log only where no one who could edit it can edit them"
        )
        lines.append(
            f"checkpoints: {len(result.checkpoints)} ({signed}), the last at "
            f"{last.num_records} records ({last.time}, {last.reason}): the log holds them all"
        )
        after = result.end_count - last.num_records
        if after > 0:
            lines.append(f"{after} record(s) after the last checkpoint are anchored by none")
    return lines


def _key_arg(args: argparse.Namespace) -> Any:
    """The `AuditKey` of --key-file, or None."""
    from sits.obs.audit_keys import load_key_file

    return None if args.key_file is None else load_key_file(args.key_file, "key_file")


def run_show(args: argparse.Namespace) -> int:
    """Print the request's record(s) (`find_request_records`): summaries, or indented JSON
    with `--json`; 1 when there is none.

    Raises:
        AuditLogError: no log at the path.
        InvalidParameterError: a bad key file.
    """
    from sits.obs.audit_verify import find_request_records, read_header

    key = _key_arg(args)
    records = find_request_records(args.path, args.request_id)
    if not records:
        print(f"no audit record for request {args.request_id} in {args.path}", file=sys.stderr)
        return 1
    header = read_header(args.path) or {}
    checker = _HashCheck(args.path, key, keyed=header.get("chain") == "hmac-sha256")
    for number, record in enumerate(records):
        if args.json:
            print(json.dumps(record, indent=2, ensure_ascii=False, sort_keys=True))
            continue
        if number:
            print()
        print(record_summary(record, checker))
    return 0


class _HashCheck:
    """Whether a record matches its own `hash` (its values unchanged since it was chained).

    Args:
        log_path: the log, named in the verdict.
        key: the log's key (`AuditKey`), or None.
        keyed: the log's header names a key.
    """

    def __init__(self, log_path: str, key: Any = None, keyed: bool = False) -> None:
        self.log_path = log_path
        self.key = key
        self.keyed = keyed

    def __call__(self, record: dict[str, Any]) -> str:
        from sits.obs.audit import HASH_FIELD, PREV_HASH_FIELD, chain_hash

        verify = f"`sits audit verify {self.log_path}` checks the whole chain"
        if self.keyed and self.key is None:
            return f"not checked: the log is keyed (pass --key-file); {verify}"
        body = {key: value for key, value in record.items() if key != HASH_FIELD}
        chain_key = None if self.key is None else self.key.chain
        try:
            computed = chain_hash(str(record.get(PREV_HASH_FIELD)), body, chain_key)
        except (TypeError, ValueError):
            computed = None
        ok = computed == record.get(HASH_FIELD)
        verdict = "ok, the record matches its hash" if ok else "MISMATCH: the record was altered"
        return f"{verdict}; {verify}"


def record_summary(record: dict[str, Any], hash_check: Callable[[dict[str, Any]], str]) -> str:
    """A few lines about one audit record: request id, finish time, tenant, model and weights,
    tokens in and out, finish reasons, precision, latency, and `hash_check`'s verdict on its
    hash; for a refused request its route, status and reason instead of the model's facts."""
    if record.get("kind") == "refused":
        error = record.get("error") or {}
        reason = f"{error.get('code') or error.get('type')}: {error.get('message')}"
        rows = [
            ("request", record.get("request_id")),
            ("time", record.get("time")),
            ("tenant", record.get("tenant") or "none (not authenticated)"),
            ("refused", f"{record.get('status')} to {record.get('route')}"),
            ("reason", reason),
            ("hash", hash_check(record)),
        ]
        return _rows(rows)
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
        ("hash", hash_check(record)),
    ]
    return _rows(rows)


def _rows(rows: list[tuple[str, Any]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _seconds(value: Any) -> str:
    return f"{value:.3f} s" if isinstance(value, int | float) else "-"
