"""The precision switch's server pieces without a server: the policy's wiring on a fake clock
(the exact tick that switches), the metrics' exact text, audit records with and without the
precision fields, and the --precision-* flags."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sits.admission import FakeClock, OverloadState
from sits.admission.precision_policy import PrecisionPolicyKind, PrecisionPolicySettings
from sits.cli.serve import main as serve_main
from sits.core.errors import InvalidParameterError
from sits.core.precision import PrecisionState
from sits.obs import AuditRecord, AuditTimings, find_records, verify_log
from sits.obs.audit import GENESIS_HASH, InputDigest, encode_line, seal
from sits.server.precision import PrecisionCollector, PrecisionSwitcher

OVERLOAD = PrecisionPolicySettings(PrecisionPolicyKind.OVERLOAD, red_s=5.0, green_s=30.0)


class FakeEngine:
    """`precision_state` / `set_precision` only, recording the calls."""

    def __init__(self, available: tuple[str, ...] = ("bf16", "int4")) -> None:
        self.state = PrecisionState(available[0], available)
        self.calls: list[str] = []

    def precision_state(self) -> PrecisionState:
        return self.state

    async def set_precision(self, name: str) -> PrecisionState:
        self.calls.append(name)
        if name not in self.state.available:
            raise InvalidParameterError("precision", f"unknown precision {name!r}")
        if name != self.state.current:
            switches = self.state.num_switches + 1
            self.state = dataclasses.replace(self.state, current=name, num_switches=switches)
        return self.state


def make_switcher(engine: FakeEngine, clock: FakeClock, states: list[OverloadState]):
    return PrecisionSwitcher(engine, OVERLOAD, lambda: states[-1], clock, poll_s=0.25)


def test_policy_ticks_switch_at_the_exact_second_and_resume_after_the_operator() -> None:
    async def scenario() -> list[tuple[float, str]]:
        clock, engine = FakeClock(), FakeEngine()
        states = [OverloadState.RED]
        switcher = make_switcher(engine, clock, states)
        done = []

        async def tick_at(now_s: float) -> None:
            clock.set(now_s)
            state = await switcher.tick()
            if state is not None:
                done.append((now_s, state.current))

        for now_s in (0.0, 2.5, 4.75):
            await tick_at(now_s)
        await tick_at(5.0)  # red since 0: low now
        clock.set(6.0)
        assert (await switcher.switch("bf16")).current == "bf16"  # the operator
        for now_s in (6.25, 10.75):
            await tick_at(now_s)
        await tick_at(11.0)  # 5 s of red counted from the operator's switch
        states.append(OverloadState.GREEN)
        await tick_at(12.0)
        await tick_at(41.75)
        await tick_at(42.0)  # green since 12
        assert engine.calls == ["int4", "bf16", "int4", "bf16"]
        return done

    assert asyncio.run(scenario()) == [(5.0, "int4"), (11.0, "int4"), (42.0, "bf16")]


def test_no_switch_refused() -> None:
    one_set = FakeEngine(("bf16",))
    with pytest.raises(InvalidParameterError, match="--precision-switch"):
        PrecisionSwitcher(one_set, OVERLOAD, lambda: OverloadState.GREEN, FakeClock(), 0.25)
    manual = PrecisionSwitcher(
        one_set, PrecisionPolicySettings(), lambda: OverloadState.GREEN, FakeClock(), 0.25
    )
    assert manual.state() is None
    with pytest.raises(InvalidParameterError) as err:
        asyncio.run(manual.switch("int4"))
    assert err.value.param == "precision" and one_set.calls == []
    unknown = PrecisionSwitcher(
        FakeEngine(), PrecisionPolicySettings(), lambda: OverloadState.GREEN, FakeClock(), 0.25
    )
    with pytest.raises(InvalidParameterError):
        asyncio.run(unknown.switch("fp4"))


def test_metrics_text_exact() -> None:
    engine = FakeEngine(("bf16", "fp8"))
    registry = CollectorRegistry()
    registry.register(PrecisionCollector(engine, "m"))
    asyncio.run(engine.set_precision("fp8"))
    lines = [x for x in generate_latest(registry).decode().splitlines() if not x.startswith("#")]
    assert lines == [
        'sits:weight_precision{model_name="m",precision="bf16"} 0.0',
        'sits:weight_precision{model_name="m",precision="fp8"} 1.0',
        'sits:precision_switches_total{model_name="m"} 1.0',
    ]
    one_set = CollectorRegistry()
    one_set.register(PrecisionCollector(FakeEngine(("bf16",)), "m"))
    assert generate_latest(one_set) == b""


def _record(request_id: str, **precision: object) -> AuditRecord:
    return AuditRecord(
        request_id=request_id,
        tenant="default",
        model="m",
        weights_digest="d",
        prompt_token_ids=(1, 2),
        input_text=None,
        store_input=False,
        sampling={},
        samples=(),
        timings=AuditTimings(1.0e9, None, 1.0e9 + 1),
        **precision,
    )


def test_audit_records_with_and_without_the_precision_fields(tmp_path) -> None:
    """A log whose first record predates the precision fields still verifies and reads."""
    digest = InputDigest(bytes(32))
    old = _record("old").to_body(digest)
    del old["precision"], old["precision_switches"]
    new = _record("new", precision="int4", precision_switches=2).to_body(digest)
    assert (new["precision"], new["precision_switches"]) == ("int4", 2)
    plain = _record("plain").to_body(digest)
    assert (plain["precision"], plain["precision_switches"]) == (None, 0)
    first = seal(old, GENESIS_HASH)
    second = seal(new, first["hash"])
    log = tmp_path / "audit.jsonl"
    log.write_bytes(encode_line(first) + encode_line(second))
    result = verify_log(log)
    assert result.ok and result.num_records == 2, result
    (rec,) = find_records(log, "old")
    assert "precision" not in rec
    (rec,) = find_records(log, "new")
    assert json.loads(encode_line(rec))["precision"] == "int4"


def test_overload_policy_flag_needs_the_switch(capsys) -> None:
    assert serve_main(["serve", "--precision-policy", "overload"]) == 2
    err = capsys.readouterr().err
    assert "--precision-policy overload" in err and "--precision-switch" in err
    for flag in ("--precision-red-seconds", "--precision-green-seconds"):
        with pytest.raises(SystemExit):
            serve_main(["serve", flag, "-1"])


def test_the_policy_timings_need_the_overload_policy(capsys) -> None:
    assert serve_main(["serve", "--precision-red-seconds", "3"]) == 2
    err = capsys.readouterr().err
    assert "--precision-red-seconds only apply with --precision-policy overload" in err
    assert (
        serve_main(["serve", "--precision-green-seconds", "3", "--precision-red-seconds", "1"]) == 2
    )
    err = capsys.readouterr().err
    assert "--precision-red-seconds and --precision-green-seconds only apply" in err
