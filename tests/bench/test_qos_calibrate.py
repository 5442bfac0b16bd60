"""sits.bench.qos_calibrate: rates from a measured capacity, and the written mix loads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sits.bench import qos_calibrate, qos_combine
from sits.bench.mix import load_tenants_mix
from sits.bench.workload import TenantLoad

ROOT = Path(__file__).resolve().parents[2]


def test_rates_are_share_and_flood() -> None:
    rates = qos_calibrate.calibrated_rates(10.0, 2, guaranteed_share=0.3, flood_factor=3.0)
    assert rates == pytest.approx([3.0, 21.0])
    assert qos_calibrate.calibrated_rates(8.0, 3, 0.25, 3.0) == pytest.approx([2.0, 9.0, 9.0])


def test_written_mix_loads_with_the_rates(tmp_path) -> None:
    capacity = tmp_path / "cap.json"
    capacity.write_text(json.dumps({"runs": {"fcfs": {"totals": {"request_throughput": 4.0}}}}))
    out = tmp_path / "mix.toml"
    assert qos_calibrate.main([str(capacity), str(ROOT / "bench/qos/mix.toml"), str(out)]) == 0
    tenants = {t.name: t for t in load_tenants_mix(str(out), TenantLoad())}
    assert tenants["gold"].request_rate == pytest.approx(1.2)
    assert tenants["burst"].request_rate == pytest.approx(8.4)
    assert tenants["gold"].api_key == "sk-bench-gold" and tenants["gold"].input_len == 512
    capacity_mix = load_tenants_mix(str(ROOT / "bench/qos/capacity.toml"), TenantLoad())
    assert [t.num_prompts for t in capacity_mix] == [300]


def test_duration_override_replaces_every_tenants_count(tmp_path) -> None:
    capacity = tmp_path / "cap.json"
    capacity.write_text(json.dumps({"runs": {"fcfs": {"totals": {"request_throughput": 10.0}}}}))
    mix = tmp_path / "in.toml"
    mix.write_text(
        '[defaults]\nduration_s = 120\n[[tenants]]\nname = "a"\nnum_prompts = 5\n'
        '[[tenants]]\nname = "b"\nduration_s = 30\n'
    )
    out = tmp_path / "mix.toml"
    args = [str(capacity), str(mix), str(out), "--duration-s", "45"]
    assert qos_calibrate.main(args) == 0
    tenants = load_tenants_mix(str(out), TenantLoad())
    assert [(t.duration_s, t.num_prompts) for t in tenants] == [(45.0, None), (45.0, None)]
    assert [t.request_rate for t in tenants] == pytest.approx([3.0, 21.0])


def test_combine_puts_two_single_mode_runs_side_by_side(tmp_path) -> None:
    def doc(mode: str, tok_s: float) -> dict:
        summary = {"ttft_attainment_pct": 99.5, "tpot_attainment_pct": 100.0,
                   "slo_attainment_pct": 99.5, "goodput": 2.0, "output_throughput": tok_s,
                   "failed_429": 0, "failed_503": 1, "failed_other": 0}  # fmt: skip
        return {"command": f"run {mode}", "tenants": [{"name": "gold", "summary": summary}],
                "totals": dict(summary), "runs": {mode: {"tenants": [{"name": "gold",
                "summary": summary}], "totals": dict(summary)}}}  # fmt: skip

    paths = []
    for mode, tok_s in (("qos", 950.0), ("fcfs", 1000.0)):
        path = tmp_path / f"qos_{mode}.json"
        path.write_text(json.dumps(doc(mode, tok_s)))
        paths.append(str(path))
    out = tmp_path / "both.json"
    assert qos_combine.main([*paths, "--result-json", str(out)]) == 0
    combined = json.loads(out.read_text())
    assert combined["output_throughput_ratio"] == pytest.approx(0.95)
    assert list(combined["runs"]) == ["qos", "fcfs"]


def test_the_cpu_qos_files_load_with_scaled_slos() -> None:
    from sits.tenancy.loader import load_tenants

    tenants = {t.id: t for t in load_tenants(ROOT / "bench/qos/cpu_tenants.toml").tenants}
    assert (tenants["gold"].ttft_ms, tenants["gold"].tpot_ms) == (8000, 1500)
    assert (tenants["burst"].ttft_ms, tenants["burst"].tpot_ms) == (40000, 6000)
    mix = {t.name: t for t in load_tenants_mix(str(ROOT / "bench/qos/cpu_mix.toml"), TenantLoad())}
    assert mix["gold"].ttft_ms == 8000 and mix["burst"].tpot_ms == 6000
    assert mix["gold"].request_rate == pytest.approx(0.3 * 17.2, abs=0.05)
