"""The dashboard's HTTP routes: HTML pages, the step rows as JSON, static files, admin login.

Everything is read-only and public except node log tails, which need the admin token: the
secret in ``ui-admin-token`` beside the orchestrator's database (created, mode 0600, the first
time the dashboard starts; whoever can read the orchestrator's files is admin). A browser
signs in once at ``login`` (the token goes in a form, never a URL) and gets an HttpOnly cookie;
scripts may send ``Authorization: Bearer TOKEN`` instead. Pages allow scripts and styles from
this server only (Content-Security-Policy), so nothing is ever loaded from another host.

Knows nothing about where the data comes from (``.data``) or how pages look (``.pages``).
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from swarmrl.errors import PeerError
from swarmrl.roles.orchestrator.dashboard import pages
from swarmrl.roles.orchestrator.dashboard.data import RunData

STATIC = Path(__file__).with_name("static")
TOKEN_FILE = "ui-admin-token"
COOKIE = "swarmrl_ui_admin"
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'"


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


class _Headers:
    """ASGI middleware: the security headers of every dashboard answer."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
            await send(message)

        await self.app(scope, receive, with_headers)


def build_dashboard(data: RunData, token: str, base: str = "/ui/") -> FastAPI:
    """The dashboard app over ``data``; mount it at ``base`` (which ends with ``/``)."""
    app = FastAPI(title="swarmrl dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Headers)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def is_admin(request: Request) -> bool:
        given = request.cookies.get(COOKIE, "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), token.encode())

    def html(body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(body, status, headers={"cache-control": "no-store"})

    @app.exception_handler(PeerError)
    async def _not_here(_: Request, exc: PeerError) -> HTMLResponse:
        return html(pages.message("not found", str(exc), base), 404)

    @app.get("/")
    def overview() -> HTMLResponse:
        return html(pages.overview(data, base))

    @app.get("/api/steps")
    def steps() -> JSONResponse:
        return JSONResponse(data.step_rows(), headers={"cache-control": "no-store"})

    @app.get("/nodes")
    def nodes() -> HTMLResponse:
        return html(pages.nodes(data, base))

    @app.get("/nodes/{pool_id}/{node_id}/logs")
    def node_logs(pool_id: str, node_id: str, request: Request) -> Response:
        if not is_admin(request):
            return RedirectResponse(f"{base}login?next=nodes/{pool_id}/{node_id}/logs", 303)
        return html(pages.node_logs(pool_id, node_id, data.node_logs(pool_id, node_id), base))

    @app.get("/versions")
    def versions() -> HTMLResponse:
        return html(pages.versions(data, base))

    @app.get("/ledger")
    def ledger(node: str = "", kind: str = "", limit: int = 200) -> HTMLResponse:
        return html(pages.ledger(data, node[:64], kind[:64], max(1, min(limit, 5000)), base))

    @app.get("/login")
    def login_form(next: str = "") -> HTMLResponse:
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


def _safe_next(target: str) -> str:
    """A relative page path inside the dashboard (never another host or an absolute path)."""
    target = target.strip()
    if not target or target.startswith(("/", "\\")) or ":" in target or ".." in target:
        return ""
    return target[:300]
