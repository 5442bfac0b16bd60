"""The --tenants-mix TOML file: fields, defaults, fallback from the flags, and refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sits.bench.mix import load_tenants_mix, parse_tenants_mix
from sits.bench.workload import TenantLoad
from sits.core.errors import InvalidParameterError

MIX = """
[defaults]
input_len = 256
output_len = 32
tpot_ms = 50

[[tenants]]
name = "payments"
api_key = "sk-pay"
request_rate = 4.0
num_prompts = 100
ttft_ms = 500

[[tenants]]
name = "batch"
api_key = "sk-batch"
request_rate = 12
duration_s = 30
input_len = 1024
burstiness = 0.5

[[tenants]]
name = "flood"
request_rate = "inf"
"""

FALLBACK = TenantLoad(api_key="sk-cli", num_prompts=7, input_len=64, output_len=8, ttft_ms=900.0)


def test_mix_file_fields_defaults_and_fallback(tmp_path: Path) -> None:
    path = tmp_path / "mix.toml"
    path.write_text(MIX)
    pay, batch, flood = load_tenants_mix(path, FALLBACK)
    assert pay == TenantLoad(name="payments", api_key="sk-pay", request_rate=4.0, num_prompts=100,
                             input_len=256, output_len=32, ttft_ms=500.0, tpot_ms=50.0)  # fmt: skip
    # duration_s in the tenant's table replaces the fallback's num_prompts.
    assert (batch.num_prompts, batch.duration_s, batch.request_rate) == (None, 30.0, 12.0)
    assert (batch.input_len, batch.output_len, batch.burstiness) == (1024, 32, 0.5)
    assert (batch.ttft_ms, batch.tpot_ms) == (900.0, 50.0)  # flag fallback, then [defaults]
    # Everything not in the file comes from the flags: key, count, SLO.
    assert (flood.api_key, flood.num_prompts, flood.ttft_ms) == ("sk-cli", 7, 900.0)
    assert math.isinf(flood.request_rate)


@pytest.mark.parametrize(
    ("text", "param", "fragment"),
    [
        ('[[tenants]]\nname = "a"\nrate = 1', "rate", "unknown field 'rate'"),
        ('[[tenants]]\nname = "a"\nnum_prompts = true', "num_prompts", "must be an integer"),
        ('[[tenants]]\nname = "a"\nttft_ms = "fast"', "ttft_ms", "must be a number"),
        ('[[tenants]]\nname = "a"\nnum_prompts = 3\nduration_s = 2', "num_prompts", "not both"),
        ('[[tenants]]\nname = "a"\n[[tenants]]\nname = "a"', "name", "duplicate tenant name"),
        ('[[tenants]]\napi_key = "k"', "name", "needs a name"),
        ('[[tenants]]\nname = "a"\nrequest_rate = -2', "request_rate", "tenants[0] (a)"),
        ("[defaults]\ninput_len = 3", "tenants", "at least one [[tenants]]"),
        ('tenant = 1\n[[tenants]]\nname = "a"', "tenant", "unknown top-level key"),
    ],
)
def test_malformed_mix_is_refused_naming_the_field(text: str, param: str, fragment: str) -> None:
    import tomllib

    with pytest.raises(InvalidParameterError) as err:
        parse_tenants_mix(tomllib.loads(text), FALLBACK, source="m.toml")
    assert err.value.param == param
    assert fragment in str(err.value) and "m.toml" in str(err.value)


def test_unreadable_or_invalid_toml_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="cannot read"):
        load_tenants_mix(tmp_path / "missing.toml", FALLBACK)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tenants]\nname=")
    with pytest.raises(InvalidParameterError, match="not valid TOML"):
        load_tenants_mix(bad, FALLBACK)


def test_bundled_qos_files_agree_with_each_other() -> None:
    """bench/qos/mix.toml's keys and SLOs are those of bench/qos/tenants.toml's tenants."""
    from sits.tenancy.loader import load_tenants

    root = Path(__file__).resolve().parents[2] / "bench" / "qos"
    server = load_tenants(root / "tenants.toml")
    clients = load_tenants_mix(root / "mix.toml", TenantLoad())
    assert [c.name for c in clients] == list(server.ids) == ["gold", "burst"]
    for client in clients:
        tenant = server.authenticate(client.api_key)
        assert tenant is not None and tenant.id == client.name
        assert (tenant.ttft_ms, tenant.tpot_ms) == (client.ttft_ms, client.tpot_ms)
    assert [t.tier.value for t in server] == ["guaranteed", "burstable"]
