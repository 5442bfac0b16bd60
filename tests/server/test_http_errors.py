"""Unknown routes and wrong methods get 404/405 in OpenAI's error format, never a 500."""

from __future__ import annotations

import httpx
import pytest


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
    response = httpx.request(method, server.base_url + path, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] in ("not_found", "method_not_allowed")
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_nan_temperature_is_rejected(server) -> None:
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=body % model,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
