"""The inference server's key on every route: an ASGI middleware vLLM loads (`--middleware`).

vLLM's own `--api-key` check guards only the `/v1`, `/v2`, `/inference` and `/cohere` prefixes.
With runtime LoRA updating on (which the trainer's broadcasts need), its other routes would let
any local user generate with any run's adapter (`/invocations`), load weights from any folder the
job's user can read (`POST /adapters`), unload a run's adapter (`DELETE /adapters/<name>`), or read
`/metrics` and `/tokenize`. This middleware runs inside the server process and refuses every
request but `GET /health` (the liveness probe) without `Authorization: Bearer <key>`, the key
being the server's `VLLM_API_KEY`; a server started without a key refuses everything.

Imported by the vLLM API server (standard library and starlette only, no torch) and, for the
flag's value, by `rlplex.inference.vllm_server`, which needs no starlette for that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # starlette comes with vLLM; rlplex imports this module without it
    from starlette.types import ASGIApp, Receive, Scope, Send

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
MIDDLEWARE = f"{__name__}.RequireKeyEverywhere"
"""What `VLLMServer` passes to vLLM's `--middleware`."""


class RequireKeyEverywhere:
    """Pure ASGI middleware: 401 for any HTTP or WebSocket request without the key, but `/health`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        # Compared as digests, in constant time; no key at all matches nothing.
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def allowed(self, scope: Scope) -> bool:
        from starlette.datastructures import Headers

        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS and scope.get("method", "GET") in ("GET", "HEAD"):
            return True
        scheme, _, token = (Headers(scope=scope).get("authorization") or "").partition(" ")
        if self._digest is None or scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await JSONResponse({"error": "Unauthorized: this server needs its API key"}, status_code=401)(
            scope, receive, send
        )
