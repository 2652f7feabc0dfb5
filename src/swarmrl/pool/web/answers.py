"""How the orchestrator writes its HTTP answers: replies serialised once, the pool's error body
(``swarmrl.pool.rejections``) for a peer's fault, 503 for its own, and the request-body limit
that answers 413 before any route reads the body.

Knows nothing about the routes (``swarmrl.pool.web.app``).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from swarmrl.errors import InfraError, OversizedRequest, PeerError
from swarmrl.pool import rejections


class BodyLimit:
    """ASGI middleware: read the whole body up to ``limit`` bytes, answer 413 beyond it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                refused = OversizedRequest(f"request body exceeds the limit of {self.limit} bytes")
                await error_response(refused)(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
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
