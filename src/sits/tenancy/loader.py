"""Load `tenants.toml` into a `TenantsConfig`, refusing a malformed file with its line and field.

File shape (see issue 6): optional top-level `anonymous_tenant = "<id>"`, then one
`[[tenants]]` table per tenant with the fields of `TenantConfig`. Every error is a
`TenantConfigError` naming the file, the line (TOML syntax errors: tomllib's own line; other
errors: the line of the offending field inside its `[[tenants]]` table, else the table's header
line) and the field. Types are checked before values: integers must be TOML integers, fractions
and SLOs may be integers or floats, booleans are never numbers.
`load_tenants` stops at the first error; `check_tenants` (`sits tenants check`) finds them all:
every unknown field and wrong type, at most one value error per field (a field at fault is left
out while the rest of its table is checked), and the rules of the whole set over the tenants
that are valid.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from sits.core.errors import SitsError
from sits.tenancy.config import (
    TenantConfig,
    TenantsConfig,
    TenantValidationError,
    tenant_set_errors,
)

_TOP_LEVEL_FIELDS = ("tenants", "anonymous_tenant")
_TENANT_FIELDS = tuple(f.name for f in fields(TenantConfig))
_INT_FIELDS = frozenset(
    {
        "priority",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "max_tokens_per_request",
        "max_prompt_tokens",
    }
)
_NUMBER_FIELDS = frozenset({"reserved_kv_fraction", "weight", "ttft_ms", "tpot_ms"})
_STR_FIELDS = frozenset({"id", "tier"})
_TENANTS_HEADER_RE = re.compile(r"^\s*\[\[\s*tenants\s*\]\]")
_ANY_HEADER_RE = re.compile(r"^\s*\[")
_TOML_LINE_RE = re.compile(r"at line (\d+)")
_PLACEHOLDER_ID = "tenant"  # stands for a missing or invalid id while a table is checked


class TenantConfigError(SitsError, ValueError):
    """tenants.toml is malformed; the message names the file, line and field.

    Attributes:
        path: the file (or "<string>").
        line: 1-based line of the error, or None when it cannot be placed.
        field: the offending field (e.g. "tier"), or None for a syntax error.
        tenant_index: position of the offending `[[tenants]]` table, or None.
    """

    def __init__(
        self,
        path: str,
        message: str,
        *,
        line: int | None = None,
        field: str | None = None,
        tenant_index: int | None = None,
    ) -> None:
        where = path if line is None else f"{path}:{line}"
        what = "" if field is None else f"field '{field}': "
        if tenant_index is not None:
            what = f"tenants[{tenant_index}] {what}"
        super().__init__(f"{where}: {what}{message}")
        self.path = path
        self.line = line
        self.field = field
        self.tenant_index = tenant_index


def load_tenants(path: str | Path) -> TenantsConfig:
    """Read and validate a tenants.toml file.

    Raises:
        TenantConfigError: the file cannot be read, is not TOML, or breaks a rule (unknown
            field, wrong type, bad tier, bad key hash, duplicate id or key hash, reserved
            fractions over 1, limit < 1, ...).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantConfigError(str(path), f"cannot read tenants file: {exc}") from None
    return parse_tenants(text, source=str(path))


def parse_tenants(text: str, source: str = "<string>") -> TenantsConfig:
    """Validate tenants.toml text (see `load_tenants`); `source` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_LINE_RE.search(str(exc))
        line = int(match.group(1)) if match else None
        raise TenantConfigError(source, f"invalid TOML: {exc}", line=line) from None
    try:
        return _build(data)
    except TenantValidationError as exc:
        line = _locate(text, exc.tenant_index, exc.param)
        raise TenantConfigError(
            source, str(exc), line=line, field=exc.param, tenant_index=exc.tenant_index
        ) from None


def check_tenants(path: str | Path) -> list[TenantConfigError]:
    """Every error of a tenants.toml file (none: the file loads), ordered by line.

    A TOML syntax error or an unreadable file is the only error reported (nothing else can be
    read). See the module docstring for what else is found.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [TenantConfigError(str(path), f"cannot read tenants file: {exc}")]
    return find_tenants_errors(text, source=str(path))


