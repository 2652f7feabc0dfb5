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

Steps 1 and 3 are first tried as one: pydantic's own JSON parser validating the bytes straight
into the message (half the CPU of ``json.loads`` and then validating the objects it built, most
of a large submission's parsing). Only a body it refuses takes the two steps above, which then
decide, as FastAPI would, whether it falls through or what the 422 says. Where both accept a
body they give the same message (``tests/test_pool_hotroutes.py`` holds the edge cases:
duplicate keys, number spellings, escapes, signed zeros, subnormals).

A peer's fault is answered by ``on_peer_error`` (the app's 4xx mapping) and an infrastructure
fault by ``on_infra_error`` (503); anything else propagates like any route's exception. Requests
that do not match a hot route exactly — another method, an id outside its pattern, a query
string — go to FastAPI untouched. The FastAPI routes stay registered: they document the API and
serve whatever falls through.

The server's direct lane (``swarmrl.protocol.fastlane``) hands :class:`HotLane` the same
requests straight from uvicorn's parser, before any ASGI machinery, and writes its answer in one
socket write; the middleware answers what the lane did not take (a pipelined request, a server
without the lane, an in-process call of the app). Both time each answer under its route
template, as the app's request timer does.

Knows nothing about what the operations do (``swarmrl.pool.trust.service`` / ``flow.work``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from swarmrl.errors import InfraError, Malformed, OversizedRequest, PeerError
from swarmrl.identity.requests import SignedRequest
from swarmrl.protocol.fastlane import Answer, Headers
from swarmrl.protocol.pool import POOL_ID_PATTERN


@dataclass(frozen=True)
class HotRoute:
    """One route: its body type (None = the body is signed but not read) and its operation.

    ``run(pool_id, who, body)`` returns the reply model; it may raise :class:`PeerError`.
    ``claims_nonce``: the request is verified with ``claim=False`` and ``run`` claims the nonce
    in its own transaction (``who.nonce_claimed`` is False), before it acts."""

    template: str  # the FastAPI path template, the metrics' route label
    body: type[BaseModel] | None
    run: Callable[[str, SignedRequest, Any], BaseModel]
    claims_nonce: bool = False


@dataclass(frozen=True)
class _Template:
    """Stands in for the matched FastAPI route in the ASGI scope (``scope["route"].path``)."""

    path: str


Observe = Callable[[str, int, float], None]  # (route template, status, seconds)


class HotLane:
    """The hot routes' answers, for the ASGI middleware and for the server's direct lane
    (``swarmrl.protocol.fastlane.Lane``: uvicorn's parser hands complete requests to
    :meth:`answer`, which times them itself; ``observe`` records the time)."""

    def __init__(
        self,
        routes: dict[str, HotRoute],
        verify: Callable[..., SignedRequest],
        on_peer_error: Callable[[PeerError], Response],
        on_infra_error: Callable[[InfraError], Response],
        max_body_bytes: int,
        observe: Observe,
    ) -> None:
        """``verify(method, path, body, headers, *, claim)``: the app's request verifier;
        ``on_peer_error`` / ``on_infra_error``: the app's error answers."""
        self.routes, self.verify = routes, verify
        self.on_peer_error, self.on_infra_error = on_peer_error, on_infra_error
        self.max_body_bytes, self.observe = max_body_bytes, observe
        names = "|".join(re.escape(name) for name in routes)
        pool_id = POOL_ID_PATTERN.removeprefix("^").removesuffix("$")
        self.pattern = re.compile(rf"/pools/({pool_id})/({names})")
        self._oversized = _answer_of(
            on_peer_error(
                OversizedRequest(f"request body exceeds the limit of {max_body_bytes} bytes")
            )
        )

    def with_verify(self, verify: Callable[..., SignedRequest]) -> HotLane:
        """The same lane with another request verifier."""
        return HotLane(
            self.routes,
            verify,
            self.on_peer_error,
            self.on_infra_error,
            self.max_body_bytes,
            self.observe,
        )

    def match(self, path: str) -> re.Match[str] | None:
        """The route and pool id of a ``POST`` to ``path`` (raw, latin-1), or None."""
        return self.pattern.fullmatch(path)

    def respond(self, match: re.Match[str], body: bytes, headers: _Headers) -> Answer | None:
        """The answer to a complete request of a matched route, or None where FastAPI answers
        it (a body FastAPI would not parse as JSON)."""
        route = self.routes[match[2]]
        value = parsed = None
        if route.body is not None:
            value = _validated(route.body, body, headers)
            if value is None:  # refused by pydantic's parser: parsed as FastAPI would
                parsed = _json_body(body, headers)
                if parsed is _NOT_JSON:
                    return None
        try:
            reply = self._run(route, match, body, value, parsed, headers)
        except PeerError as exc:
            return _answer_of(self.on_peer_error(exc))
        except InfraError as exc:
            return _answer_of(self.on_infra_error(exc))
        return Answer(200, [_JSON], reply.model_dump_json().encode())

    def _run(
        self,
        route: HotRoute,
        match: re.Match[str],
        body: bytes,
        value: BaseModel | None,
        parsed: Any,
        headers: _Headers,
    ) -> BaseModel:
        who = self.verify("POST", match[0], body, headers, claim=not route.claims_nonce)
        if route.body is not None and value is None:
            try:
                value = route.body.model_validate(parsed, from_attributes=True)  # as FastAPI
            except ValidationError as exc:
                located = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
                raise Malformed(error_summary(located)) from exc
        return route.run(match[1], who, value)

    # -- the direct lane (swarmrl.protocol.fastlane.Lane) ----------------------------------
    def wants(self, raw_path: bytes) -> bool:
        return self.match(raw_path.decode("latin-1")) is not None

    def answer(self, raw_path: bytes, headers: Headers, body: bytes) -> Answer | None:
        started = time.perf_counter()
        match = self.match(raw_path.decode("latin-1"))
        if match is None:
            return None
        answer = self.respond(match, body, headers_of(headers))
        if answer is not None:
            template = self.routes[match[2]].template
            self.observe(template, answer.status, time.perf_counter() - started)
        return answer

    def too_large(self) -> Answer:
        self.observe("unmatched", self._oversized.status, 0.0)  # as the ASGI body limit's
        return self._oversized


class HotRoutes:
    """ASGI middleware: answers the routes of ``lane`` (by last path segment) itself."""

    def __init__(self, app: Any, lane: HotLane) -> None:
        self.app, self.lane = app, lane

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["query_string"]:
            raw = scope.get("raw_path") or scope["path"].encode()
            match = self.lane.match(raw.decode("latin-1"))
        if match is None:
            await self.app(scope, receive, send)
            return
        message = await _whole_body(receive)
        scope["route"] = _Template(self.lane.routes[match[2]].template)
        answer = self.lane.respond(match, message["body"], _headers(scope))
        if answer is None:
            del scope["route"]
            await self.app(scope, _replay(message, receive), send)
            return
        headers = [*answer.headers, (b"content-length", b"%d" % len(answer.body))]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})


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
    """The scope's headers (see :func:`headers_of`), read once per request."""
    cached = scope.get("swarmrl.headers")
    if cached is None:
        cached = scope["swarmrl.headers"] = headers_of(scope["headers"])
    return cached


def headers_of(raw: Headers) -> _Headers:
    """Headers by lower-case name; of a repeated header the first, as Starlette's gives."""
    found = _Headers()
    for key, value in raw:
        found.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
    return found


def _answer_of(response: Response) -> Answer:
    """A Starlette response's status, headers (its content length left out) and body."""
    headers = [(k, v) for k, v in response.raw_headers if k != b"content-length"]
    return Answer(response.status_code, headers, bytes(response.body))


_JSON = (b"content-type", b"application/json")


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


def _validated(message: type[BaseModel], body: bytes, headers: _Headers) -> BaseModel | None:
    """``body`` validated as ``message`` by pydantic's JSON parser in one pass, or None where
    FastAPI would not parse it (see :func:`_json_body`) or pydantic refuses it."""
    content_type = headers.get("content-type")
    if not body or content_type is None or content_type.strip().lower() != "application/json":
        return None
    try:
        return message.model_validate_json(body)
    except ValidationError:
        return None


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
