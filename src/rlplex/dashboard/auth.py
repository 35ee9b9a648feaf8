"""Who may see the dashboard: every request carries its token, or is refused with 401.

The token is derived from the job's token (`job.token`, HMAC-SHA256 with a fixed label), not the
job's token itself: the link the dashboard prints ends up in browser histories and terminal
scroll-back, and the job's token drives every node of the job. Whoever can read `job.token` can
derive the dashboard's token, so the dashboard adds no second secret to keep; a folder without a
job token (a classic-RL run without `--supervise`) gets a random token per dashboard process.

The first link carries it as `?token=`; the answer sets it as a cookie (HttpOnly,
SameSite=Strict, one name per port: cookies do not tell ports apart) and redirects to the same
page without it, so it leaves the address bar. Scripts may send `Authorization: Bearer TOKEN`
instead. Every comparison is constant-time. Actions (POST) also need the `X-Rlplex-Action`
header: a page on another site can make a browser post a form, but not set a header without a
CORS preflight, which the dashboard never answers.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlplex.control.job.token import TOKEN_FILE, read_token

TOKEN_LABEL = b"rlplex dashboard v1"
ACTION_HEADER = b"x-rlplex-action"
# Headers on every answer: no framing (a framed page could be clicked into an action), no
# referrer (the first address holds the token), nothing loaded from anywhere but the dashboard.
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"cache-control", b"no-store"),
]


def dashboard_token(output_dir: Path) -> str:
    """The dashboard token of the job in `output_dir`; a random one when it has no job token."""
    if not (output_dir / TOKEN_FILE).exists():
        return secrets.token_hex(16)
    return hmac.new(read_token(output_dir), TOKEN_LABEL, hashlib.sha256).hexdigest()[:32]


def cookie_name(port: int | None) -> str:
    return f"rlplex_dashboard_{port or 0}"


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


class TokenGate:
    """ASGI middleware: lets a request through only with the token (query, cookie or header)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: no peer
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        port = scope.get("server", (None, None))[1]
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((value for name, value in query if name == "token"), None)
        if from_query is not None and _same(from_query, self.token):
            await self._set_cookie_and_redirect(scope, send, port, [(k, v) for k, v in query if k != "token"])
            return
        cookies = SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # a malformed cookie header is no token; SimpleCookie raises CookieError
            cookies = SimpleCookie()
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        given = [morsel.value for name, morsel in cookies.items() if name == cookie_name(port)]
        if bearer.lower().startswith("bearer "):
            given.append(bearer[7:].strip())
        # Every candidate is compared, so the time taken does not tell which one was present.
        allowed = [_same(value, self.token) for value in given]
        if not any(allowed):
            await _answer(send, 401, b"401: this dashboard needs its token: open the link it printed\n")
            return
        if scope["method"] not in ("GET", "HEAD") and ACTION_HEADER not in headers:
            await _answer(send, 403, b"403: actions are sent by the dashboard's page only\n")
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, secured)

    async def _set_cookie_and_redirect(
        self, scope: Scope, send: Send, port: int | None, rest: list[tuple[str, str]]
    ) -> None:
        # One leading slash: "//host/x" would send the browser to another site.
        location = "/" + scope.get("path", "/").lstrip("/") + (f"?{urlencode(rest)}" if rest else "")
        cookie = f"{cookie_name(port)}={self.token}; Path=/; HttpOnly; SameSite=Strict"
        await _answer(send, 303, b"", [(b"location", location.encode()), (b"set-cookie", cookie.encode())])


async def _answer(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": [*headers, *(extra or []), *SECURITY_HEADERS]}
    )
    await send({"type": "http.response.body", "body": body})