def find_tenants_errors(text: str, source: str = "<string>") -> list[TenantConfigError]:
    """Every error of tenants.toml text (`check_tenants`); `source` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_LINE_RE.search(str(exc))
        line = int(match.group(1)) if match else None
        return [TenantConfigError(source, f"invalid TOML: {exc}", line=line)]
    errors = [
        TenantConfigError(
            source,
            str(exc),
            line=_locate(text, exc.tenant_index, exc.param),
            field=exc.param,
            tenant_index=exc.tenant_index,
        )
        for exc in _all_errors(data)
    ]
    return sorted(errors, key=lambda e: (e.line is None, e.line or 0))


def _all_errors(data: dict[str, Any]) -> list[TenantValidationError]:
    """The validation errors of parsed tenants.toml data (`check_tenants`)."""
    errors = [
        TenantValidationError(key, _unknown(key, _TOP_LEVEL_FIELDS, "top-level key"))
        for key in data
        if key not in _TOP_LEVEL_FIELDS
    ]
    anonymous = data.get("anonymous_tenant")
    if anonymous is not None and not isinstance(anonymous, str):
        errors.append(TenantValidationError("anonymous_tenant", "must be a string (a tenant id)"))
        anonymous = None
    raw_tenants = data.get("tenants")
    if not isinstance(raw_tenants, list) or not all(isinstance(t, dict) for t in raw_tenants):
        errors.append(
            TenantValidationError(
                "tenants", "expected one or more [[tenants]] tables (an array of tables)"
            )
        )
        return errors
    valid: list[tuple[int, TenantConfig]] = []
    failed_ids: set[str] = set()
    for index, raw in enumerate(raw_tenants):
        tenant, tenant_errors = _tenant_errors(raw)
        errors += [TenantValidationError(e.param, str(e), index) for e in tenant_errors]
        if tenant is not None:
            valid.append((index, tenant))
        elif isinstance(raw.get("id"), str):
            failed_ids.add(raw["id"])
    if not valid and raw_tenants:
        return errors  # "at least one tenant is needed" would only repeat the errors above
    for exc in tenant_set_errors([t for _, t in valid], anonymous):
        if exc.param == "anonymous_tenant" and anonymous in failed_ids:
            continue  # it is defined, with errors of its own
        index = None if exc.tenant_index is None else valid[exc.tenant_index][0]
        errors.append(TenantValidationError(exc.param, str(exc), index))
    return errors


def _tenant_errors(raw: dict[str, Any]) -> tuple[TenantConfig | None, list[TenantValidationError]]:
    """The tenant of one `[[tenants]]` table (None when it has errors) and all its errors.

    Unknown fields and wrong types first; then the table is built, and each field a value
    error blames is left out (the id replaced) before building again, until it builds.
    """
    errors = []
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            if key not in _TENANT_FIELDS:
                raise TenantValidationError(key, _unknown(key, _TENANT_FIELDS, "tenant field"))
            _check_type(key, value)
        except TenantValidationError as exc:
            errors.append(exc)
            continue
        kwargs[key] = tuple(value) if key == "api_key_sha256" else value
    if "id" not in raw:
        errors.append(TenantValidationError("id", "every tenant needs an id"))
    kwargs.setdefault("id", _PLACEHOLDER_ID)
    tenant = None
    left_out: set[str] = set()
    while True:
        try:
            tenant = TenantConfig(**kwargs)
            break
        except TenantValidationError as exc:
            if exc.param in left_out:
                break  # a consequence of a field already reported
            errors.append(exc)
            if exc.param not in kwargs:
                break  # a default the table relies on: nothing to leave out
            left_out.add(exc.param)
            if exc.param == "id":
                kwargs["id"] = _PLACEHOLDER_ID
            else:
                del kwargs[exc.param]
    return (tenant if not errors else None), errors


def _build(data: dict[str, Any]) -> TenantsConfig:
    for key in data:
        if key not in _TOP_LEVEL_FIELDS:
            raise TenantValidationError(key, _unknown(key, _TOP_LEVEL_FIELDS, "top-level key"))
    anonymous = data.get("anonymous_tenant")
    if anonymous is not None and not isinstance(anonymous, str):
        raise TenantValidationError("anonymous_tenant", "must be a string (a tenant id)")
    raw_tenants = data.get("tenants")
    if not isinstance(raw_tenants, list) or not all(isinstance(t, dict) for t in raw_tenants):
        raise TenantValidationError(
            "tenants", "expected one or more [[tenants]] tables (an array of tables)"
        )
    tenants = []
    for index, raw in enumerate(raw_tenants):
        try:
            tenants.append(_build_tenant(raw))
        except TenantValidationError as exc:
            raise TenantValidationError(exc.param, str(exc), index) from None
    return TenantsConfig(tuple(tenants), anonymous_tenant_id=anonymous)


def _build_tenant(raw: dict[str, Any]) -> TenantConfig:
    for key, value in raw.items():
        if key not in _TENANT_FIELDS:
            raise TenantValidationError(key, _unknown(key, _TENANT_FIELDS, "tenant field"))
        _check_type(key, value)
    if "id" not in raw:
        raise TenantValidationError("id", "every tenant needs an id")
    kwargs = dict(raw)
    if "api_key_sha256" in kwargs:
        kwargs["api_key_sha256"] = tuple(kwargs["api_key_sha256"])
    return TenantConfig(**kwargs)


def _check_type(key: str, value: Any) -> None:
    if isinstance(value, bool):
        ok = False
    elif key in _INT_FIELDS:
        ok = isinstance(value, int)
    elif key in _NUMBER_FIELDS:
        ok = isinstance(value, int | float)
    elif key in _STR_FIELDS:
        ok = isinstance(value, str)
    else:  # api_key_sha256
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        expected = (
            "an integer"
            if key in _INT_FIELDS
            else "a number"
            if key in _NUMBER_FIELDS
            else "a string"
            if key in _STR_FIELDS
            else "a list of strings"
        )
        raise TenantValidationError(key, f"must be {expected}, got {value!r}")


def _unknown(key: str, known: tuple[str, ...], kind: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {kind} '{key}'{hint}; known: {', '.join(known)}"


def _locate(text: str, tenant_index: int | None, field: str) -> int | None:
    """1-based line of `field` in the tenant table number `tenant_index` (or at top level).

    Falls back to the table's header line, then to the `tenants` key (inline arrays), else None.
    """
    lines = text.splitlines()
    name = re.escape(field)
    key_re = re.compile(rf"^\s*(?:{name}|\"{name}\"|'{name}')\s*=")
    start, header_line = 0, None
    if tenant_index is not None:
        seen = -1
        for number, line in enumerate(lines):
            if _TENANTS_HEADER_RE.match(line):
                seen += 1
                if seen == tenant_index:
                    start, header_line = number + 1, number + 1
                    break
        if header_line is None:
            return _locate(text, None, "tenants")
    for number in range(start, len(lines)):
        line = lines[number]
        if _ANY_HEADER_RE.match(line):
            break
        if key_re.match(line):
            return number + 1
    if header_line is None and field == "tenants":
        return next((n + 1 for n, ln in enumerate(lines) if _TENANTS_HEADER_RE.match(ln)), None)
    return header_line
