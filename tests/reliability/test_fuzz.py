"""Fuzzing a live `sits serve`: hostile hand cases, then requests that schemathesis generates
from the server's own OpenAPI (valid and invalid ones). No 5xx, /health 200 throughout, and
the engine still answers after."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from tests.reliability.conftest import PROMPT, Serve, size
from tests.waits import HANG_S

pytestmark = pytest.mark.reliability

HEALTH_EVERY = 20  # requests between two /health checks
_BIG = 10**30

# (path, raw body): input every endpoint must refuse with 400 in OpenAI's format.
HAND_CASES: list[tuple[str, bytes]] = [
    ("/v1/completions", b""),
    ("/v1/completions", b"{"),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b"null"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b"\xff\xfe\x00garbage"),
    ("/v1/completions", b"[" * 10_000 + b"]" * 10_000),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": -Infinity}'),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/tokenize", b'{"prompt": "\\ud83d"}'),
]
for body in (
    {"prompt": PROMPT, "max_tokens": -1},
    {"prompt": PROMPT, "max_tokens": _BIG},
    {"prompt": PROMPT, "max_tokens": 2**63},
    {"prompt": PROMPT, "max_tokens": 1.5},
    {"prompt": PROMPT, "max_tokens": "3"},
    {"prompt": PROMPT, "n": 10_000},
    {"prompt": PROMPT, "n": 0},
    {"prompt": PROMPT, "best_of": _BIG},
    {"prompt": PROMPT, "logprobs": 10_000},
    {"prompt": PROMPT, "logprobs": -1},
    {"prompt": PROMPT, "temperature": -1},
    {"prompt": PROMPT, "top_p": 2},
    {"prompt": PROMPT, "top_k": -5},
    {"prompt": PROMPT, "seed": _BIG},
    {"prompt": PROMPT, "seed": -_BIG},
    {"prompt": PROMPT, "stop": [None]},
    {"prompt": PROMPT, "stop": {"a": 1}},
    {"prompt": PROMPT, "logit_bias": {"not-a-token": 1}},
    {"prompt": PROMPT, "logit_bias": {str(_BIG): 1}},
    {"prompt": PROMPT, "stream": "yes"},
    {"prompt": PROMPT, "stream_options": {"include_usage": "x"}},
    {"prompt": [_BIG]},
    {"prompt": [-1, 2]},
    {"prompt": [[1, 2], ["a"]]},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": None},
    {"prompt": {"text": PROMPT}},
    {"prompt": "x" * 200_000, "max_tokens": 2},
    {"prompt": PROMPT, "max_tokens": 2, "extra": {"deep": [1] * 10_000}, "echo": 7},
):
    HAND_CASES.append(("/v1/completions", json.dumps(body).encode()))
for body in (
    {"messages": []},
    {"messages": None},
    {"messages": [{}]},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": None, "tool_calls": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1000, "logprobs": True},
    {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "nope"}},
    {"messages": [{"role": "user", "content": "hi"}], "tools": "all"},
    {"messages": "hi"},
):
    HAND_CASES.append(("/v1/chat/completions", json.dumps(body).encode()))
for path, body in (
    ("/tokenize", {}),
    ("/tokenize", {"prompt": 5}),
    ("/detokenize", {"tokens": [_BIG]}),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": "abc"}),
):
    HAND_CASES.append((path, json.dumps(body).encode()))


def _hand_cases(server: Serve, figures: dict) -> None:
    with server.http(headers={"content-type": "application/json"}) as http:
        wrong = []
        for path, raw in HAND_CASES:
            resp = http.post(path, content=raw)
            figures["requests"] += 1
            figures["5xx"] += resp.status_code >= 500
            if resp.status_code != 400 or resp.json()["error"]["type"] != "invalid_request_error":
                wrong.append((path, raw[:100], resp.status_code, resp.text[:200]))
        assert wrong == []
        assert http.get("/health").status_code == 200


def _generated(server: Serve, figures: dict, budget: int) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # Operations without a body have small spaces; the bodies get what those leave.
    operations.sort(key=lambda op: op.body is not None and len(op.body) > 0)
    runs = [(op, mode) for op in operations for mode in GenerationMode]
    statuses: list[int] = []
    for index, (operation, mode) in enumerate(runs):
        share = math.ceil((budget - len(statuses)) / (len(runs) - index))
        if share <= 0:
            break

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=share,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def one(case: schemathesis.Case) -> None:
            resp = case.call(base_url=server.base_url, timeout=HANG_S)
            statuses.append(resp.status_code)
            assert resp.status_code < 500, (case.as_curl_command(), resp.text[:300])
            if len(statuses) % HEALTH_EVERY == 0:
                assert server.health().status_code == 200

        try:
            one()
        except Unsatisfiable:
            continue  # nothing invalid to send (an operation without parameters)
    figures["requests"] += len(statuses)
    figures["5xx"] += sum(code >= 500 for code in statuses)
    figures["generated"] = len(statuses)
    figures["statuses"] = {str(c): statuses.count(c) for c in sorted(set(statuses))}


def test_fuzzed_requests_get_no_5xx_and_the_server_stays_healthy(shared_server, figures) -> None:
    figures.update(requests=0, lost=0, **{"5xx": 0})
    _hand_cases(shared_server, figures)
    _generated(shared_server, figures, size("fuzz_requests"))
    assert figures["generated"] >= size("fuzz_requests") // 2
    assert shared_server.health().status_code == 200
    shared_server.complete()
    assert shared_server.wait_until_idle()
