"""tenants.toml loading: a valid file, and malformed files refused with line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits.core.errors import SitsError
from sits.tenancy import TenantConfigError, Tier, hash_api_key, load_tenants, parse_tenants
from sits.tenancy.loader import find_tenants_errors

H1 = hash_api_key("key-one")
H2 = hash_api_key("key-two")

VALID = f"""\
anonymous_tenant = "free"

[[tenants]]
id = "payments"
api_key_sha256 = ["{H1.upper()}"]
tier = "guaranteed"          # guaranteed | burstable | best_effort
reserved_kv_fraction = 0.5   # share of KV blocks and sequence slots kept for it
weight = 1.0
priority = 0                 # lower runs first
ttft_ms = 500
tpot_ms = 50
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent = 64

[[tenants]]
id = "batch"
api_key_sha256 = [
  "{H2}",
]
tier = "burstable"
reserved_kv_fraction = 0.2
weight = 2
priority = 1
max_tokens_per_request = 4096
max_prompt_tokens = 8192

[[tenants]]
id = "free"
"""


def test_valid_file_loads_every_field(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(VALID)
    tenants = load_tenants(path)
    assert tenants.ids == ("payments", "batch", "free")
    assert tenants.anonymous_tenant_id == "free"
    pay, batch, free = tenants.tenants
    assert pay.api_key_sha256 == (H1,)
    assert (pay.tier, pay.reserved_kv_fraction, pay.weight, pay.priority) == (
        Tier.GUARANTEED,
        0.5,
        1.0,
        0,
    )
    assert (pay.ttft_ms, pay.tpot_ms) == (500, 50)
    assert (pay.requests_per_minute, pay.tokens_per_minute, pay.max_concurrent) == (
        600,
        200000,
        64,
    )
    assert (pay.max_tokens_per_request, pay.max_prompt_tokens) == (None, None)
    assert (batch.tier, batch.weight, batch.priority) == (Tier.BURSTABLE, 2, 1)
    assert (batch.max_tokens_per_request, batch.max_prompt_tokens) == (4096, 8192)
    assert (free.tier, free.api_key_sha256, free.requests_per_minute) == (
        Tier.BEST_EFFORT,
        (),
        None,
    )
    assert tenants.authenticate("key-one") is pay
    assert tenants.authenticate("key-two") is batch
    assert tenants.authenticate("nope") is free


def _tenant(body: str, key: str = H1) -> str:
    return f'[[tenants]]\nid = "a"\napi_key_sha256 = ["{key}"]\n{body}'


BAD_HASH = "ab" * 31 + "zz"

# (file text, expected line, expected field, tenant index, text the message must contain)
MALFORMED = [
    (_tenant("tokens_per_min = 5\n"), 4, "tokens_per_min", 0, "did you mean 'tokens_per_minute'"),
    (_tenant('max_concurrent = "64"\n'), 4, "max_concurrent", 0, "must be an integer"),
    (_tenant("max_concurrent = 6.5\n"), 4, "max_concurrent", 0, "must be an integer"),
    (_tenant("weight = true\n"), 4, "weight", 0, "must be a number"),
    (_tenant("weight = 1.0\ntier = 'gold'\n"), 5, "tier", 0, "guaranteed | burstable"),
    (_tenant("", key="abc"), 3, "api_key_sha256", 0, "not a SHA-256 hex digest"),
    (_tenant("", key=BAD_HASH), 3, "api_key_sha256", 0, "64 hex"),
    ('[[tenants]]\nid = "a"\napi_key_sha256 = "' + H1 + '"\n', 3, "api_key_sha256", 0, "list"),
    (_tenant("requests_per_minute = -5\n"), 4, "requests_per_minute", 0, ">= 1"),
    (_tenant("ttft_ms = 0\n"), 4, "ttft_ms", 0, "> 0"),
    (
        _tenant("") + f'\n[[tenants]]\nid = "a"\napi_key_sha256 = ["{H2}"]\n',
        6,
        "id",
        1,
        "duplicate tenant id 'a'",
    ),
    (
        _tenant("") + f'\n[[tenants]]\nid = "b"\n"api_key_sha256" = ["{H1}"]\n',
        7,
        "api_key_sha256",
        1,
        "already belongs to tenant 'a'",
    ),
    (
        _tenant('tier = "guaranteed"\nreserved_kv_fraction = 0.6\n')
        + f'\n[[tenants]]\nid = "b"\napi_key_sha256 = ["{H2}"]\ntier = "burstable"\n'
        + "priority = 2\nreserved_kv_fraction = 0.5\n",
        12,
        "reserved_kv_fraction",
        1,
        "sums to 1.1 > 1",
    ),
    (_tenant("reserved_kv_fraction = 0.2\n"), 4, "reserved_kv_fraction", 0, "best_effort"),
    (_tenant('tier = "guaranteed"\n'), 1, "reserved_kv_fraction", 0, "needs a reserved"),
    ("# c\n[[tenants]]\ntier = 'burstable'\n", 2, "id", 0, "needs an id"),
    ('[[tenants]]\nid = "lonely"\n', 1, "api_key_sha256", 0, "no request can reach it"),
    ('anonymous_tenant = "ghost"\n' + _tenant(""), 1, "anonymous_tenant", None, "not defined"),
    ("tenant = []\n" + _tenant(""), 1, "tenant", None, "did you mean 'tenants'"),
    ("# nothing here\n", None, "tenants", None, "[[tenants]]"),
]


@pytest.mark.parametrize(("text", "line", "field", "index", "snippet"), MALFORMED)
def test_malformed_file_names_line_and_field(text, line, field, index, snippet) -> None:
    with pytest.raises(TenantConfigError) as info:
        parse_tenants(text, source="t.toml")
    err = info.value
    assert (err.path, err.line, err.field, err.tenant_index) == ("t.toml", line, field, index)
    assert snippet in str(err)
    where = "t.toml" if line is None else f"t.toml:{line}"
    assert str(err).startswith(f"{where}: ")
    assert f"field '{field}'" in str(err)


def test_inline_tenants_array_points_at_the_tenants_key() -> None:
    text = f'# x\ntenants = [{{ id = "a", api_key_sha256 = ["{H1}"], tier = "gold" }}]\n'
    with pytest.raises(TenantConfigError) as info:
        parse_tenants(text, source="t.toml")
    assert (info.value.line, info.value.field) == (2, "tier")


def test_toml_syntax_error_carries_tomllib_line() -> None:
    text = _tenant('tier = "burstable\nweight = 1\n')
    with pytest.raises(TenantConfigError) as info:
        parse_tenants(text, source="t.toml")
    assert (info.value.line, info.value.field) == (4, None)
    assert str(info.value).startswith("t.toml:4: invalid TOML")


def test_missing_file_is_a_sits_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(SitsError) as info:
        load_tenants(missing)
    assert isinstance(info.value, TenantConfigError)
    assert str(info.value).startswith(f"{missing}: cannot read tenants file")


def test_file_errors_name_the_real_path(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(_tenant("max_concurrent = 0\n"))
    with pytest.raises(TenantConfigError) as info:
        load_tenants(path)
    assert str(info.value).startswith(f"{path}:4: tenants[0] field 'max_concurrent': ")


@pytest.mark.parametrize(("text", "line", "field", "index", "snippet"), MALFORMED)
def test_check_finds_the_one_error_load_stops_at(text, line, field, index, snippet) -> None:
    """No spurious errors: a file with one error has exactly the error loading raises."""
    with pytest.raises(TenantConfigError) as info:
        parse_tenants(text, source="t.toml")
    (found,) = find_tenants_errors(text, source="t.toml")
    assert (found.line, found.field, found.tenant_index) == (line, field, index)
    assert str(found) == str(info.value)


def test_check_finds_every_error() -> None:
    h3, h4 = hash_api_key("key-three"), hash_api_key("key-four")
    text = (
        _tenant('tier = "gold"\nweight = -1\nmax_concurent = 3\n')  # lines 4, 5, 6
        + f'\n[[tenants]]\nid = "b"\napi_key_sha256 = ["{H2}"]\nrequests_per_minute = 0\n'
        + f'\n[[tenants]]\nid = "d"\napi_key_sha256 = ["{h3}"]\n'
        + f'\n[[tenants]]\nid = "e"\napi_key_sha256 = ["{h3}"]\n'  # line 19: d's key
        + f'\n[[tenants]]\nid = "c c"\napi_key_sha256 = ["{h4}"]\n'  # line 22
    )
    found = [(e.line, e.field, e.tenant_index) for e in find_tenants_errors(text, "t.toml")]
    assert found == [
        (4, "tier", 0),
        (5, "weight", 0),
        (6, "max_concurent", 0),
        (11, "requests_per_minute", 1),
        (19, "api_key_sha256", 3),
        (22, "id", 4),
    ]
    assert find_tenants_errors(_tenant("") + 'tier = "burstable"\n') == []
