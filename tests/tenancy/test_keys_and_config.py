"""Key hashing, TenantConfig validation and TenantsConfig lookup/authentication."""

from __future__ import annotations

import pickle

import pytest

from sits.tenancy import (
    TenantConfig,
    TenantsConfig,
    TenantValidationError,
    Tier,
    hash_api_key,
    is_key_hash,
    normalize_key_hash,
)

# SHA-256("abc"), FIPS 180-2 test vector.
ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_hash_api_key_is_sha256_hex() -> None:
    assert hash_api_key("abc") == ABC_SHA256
    assert is_key_hash(ABC_SHA256)
    assert is_key_hash(ABC_SHA256.upper())
    assert not is_key_hash(ABC_SHA256[:-1])
    assert not is_key_hash(ABC_SHA256[:-1] + "g")
    assert normalize_key_hash(ABC_SHA256.upper()) == ABC_SHA256
    with pytest.raises(ValueError, match="64 hex"):
        normalize_key_hash("abc")


def test_tenant_defaults_are_unlimited() -> None:
    t = TenantConfig(id="a")
    assert t.tier is Tier.BEST_EFFORT
    assert t.api_key_sha256 == ()
    assert (t.reserved_kv_fraction, t.weight, t.priority) == (0.0, 1.0, 0)
    limits = (
        t.ttft_ms,
        t.tpot_ms,
        t.requests_per_minute,
        t.tokens_per_minute,
        t.max_concurrent,
        t.max_tokens_per_request,
        t.max_prompt_tokens,
    )
    assert limits == (None,) * 7


def test_tenant_normalises_tier_and_hashes() -> None:
    t = TenantConfig(
        id="p", api_key_sha256=[ABC_SHA256.upper()], tier="burstable", reserved_kv_fraction=0.25
    )
    assert t.tier is Tier.BURSTABLE
    assert t.api_key_sha256 == (ABC_SHA256,)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"id": ""}, "id"),
        ({"id": "has space"}, "id"),
        ({"id": "a", "tier": "gold"}, "tier"),
        ({"id": "a", "api_key_sha256": ("xyz",)}, "api_key_sha256"),
        ({"id": "a", "api_key_sha256": (ABC_SHA256, ABC_SHA256.upper())}, "api_key_sha256"),
        ({"id": "a", "tier": "guaranteed", "reserved_kv_fraction": 1.5}, "reserved_kv_fraction"),
        ({"id": "a", "tier": "guaranteed"}, "reserved_kv_fraction"),
        ({"id": "a", "reserved_kv_fraction": 0.1}, "reserved_kv_fraction"),
        ({"id": "a", "weight": 0.0}, "weight"),
        ({"id": "a", "ttft_ms": -1.0}, "ttft_ms"),
        ({"id": "a", "requests_per_minute": 0}, "requests_per_minute"),
        ({"id": "a", "max_concurrent": -3}, "max_concurrent"),
    ],
)
def test_tenant_validation_names_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(TenantValidationError) as info:
        TenantConfig(**kwargs)
    assert info.value.param == param


def _tenants() -> TenantsConfig:
    return TenantsConfig(
        (
            TenantConfig(
                id="pay",
                api_key_sha256=(hash_api_key("k-pay"), hash_api_key("k-pay-2")),
                tier=Tier.GUARANTEED,
                reserved_kv_fraction=0.5,
                ttft_ms=500,
            ),
            TenantConfig(id="free", ttft_ms=2000),
        ),
        anonymous_tenant_id="free",
    )


def test_authenticate_maps_keys_and_falls_back_to_anonymous() -> None:
    tenants = _tenants()
    assert tenants.authenticate("k-pay").id == "pay"
    assert tenants.authenticate("k-pay-2").id == "pay"
    assert tenants.authenticate("wrong").id == "free"
    assert tenants.authenticate(None).id == "free"
    assert tenants.authenticate("").id == "free"
    assert not tenants.requires_auth
    assert tenants.ids == ("pay", "free")
    assert tenants.min_ttft_ms == 500
    assert tenants.get("pay") is tenants.tenants[0]
    assert tenants.get("nobody") is None


def test_authenticate_without_anonymous_refuses_unknown_keys() -> None:
    tenants = TenantsConfig((TenantConfig(id="a", api_key_sha256=(ABC_SHA256,)),))
    assert tenants.requires_auth
    assert tenants.authenticate("abc").id == "a"
    assert tenants.authenticate("abd") is None
    assert tenants.authenticate(None) is None


def test_default_config() -> None:
    open_cfg = TenantsConfig.default()
    assert open_cfg.ids == ("default",)
    (tenant,) = open_cfg.tenants
    assert (tenant.tier, tenant.reserved_kv_fraction) == (Tier.GUARANTEED, 1.0)
    assert open_cfg.authenticate(None) is tenant
    assert open_cfg.authenticate("EMPTY") is tenant
    keyed = TenantsConfig.default(api_key="abc")
    assert keyed.tenants[0].api_key_sha256 == (ABC_SHA256,)
    assert keyed.authenticate("abc").id == "default"
    assert keyed.authenticate("other") is None
    assert keyed.authenticate(None) is None


@pytest.mark.parametrize(
    ("tenants", "anonymous", "param", "index"),
    [
        ((), None, "tenants", None),
        (
            (
                TenantConfig(id="a", api_key_sha256=(ABC_SHA256,)),
                TenantConfig(id="a", api_key_sha256=(hash_api_key("x"),)),
            ),
            None,
            "id",
            1,
        ),
        (
            (
                TenantConfig(id="a", api_key_sha256=(ABC_SHA256,)),
                TenantConfig(id="b", api_key_sha256=(ABC_SHA256,)),
            ),
            None,
            "api_key_sha256",
            1,
        ),
        (
            (
                TenantConfig(id="a", tier="guaranteed", reserved_kv_fraction=0.6),
                TenantConfig(id="b", tier="burstable", reserved_kv_fraction=0.5),
            ),
            "a",
            "reserved_kv_fraction",
            1,
        ),
        ((TenantConfig(id="a"),), None, "api_key_sha256", 0),
        ((TenantConfig(id="a"),), "b", "anonymous_tenant", None),
    ],
)
def test_tenants_config_cross_checks(tenants, anonymous, param, index) -> None:
    with pytest.raises(TenantValidationError) as info:
        TenantsConfig(tenants, anonymous_tenant_id=anonymous)
    assert (info.value.param, info.value.tenant_index) == (param, index)


def test_reserved_fractions_summing_to_one_pass_despite_float_error() -> None:
    tenants = TenantsConfig(
        tuple(
            TenantConfig(
                id=f"t{i}",
                api_key_sha256=(hash_api_key(f"k{i}"),),
                tier="burstable",
                reserved_kv_fraction=f,
            )
            for i, f in enumerate((0.33, 0.56, 0.11))
        )
    )
    assert 0.33 + 0.56 + 0.11 > 1.0  # the float sum really is over 1
    assert tenants.ids == ("t0", "t1", "t2")


def test_tenants_config_survives_pickling() -> None:
    # Engine messages may cross a process boundary later; the key index must travel too.
    tenants = pickle.loads(pickle.dumps(_tenants()))
    assert tenants == _tenants()
    assert tenants.authenticate("k-pay").id == "pay"
    assert tenants.authenticate(None).id == "free"
