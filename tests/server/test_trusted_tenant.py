"""The router's trusted tenant header: only the router key may name a request's tenant in
`x-sits-tenant`; every other key authenticates as before, its header ignored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from sits.core.fleet import TENANT_HEADER
from sits.server.context import ServerSettings
from sits.server.errors import install_error_handlers
from sits.server.qos.admit import (
    QosSettings,
    request_tenant,
    require_model_reader,
    require_tenant,
)
from sits.tenancy import TenantsConfig
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import NEVER_OVERLOADED, key_of, scrape, tenant, tenant_engine

ROUTER_KEY = "router-secret"
TENANTS = TenantsConfig((tenant("gold"), tenant("free")))


def _client(settings: ServerSettings) -> TestClient:
    """An app whose one route answers the authenticated tenant's id."""
    app = FastAPI()
    install_error_handlers(app)
    tenants = settings.tenants_config()
    app.state.ctx = SimpleNamespace(
        settings=settings,
        qos=SimpleNamespace(tenants=tenants, authenticate=tenants.authenticate),
    )

    @app.get("/whoami", dependencies=[Depends(require_tenant)])
    async def whoami(request: Request) -> dict[str, str]:
        return {"tenant": request_tenant(request).id}

    return TestClient(app)


def _ask(client: TestClient, key: str | None, tenant_id: str | None) -> tuple[int, str]:
    """(status, tenant id or error code) of one request."""
    headers = {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if tenant_id is not None:
        headers[TENANT_HEADER] = tenant_id
    resp = client.get("/whoami", headers=headers)
    body = resp.json()
    return resp.status_code, body["tenant"] if resp.status_code == 200 else body["error"]["code"]


@pytest.mark.parametrize(
    ("key", "header", "expected"),
    [(ROUTER_KEY, "gold", (200, "gold")),
     (ROUTER_KEY, "free", (200, "free")),
     (ROUTER_KEY, "nobody", (401, "unknown_tenant")),
     (ROUTER_KEY, "default", (401, "unknown_tenant")),  # not a tenant of the file
     (ROUTER_KEY, None, (401, "missing_tenant_header")),
     (ROUTER_KEY, "", (401, "missing_tenant_header")),
     (key_of("gold"), "free", (200, "gold")),  # a tenant's key: the header is ignored
     (key_of("free"), None, (200, "free")),
     ("wrong", "gold", (401, "invalid_api_key")),
     (None, "gold", (401, "invalid_api_key")),
     (ROUTER_KEY + "x", "gold", (401, "invalid_api_key")),
     (ROUTER_KEY[:-1], "gold", (401, "invalid_api_key"))],
)  # fmt: skip
def test_with_a_tenants_file(key, header, expected) -> None:
    client = _client(ServerSettings(tenants=TENANTS, router_key=ROUTER_KEY))
    assert _ask(client, key, header) == expected


@pytest.mark.parametrize(
    ("api_key", "key", "header", "expected"),
    [("ak", ROUTER_KEY, None, (200, "default")),  # the router key alone: the default tenant
     ("ak", ROUTER_KEY, "default", (200, "default")),
     ("ak", ROUTER_KEY, "gold", (401, "unknown_tenant")),
     ("ak", "ak", "gold", (200, "default")),  # the API key: the header is ignored
     ("ak", None, "default", (401, "invalid_api_key")),
     ("ak", "wrong", "default", (401, "invalid_api_key")),
     (None, ROUTER_KEY, None, (200, "default")),
     (None, ROUTER_KEY, "x", (401, "unknown_tenant")),
     (None, "anything", "x", (200, "default")),  # no auth: anyone is default, header ignored
     (None, None, "x", (200, "default"))],
)  # fmt: skip
def test_without_a_tenants_file(api_key, key, header, expected) -> None:
    client = _client(ServerSettings(api_key=api_key, router_key=ROUTER_KEY))
    assert _ask(client, key, header) == expected


def test_the_router_key_alone_may_read_the_model_list() -> None:
    """The router learns a static replica's models with its key alone, even with a tenants
    file; generation routes still need the tenant named."""
    client = _client(ServerSettings(tenants=TENANTS, router_key=ROUTER_KEY))

    @client.app.get("/v1/models", dependencies=[Depends(require_model_reader)])
    async def models() -> dict[str, str]:
        return {"ok": "yes"}

    auth = {"Authorization": f"Bearer {ROUTER_KEY}"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert _ask(client, ROUTER_KEY, None) == (401, "missing_tenant_header")
    assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    assert client.get("/v1/models").status_code == 401
    tenant_auth = {"Authorization": f"Bearer {key_of('gold')}"}
    assert client.get("/v1/models", headers=tenant_auth).status_code == 200


def test_without_a_router_key_the_header_is_never_read() -> None:
    client = _client(ServerSettings(tenants=TENANTS))
    assert _ask(client, key_of("gold"), "free") == (200, "gold")
    assert _ask(client, ROUTER_KEY, "gold") == (401, "invalid_api_key")
    assert _ask(client, None, "gold") == (401, "invalid_api_key")
    open_client = _client(ServerSettings())
    assert _ask(open_client, "x", "gold") == (200, "default")


def test_a_live_request_with_the_router_key_is_served_as_the_named_tenant(tiny_moe_dir) -> None:
    qos = QosSettings(overload=NEVER_OVERLOADED)
    settings = ServerSettings(tenants=TENANTS, qos=qos, router_key=ROUTER_KEY)
    with LiveServer(tenant_engine(tiny_moe_dir, TENANTS), settings) as live:
        router = {"Authorization": f"Bearer {ROUTER_KEY}"}
        body = {"prompt": "def fibonacci(n):", "max_tokens": 2}
        with live.http() as http:
            for _ in range(2):
                resp = http.post(
                    "/v1/completions", json=body, headers={**router, TENANT_HEADER: "free"}
                )
                assert resp.status_code == 200, resp.text
            spoof = {"Authorization": f"Bearer {key_of('gold')}", TENANT_HEADER: "free"}
            assert http.post("/v1/completions", json=body, headers=spoof).status_code == 200
            refused = http.post("/v1/completions", json=body, headers=router)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "missing_tenant_header"
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            resp = http.post(
                "/v1/chat/completions", json=chat, headers={**router, TENANT_HEADER: "gold"}
            )
            assert resp.status_code == 200, resp.text
        value = scrape(live)
        assert value("sits:tenant_requests_total", tenant="free", outcome="ok") == 2
        assert value("sits:tenant_requests_total", tenant="gold", outcome="ok") == 2
