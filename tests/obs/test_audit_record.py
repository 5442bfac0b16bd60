"""The record's JSON body, the chain hash definition and the CompletionOutput adapter."""

from __future__ import annotations

import hashlib
import hmac
import json

from sits.core.outputs import CompletionOutput, Logprob
from sits.core.sampling_params import SamplingParams
from sits.obs.audit import (
    GENESIS_HASH,
    AuditTimings,
    canonical_json,
    samples_from_outputs,
    seal,
    to_jsonable,
)
from tests.obs.records import T0_UNIX_S, TEST_DIGEST, TEST_SALT, make_record, write_log


def test_body_fields_and_input_policy() -> None:
    stored = make_record(2).to_body(TEST_DIGEST)  # even i: the tenant allows storing the input
    hidden = make_record(3).to_body(TEST_DIGEST)
    assert stored["input"] == "prompt 2"
    assert hidden["input"] is None and hidden["kind"] == "request"

    def keyed(data: bytes) -> str:
        return hmac.new(TEST_SALT, data, hashlib.sha256).hexdigest()

    # keyed hashes, never a plain SHA-256 a guessed prompt could be checked against
    assert hidden["input_hmac"] == keyed(b"prompt 3")
    assert hidden["prompt_token_ids_hmac"] == keyed(b"[1,2,3,3]")
    assert hashlib.sha256(b"prompt 3").hexdigest() not in json.dumps(hidden)
    assert "input_sha256" not in hidden
    assert hidden["num_prompt_tokens"] == 4
    assert hidden["time"] == "2023-11-14T22:13:24.250000Z"  # finish = T0 + 3 + 1.25
    assert hidden["timings"] == {
        "arrival": "2023-11-14T22:13:23.000000Z",
        "first_token": "2023-11-14T22:13:23.500000Z",
        "finish": "2023-11-14T22:13:24.250000Z",
        "ttft_s": 0.5,
        "e2e_s": 1.25,
    }
    out = hidden["outputs"][0]
    assert out["token_ids"] == [103, 104, 105]
    assert out["tokens"][1] == {
        "id": 104,
        "logprob": -0.375 - 3 / 1024,
        "rank": 1,
        "top": [[104, -0.375 - 3 / 1024], [7, -4.5]],
    }
    assert hidden["trace_id"] == "0" * 31 + "3"


def test_unkeyed_hash_is_sha256_of_prev_plus_canonical_body(log_path) -> None:
    write_log(log_path, 3)
    lines = log_path.read_bytes().splitlines()
    prev = GENESIS_HASH
    header = json.loads(lines[0])
    assert header["kind"] == "header" and header["chain"] == "sha256"
    assert header["key_id"] is None and len(bytes.fromhex(header["input_salt"])) == 32
    for seq, raw in enumerate(lines):
        record = json.loads(raw)
        assert record["prev_hash"] == prev and record["seq"] == seq
        body = {k: v for k, v in record.items() if k != "hash"}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert record["hash"] == hashlib.sha256((prev + text).encode()).hexdigest()
        assert raw == canonical_json(record).encode()
        prev = record["hash"]


def test_seal_keeps_non_ascii_and_drops_non_finite() -> None:
    body = to_jsonable({"text": "café ✓", "lp": float("-inf"), "x": (1, 2)})
    sealed = seal(body, GENESIS_HASH)
    assert sealed["lp"] is None and sealed["x"] == [1, 2]
    assert "café ✓" in canonical_json(sealed)


def test_samples_from_completion_outputs_keep_top_k() -> None:
    position = {
        9: Logprob(-1.5, rank=3),
        4: Logprob(-0.5, rank=1),
        6: Logprob(-1.0, rank=2),
    }
    out = CompletionOutput(
        index=0,
        text="hi",
        token_ids=[9, 4],
        logprobs=[position, {4: Logprob(-0.25, rank=1)}],
        finish_reason="stop",
        stop_reason=4,
    )
    (sample,) = samples_from_outputs([out], max_top_logprobs=2)
    assert sample.token_ids == (9, 4)
    assert sample.finish_reason == "stop" and sample.stop_reason == 4
    first, second = sample.tokens
    assert (first.token_id, first.logprob, first.rank) == (9, -1.5, 3)
    assert first.top == ((4, -0.5), (6, -1.0))
    assert second.top == ((4, -0.25),)
    (bare,) = samples_from_outputs([CompletionOutput(index=1, text="x", token_ids=[1])], 5)
    assert bare.tokens is None


def test_sampling_params_to_jsonable() -> None:
    d = to_jsonable(SamplingParams(temperature=0.0, stop=["\n"], logprobs=3))
    assert d["temperature"] == 0.0 and d["stop"] == ["\n"] and d["logprobs"] == 3
    assert d["output_kind"] == 0  # enum -> value
    json.dumps(d)


def test_timings_from_monotonic() -> None:
    t = AuditTimings.from_monotonic(
        10.0, 10.5, 12.0, now_unix_s=T0_UNIX_S + 100.0, now_monotonic_s=100.0
    )
    assert t.arrival_unix_s == T0_UNIX_S + 10.0
    assert t.ttft_s == 0.5 and t.e2e_s == 2.0
