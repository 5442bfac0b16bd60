"""bench/qos/calibrate.py: rates from a measured capacity, and the written mix loads back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sits.bench.mix import load_tenants_mix
from sits.bench.workload import TenantLoad

ROOT = Path(__file__).resolve().parents[2]


def _calibrate():
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "bench/qos/calibrate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_are_share_and_flood() -> None:
    rates = _calibrate().calibrated_rates(10.0, 2, guaranteed_share=0.3, flood_factor=3.0)
    assert rates == pytest.approx([3.0, 21.0])
    assert _calibrate().calibrated_rates(8.0, 3, 0.25, 3.0) == pytest.approx([2.0, 9.0, 9.0])


def test_written_mix_loads_with_the_rates(tmp_path) -> None:
    capacity = tmp_path / "cap.json"
    capacity.write_text(json.dumps({"runs": {"fcfs": {"totals": {"request_throughput": 4.0}}}}))
    out = tmp_path / "mix.toml"
    assert _calibrate().main([str(capacity), str(ROOT / "bench/qos/mix.toml"), str(out)]) == 0
    tenants = {t.name: t for t in load_tenants_mix(str(out), TenantLoad())}
    assert tenants["gold"].request_rate == pytest.approx(1.2)
    assert tenants["burst"].request_rate == pytest.approx(8.4)
    assert tenants["gold"].api_key == "sk-bench-gold" and tenants["gold"].input_len == 512
    capacity_mix = load_tenants_mix(str(ROOT / "bench/qos/capacity.toml"), TenantLoad())
    assert [t.num_prompts for t in capacity_mix] == [300]
