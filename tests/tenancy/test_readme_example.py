"""The tenants.toml example in the README parses (so the documentation stays true)."""

from __future__ import annotations

import re
from pathlib import Path

from sits.tenancy import Tier, hash_api_key, parse_tenants

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tenants_example_parses() -> None:
    example = re.search(r"```toml\n(.*?)```", README.read_text(), re.S).group(1)
    example = example.replace("<64 hex chars: sits tenants hash-key KEY>", hash_api_key("key"))
    tenants = parse_tenants(example, "README.md")
    payments = tenants.get("payments")
    assert payments.tier is Tier.GUARANTEED and payments.reserved_kv_fraction == 0.5
    assert tenants.authenticate("key") == payments
    assert tenants.authenticate("other") is None
