"""The dashboard's HTTP routes: HTML pages, the step rows as JSON, static files, admin login.

Who may see what (docs/observability.md says why): the ledger explorer and the run overview
(curves, held-out accuracy) are public; the nodes, weight versions and node log tail pages need
the admin token, as the pool API's node list and logs need the owner's or orchestrator's
signature. The token is the secret in ``ui-admin-token`` beside the orchestrator's database
(created, mode 0600, the first time the dashboard starts; whoever can read the orchestrator's
files is admin). A browser signs in once at ``login`` (the token goes in a form, never a URL)
and gets an HttpOnly cookie; scripts may send ``Authorization: Bearer TOKEN`` instead. Pages
allow scripts and styles from this server only (Content-Security-Policy), so nothing is ever
loaded from another host.

What a page may cost the orchestrator that serves it: each client address gets ``burst``
requests at once and then ``per_s`` a second, sign-in attempts included (:class:`RateLimit`;
more is a 429 with Retry-After, answered before any routing and only once the wait is over);
pages are built in a child process (``.pagework``), never in the process whose event loop
answers the pool API, with at most ``queued`` waiting (more is a 503 with Retry-After); a
public page (overview, ledger, the step rows) built less than a second ago for the same path
and query is answered again as it was (:class:`FreshFor`). Static files are neither limited
nor queued. ``HEAD`` answers as ``GET`` does, without the body.

Knows nothing about where the data comes from (``.data``) or how pages look (``.pages``).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.staticfiles import StaticFiles

from swarmrl.errors import PeerError
from swarmrl.ledger.chain import ENTRY_KINDS
from swarmrl.roles.orchestrator.dashboard import pages
from swarmrl.roles.orchestrator.dashboard.data import RunData
from swarmrl.roles.orchestrator.dashboard.pagework import PageWork

STATIC = Path(__file__).with_name("static")
TOKEN_FILE = "ui-admin-token"
COOKIE = "swarmrl_ui_admin"
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'"
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
HEX = frozenset("0123456789abcdef")
MAX_PAGE = 500  # ledger entries on one page


def admin_token(home: Path) -> str:
    """The admin token stored in ``home/ui-admin-token``, created (0600) if missing."""
    path = home / TOKEN_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(secrets.token_urlsafe(24) + "\n")
        tmp.chmod(0o600)
        tmp.replace(path)
    return path.read_text().strip()


class RateLimit:
    """A token bucket per client address: ``burst`` requests at once, then ``per_s`` a second.

    At most ``clients`` buckets are kept; the least recently seen goes first (it comes back
    full). Used from the event loop's thread only."""

    def __init__(
        self,
        per_s: float = 1.0,
        burst: int = 8,
        clients: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_s, self.burst, self.clients, self.clock = per_s, burst, clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def wait_s(self, client: str) -> float:
        """0 and one token taken when ``client`` may go on; else the seconds until it may."""
        now = self.clock()
        tokens, at = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.per_s
        self._buckets[client] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        while len(self._buckets) > self.clients:
            self._buckets.popitem(last=False)
        return wait


class FreshFor:
    """Public answers kept ``ttl_s`` seconds by request (path and query), at most ``size``:
    however many clients reload a public page, it is built about once a second. Used from the
    event loop's thread."""

    def __init__(
        self, ttl_s: float = 1.0, size: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.size, self.clock = ttl_s, size, clock
        self._kept: OrderedDict[str, tuple[float, Any]] = OrderedDict()

    def get(self, key: str) -> Any:
        hit = self._kept.get(key)
        if hit is None or hit[0] < self.clock():
            return None
        return hit[1]

    def put(self, key: str, value: Any) -> None:
        self._kept.pop(key, None)
        self._kept[key] = (self.clock() + self.ttl_s, value)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


class _Asgi:
    """ASGI middleware, before any routing: the rate limit (static files aside), the security
    headers of every answer, and ``HEAD`` served as ``GET`` without the body (the headers,
    ``content-length`` included, are the ``GET``'s).

    A refused request is answered here, in a few bytes, and only once the client's wait is
    over (``Retry-After`` is then 1): a client that reloads as soon as it has an answer is
    slowed to the limit's pace instead of costing the event loop a refusal every few hundred
    microseconds. At most ``HELD`` refusals wait at a time; more are answered at once."""

    HELD = 64

    def __init__(self, app: Any, limit: RateLimit) -> None:
        self.app, self.limit = app, limit
        self._held = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = scope["method"] == "HEAD"
        if head:
            scope = {**scope, "method": "GET"}

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += SECURITY_HEADERS
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        if "/static/" not in scope["path"]:
            client = scope.get("client") or ("", 0)
            wait = self.limit.wait_s(client[0])
            if wait > 0:
                if self._held < self.HELD:
                    self._held += 1
                    try:
                        await asyncio.sleep(wait)
                    finally:
                        self._held -= 1
                    wait = 1.0 / self.limit.per_s  # the next request's share, at most
                retry = str(max(1, math.ceil(wait)))
                text = f"too many page loads from your address: try again in {retry} s\n"
                reply = PlainTextResponse(text, 429, headers={"retry-after": retry})
                await reply(scope, receive, with_headers)
                return
        await self.app(scope, receive, with_headers)


def build_dashboard(
    data: RunData,
    token: str,
    base: str = "/ui/",
    limit: RateLimit | None = None,
    work: PageWork | None = None,
    fresh: FreshFor | None = None,
) -> FastAPI:
    """The dashboard app over ``data``; mount it at ``base`` (which ends with ``/``). Pages are
    built by ``work`` (default: a child process over ``data.recipe()``), ``app.state.pages``;
    close it when done serving."""
    app = FastAPI(title="swarmrl dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Asgi, limit=limit or RateLimit())
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if work is None:
        work = PageWork(data.recipe())
        work.start()
    app.state.pages = work
    fresh = fresh or FreshFor()

    def is_admin(request: Request) -> bool:
        given = request.cookies.get(COOKIE, "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), token.encode())

    def html(body: str, status: int = 200, retry_after_s: int = 0) -> HTMLResponse:
        headers = {"cache-control": "no-store"}
        if retry_after_s > 0:
            headers["retry-after"] = str(retry_after_s)
        return HTMLResponse(body, status, headers=headers)

    def busy() -> Response | None:
        """The answer while pages are queued full (rate limits are the middleware's)."""
        if work.full():
            text = "the dashboard is busy: try again in a moment"
            return html(pages.message("busy", text, base), 503, 2)
        return None

    async def built(what: str, *args: Any) -> Any:
        try:
            return await work.run(what, *args)
        except BrokenProcessPool as exc:
            raise _Restarting from exc

    async def page(what: str, *args: Any) -> Response:
        return busy() or html(await built(what, *args))

    async def public(request: Request, what: str, *args: Any) -> Any:
        """What ``what`` builds, from ``fresh`` when built for this request less than its
        TTL ago (public answers only: the same for every client)."""
        key = f"{request.url.path}?{request.url.query}"
        value = fresh.get(key)
        if value is None:
            value = await built(what, *args)
            fresh.put(key, value)
        return value

    def sign_in(next_page: str) -> Response:
        return RedirectResponse(f"{base}login?next={next_page}", 303)

    @app.exception_handler(PeerError)
    async def _not_here(_: Request, exc: PeerError) -> HTMLResponse:
        return html(pages.message("not found", str(exc), base), 404)

    @app.exception_handler(_Restarting)
    async def _restarting(_: Request, exc: _Restarting) -> HTMLResponse:
        text = "the dashboard's page process stopped and is starting again: retry"
        return html(pages.message("restarting", text, base), 503, 2)

    @app.get("/")
    async def overview(request: Request) -> Response:
        return busy() or html(await public(request, "overview", base))

    @app.get("/api/steps")
    async def steps(request: Request) -> Response:
        no_store = {"cache-control": "no-store"}
        return busy() or JSONResponse(await public(request, "step_rows"), headers=no_store)

    @app.get("/nodes")
    async def nodes(request: Request) -> Response:
        if not is_admin(request):
            return sign_in("nodes")
        return await page("nodes", base)

    @app.get("/nodes/{pool_id}/{node_id}/logs")
    async def node_logs(pool_id: str, node_id: str, request: Request) -> Response:
        if not is_admin(request):
            return sign_in(f"nodes/{pool_id}/{node_id}/logs")
        return await page("node_logs", pool_id, node_id, base)

    @app.get("/versions")
    async def versions(request: Request) -> Response:
        if not is_admin(request):
            return sign_in("versions")
        return await page("versions", base)

    @app.get("/ledger")
    async def ledger(
        request: Request, node: str = "", kind: str = "", before: int = -1, limit: int = 50
    ) -> Response:
        node, kind = node.strip().lower(), kind.strip()
        if not set(node) <= HEX or len(node) > 32:
            return html(pages.message("bad filter", "node ids are 32 hex digits", base), 400)
        if kind and kind not in ENTRY_KINDS:
            known = ", ".join(ENTRY_KINDS)
            return html(pages.message("bad filter", f"kind is one of {known}", base), 400)
        query = pages.LedgerQuery(node, kind, before if before >= 0 else None)
        return busy() or html(
            await public(request, "ledger", query, max(1, min(limit, MAX_PAGE)), base)
        )

    @app.get("/login")
    async def login_form(next: str = "") -> Response:
        return html(pages.login(_safe_next(next), base))

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body())[:4096].decode("utf-8", "replace"))
        given = form.get("token", [""])[0].strip()
        target = _safe_next(form.get("next", [""])[0])
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            return html(pages.login(target, base, failed=True), 403)
        reply = RedirectResponse(f"{base}{target}", 303)
        reply.set_cookie(COOKIE, token, httponly=True, samesite="strict", path=base)
        return reply

    return app


class _Restarting(Exception):
    """The page process died while building this page (the next page starts another)."""


def _safe_next(target: str) -> str:
    """A relative page path inside the dashboard (never another host or an absolute path)."""
    target = target.strip()
    if not target or target.startswith(("/", "\\")) or ":" in target or ".." in target:
        return ""
    return target[:300]
