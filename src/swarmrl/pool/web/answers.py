"""How the orchestrator writes its HTTP answers: replies serialised once, the pool's error body
(``swarmrl.pool.rejections``) for a peer's fault, 503 for its own, the request-body limit
that answers 413 before any route reads the body, and the HTTP limits of its servers (the
orchestrator's and its fronts') with their refusals (400, 408, 413, 431) in the same error form.

Knows nothing about the routes (``swarmrl.pool.web.app``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from swarmrl.errors import InfraError, NotFound, OversizedRequest, PeerError
from swarmrl.pool import rejections
from swarmrl.protocol.http_limits import HttpLimits

# the pool's error code of each status a refusal outside the pool's own rules answers with
# (HTTP framing, a route or method that does not exist); another 4xx is a plain peer error
REFUSAL_CODES = {
    404: NotFound.code,
    405: "method_not_allowed",
    408: "request_timeout",
    413: OversizedRequest.code,
    431: OversizedRequest.code,
}


def refusal_body(status: int, message: str) -> dict[str, Any]:
    """The pool's error body for a ``status`` refusal that no pool rule decided."""
    return rejections.error_body(REFUSAL_CODES.get(status, PeerError.code), message)


def _refusal(status: int, message: str) -> tuple[bytes, bytes]:
    return b"application/json", json.dumps(refusal_body(status, message)).encode()


def pool_limits(limits: HttpLimits, max_body_bytes: int) -> HttpLimits:
    """``limits`` with the pool's body cap and its error form for every refusal."""
    return dataclasses.replace(limits, max_body_bytes=max_body_bytes, refusal=_refusal)


class BodyLimit:
    """ASGI middleware: read the whole body up to ``limit`` bytes, answer 413 beyond it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        buffered, more = bytearray(), True  # one buffer: tiny messages cost their bytes only
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if len(buffered) + len(chunk) > self.limit:
                refused = OversizedRequest(f"request body exceeds the limit of {self.limit} bytes")
                await error_response(refused)(scope, receive, send)
                return
            buffered += chunk
            more = message.get("more_body", False)
        body = bytes(buffered)
        del buffered
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def json_reply(reply: BaseModel) -> Response:
    """``reply`` as a JSON response, serialised once: a route returning a model would have
    FastAPI validate it again against its ``response_model`` (the schema the docs show), which
    costs the hot routes as much as the database work of a heartbeat."""
    return Response(reply.model_dump_json(), media_type="application/json")


def error_response(exc: PeerError) -> JSONResponse:
    """The pool's error answer: ``{"error": {"code", "message"}}`` (``swarmrl.pool.rejections``)."""
    return JSONResponse(rejections.answer(exc), rejections.status_of(exc))


def unavailable(exc: InfraError) -> JSONResponse:
    """Our own fault (a full disk): the request changed nothing; the peer may try again."""
    body = {"error": {"code": "unavailable", "message": str(exc)}}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
