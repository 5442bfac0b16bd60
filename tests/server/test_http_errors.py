"""Unknown routes and wrong methods get 404/405 in OpenAI's error format, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.waits import HANG_S


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nope", 404),
        ("GET", "/", 404),
        ("POST", "/v1/tokenize", 404),
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
    ],
)
def test_unknown_route_or_method(server, method: str, path: str, status: int) -> None:
    response = httpx.request(method, server.base_url + path, timeout=HANG_S)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] in ("not_found", "method_not_allowed")
    assert httpx.get(server.base_url + "/health", timeout=HANG_S).status_code == 200


def test_nan_temperature_is_rejected(server) -> None:
    model = httpx.get(server.base_url + "/v1/models", timeout=HANG_S).json()["data"][0]["id"]
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=body % model,
        headers={"content-type": "application/json"},
        timeout=HANG_S,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"


def test_a_body_that_is_not_utf8_is_a_400_that_says_so(server) -> None:
    """Not FastAPI's generic "There was an error parsing the body" (Latin-1 'café')."""
    body = b'{"model": "m", "prompt": "caf\xe9", "max_tokens": 2}'
    at = body.index(b"\xe9")  # 29: where the bad byte is
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(
            server.base_url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=HANG_S,
        )
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": "The body is not valid UTF-8 (invalid continuation byte at byte "
                f"{at}): send the JSON encoded as UTF-8.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
