"""The orchestrator's most frequent routes answered without FastAPI's per-request machinery.

A node sends a heartbeat every few seconds and a lease and a submission per work unit, so these
three routes are nearly all of an orchestrator's traffic. FastAPI spends about as much CPU on
each of them (routing, dependency solving, re-validating the reply) as the database work itself.
:class:`HotRoutes` is an ASGI middleware that sits inside the body-size limit and answers
``POST /pools/{pool_id}/heartbeat``, ``/lease`` and ``/submissions`` itself, doing exactly what
the FastAPI route does, in the same order:

1. the body is parsed as JSON (an empty body, one that is not JSON or nests too deep, or a
   content type other than ``application/json`` falls through to FastAPI, which answers it as
   it always did);
2. the request's signature, time window and nonce are checked (``swarmrl.identity.requests``);
3. the body is validated against the route's message type (errors are a 422 in FastAPI's words,
   located under ``body``);
4. the pool operation runs (the same function the FastAPI route calls) and its reply is sent.

A peer's fault is answered by ``on_peer_error`` (the app's 4xx mapping) and an infrastructure
fault by ``on_infra_error`` (503); anything else propagates like any route's exception. Requests
that do not match a hot route exactly — another method, an id outside its pattern, a query
string — go to FastAPI untouched. The FastAPI routes stay registered: they document the API and
serve whatever falls through.

Knows nothing about what the operations do (``swarmrl.pool.service`` / ``work``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from swarmrl.errors import InfraError, Malformed, PeerError
from swarmrl.identity.requests import SignedRequest
from swarmrl.protocol.pool import POOL_ID_PATTERN


@dataclass(frozen=True)
class HotRoute:
    """One route: its body type (None = the body is signed but not read) and its operation.

    ``run(pool_id, who, body)`` returns the reply model; it may raise :class:`PeerError`.
    ``claims_nonce``: the request is verified with ``claim=False`` and ``run`` claims the nonce
    in its own transaction (``who.nonce_claimed`` is False), before it acts."""

    template: str  # the FastAPI path template, the metrics' route label
    body: type[BaseModel] | None
    run: Callable[[str, SignedRequest, Any], Awaitable[BaseModel]]
    claims_nonce: bool = False


@dataclass(frozen=True)
class _Template:
    """Stands in for the matched FastAPI route in the ASGI scope (``scope["route"].path``)."""

    path: str


class HotRoutes:
    """ASGI middleware: answers the routes in ``routes`` (by last path segment) itself."""

    def __init__(
        self,
        app: Any,
        routes: dict[str, HotRoute],
        verify: Callable[..., SignedRequest],
        on_peer_error: Callable[[PeerError], Any],
        on_infra_error: Callable[[InfraError], Any],
    ) -> None:
        """``verify(method, path, body, headers, *, claim)``: the app's request verifier."""
        self.app, self.routes, self.verify = app, routes, verify
        self.on_peer_error, self.on_infra_error = on_peer_error, on_infra_error
        names = "|".join(re.escape(name) for name in routes)
        pool_id = POOL_ID_PATTERN.removeprefix("^").removesuffix("$")
        self.pattern = re.compile(rf"/pools/({pool_id})/({names})")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["query_string"]:
            raw = scope.get("raw_path") or scope["path"].encode()
            match = self.pattern.fullmatch(raw.decode("latin-1"))
        if match is None:
            await self.app(scope, receive, send)
            return
        message = await _whole_body(receive)
        body = message["body"]
        route = self.routes[match[2]]
        parsed = _json_body(body, _headers(scope)) if route.body is not None else None
        if parsed is _NOT_JSON:
            await self.app(scope, _replay(message, receive), send)
            return
        scope["route"] = _Template(route.template)
        try:
            reply = await self._answer(route, match[1], body, parsed, scope)
        except PeerError as exc:
            await self.on_peer_error(exc)(scope, receive, send)
            return
        except InfraError as exc:
            await self.on_infra_error(exc)(scope, receive, send)
            return
        payload = reply.model_dump_json().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _answer(
        self, route: HotRoute, pool_id: str, body: bytes, parsed: Any, scope: dict[str, Any]
    ) -> BaseModel:
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        who = self.verify("POST", path, body, _headers(scope), claim=not route.claims_nonce)
        value = None
        if route.body is not None:
            try:
                value = route.body.model_validate(parsed, from_attributes=True)  # as FastAPI
            except ValidationError as exc:
                located = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
                raise Malformed(error_summary(located)) from exc
        return await route.run(pool_id, who, value)


def error_summary(errors: Sequence[Any]) -> str:
    """The first five of pydantic's or FastAPI's validation ``errors`` as ``loc: msg`` (the
    input itself is left out: it may not even be JSON-serialisable, NaN)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
        for e in list(errors)[:5]
    )


_NOT_JSON = object()


class _Headers(dict):
    """Request headers by lower-case name (the verifier also asks by canonical name)."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)


def _headers(scope: dict[str, Any]) -> _Headers:
    """The scope's headers; of a repeated header the first, as Starlette's ``Headers`` gives."""
    cached = scope.get("swarmrl.headers")
    if cached is None:
        cached = _Headers()
        for key, value in scope["headers"]:
            cached.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        scope["swarmrl.headers"] = cached
    return cached


async def _whole_body(receive: Any) -> dict[str, Any]:
    """The request body as one ``http.request`` message (the app's body limit, outside this
    middleware, has already read and bounded it, so this is normally one message)."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return {"type": "http.request", "body": b"", "more_body": False}
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def _json_body(body: bytes, headers: _Headers) -> Any:
    """The body as FastAPI would parse it, or ``_NOT_JSON`` where FastAPI would not parse it
    or would refuse it (it then answers the request itself, exactly as before)."""
    content_type = headers.get("content-type")
    if not body or content_type is None or content_type.strip().lower() != "application/json":
        return _NOT_JSON
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # ValueError includes bad UTF-8 and bad JSON
        return _NOT_JSON


def _replay(message: dict[str, Any], receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A ``receive`` that hands ``message`` over once more, then defers to ``receive``."""
    sent = False

    async def again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return message
        return await receive()

    return again
