"""Read a `--tenants-mix` TOML file: the client tenants of a multi-tenant serving benchmark.

File shape (keys are the fields of `sits.bench.workload.TenantLoad`):
```toml
[defaults]                 # optional: values every tenant inherits
input_len = 512
output_len = 128

[[tenants]]
name = "payments"          # label in the report (unique)
api_key = "sk-payments"    # sent as Authorization: Bearer (clear text: it is the client side)
request_rate = 4.0         # requests/s of this tenant's own Poisson process ("inf": all at t=0)
num_prompts = 200          # or duration_s = 60 (send for 60 s)
ttft_ms = 500              # SLOs used for attainment and goodput
tpot_ms = 50
burstiness = 1.0           # optional gamma shape of the gaps (1 = Poisson)
```
Each field of a tenant comes from its own table, else from `[defaults]`, else from the
command line's fallback (`--input-len`, `--api-key`, `--slo-ttft-ms`, ...). `num_prompts` and
`duration_s` are one choice: the first level that sets either decides, and setting both at one
level is an error. Unknown keys, wrong types (booleans are not numbers) and duplicate names
are refused with the tenant and field named.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sits.bench.workload import TenantLoad
from sits.core.errors import InvalidParameterError

_FIELDS = tuple(f.name for f in dataclasses.fields(TenantLoad))
_INT_FIELDS = frozenset({"num_prompts", "input_len", "output_len"})
_NUMBER_FIELDS = frozenset({"request_rate", "duration_s", "ttft_ms", "tpot_ms", "burstiness"})
_STR_FIELDS = frozenset({"name", "api_key"})
_COUNT_FIELDS = ("num_prompts", "duration_s")


def _check_type(where: str, key: str, value: Any) -> Any:
    if key not in _FIELDS:
        allowed = ", ".join(_FIELDS)
        raise InvalidParameterError(key, f"{where}: unknown field {key!r} (allowed: {allowed})")
    if key == "request_rate" and isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    if key in _STR_FIELDS:
        ok = isinstance(value, str)
    elif key in _INT_FIELDS:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        kind = (
            "a string" if key in _STR_FIELDS else "an integer" if key in _INT_FIELDS else "a number"
        )
        raise InvalidParameterError(key, f"{where}: field {key!r} must be {kind}, got {value!r}")
    return float(value) if key in _NUMBER_FIELDS else value


def _typed_table(where: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise InvalidParameterError("tenants", f"{where} must be a table")
    typed = {key: _check_type(where, key, value) for key, value in table.items()}
    if all(key in typed for key in _COUNT_FIELDS):
        raise InvalidParameterError(
            "num_prompts", f"{where}: give num_prompts or duration_s, not both"
        )
    return typed


def resolve_tenant(
    where: str, table: Mapping[str, Any], defaults: Mapping[str, Any], fallback: TenantLoad
) -> TenantLoad:
    """One tenant from its table, the `[defaults]` table and the command-line fallback.

    Raises:
        InvalidParameterError: a value out of range (message prefixed by `where`).
    """
    values = {name: getattr(fallback, name) for name in _FIELDS}
    for level in (defaults, table):
        for key in _FIELDS:
            if key not in level:
                continue
            if key in _COUNT_FIELDS:
                values["num_prompts"] = None
                values["duration_s"] = None
            values[key] = level[key]
    try:
        return TenantLoad(**values)
    except InvalidParameterError as exc:
        raise InvalidParameterError(exc.param, f"{where}: {exc}") from None


def parse_tenants_mix(
    data: Mapping[str, Any], fallback: TenantLoad, source: str = "<mix>"
) -> list[TenantLoad]:
    """Tenants from a parsed mix document (see the module docstring).

    Args:
        data: the TOML document as a mapping.
        fallback: supplies every field neither the tenant nor `[defaults]` sets.
        source: file name used in error messages.

    Raises:
        InvalidParameterError: unknown keys, wrong types, no tenants, duplicate names, or a
            value out of range; the message names the file, the tenant and the field.
    """
    unknown = sorted(set(data) - {"defaults", "tenants"})
    if unknown:
        raise InvalidParameterError(
            unknown[0],
            f"{source}: unknown top-level key {unknown[0]!r} (use [defaults], [[tenants]])",
        )
    defaults = _typed_table(f"{source} [defaults]", data.get("defaults", {}))
    if "name" in defaults:
        raise InvalidParameterError("name", f"{source} [defaults]: a name must be per tenant")
    tables = data.get("tenants")
    if not isinstance(tables, list) or not tables:
        raise InvalidParameterError("tenants", f"{source}: at least one [[tenants]] table needed")
    tenants: list[TenantLoad] = []
    for index, raw in enumerate(tables):
        label = raw.get("name", "?") if isinstance(raw, Mapping) else "?"
        where = f"{source} tenants[{index}] ({label})"
        table = _typed_table(where, raw)
        if "name" not in table:
            raise InvalidParameterError("name", f"{where}: every tenant needs a name")
        tenant = resolve_tenant(where, table, defaults, fallback)
        if any(t.name == tenant.name for t in tenants):
            raise InvalidParameterError("name", f"{where}: duplicate tenant name {tenant.name!r}")
        tenants.append(tenant)
    return tenants


def load_tenants_mix(path: str | Path, fallback: TenantLoad) -> list[TenantLoad]:
    """Read and validate a tenants-mix TOML file.

    Raises:
        InvalidParameterError: the file cannot be read, is not TOML, or breaks a rule.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise InvalidParameterError("tenants_mix", f"cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidParameterError("tenants_mix", f"{path}: not valid TOML: {exc}") from exc
    return parse_tenants_mix(data, fallback, source=str(path))
