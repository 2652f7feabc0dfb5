"""A direct lane through uvicorn's httptools protocol for a server's most frequent requests.

An ASGI request costs a server more than its own work when the work is small: uvicorn builds a
scope, starts an asyncio task, passes messages through every middleware, and writes the
response head and body in two socket writes (two TCP segments with ``TCP_NODELAY``, each
delivered and acknowledged on its own). A :class:`Lane` names the requests it answers itself;
:func:`with_lane` returns a subclass of a uvicorn httptools protocol class that, for those,
collects the body as the parser delivers it and, once the request is complete, answers it right
there in the protocol callback: one call of :meth:`Lane.answer`, one socket write.

Every request still arrives through the same parser and the same head limits and timers
(``swarmrl.protocol.http_limits``). The lane is taken only for a ``POST`` without a query
string that :meth:`Lane.wants`, on a connection with no other request in flight or queued
(so answers keep the order of requests), without ``Expect: 100-continue`` or an upgrade; a
body over :attr:`Lane.max_body_bytes` is answered with :meth:`Lane.too_large` and the
connection closed; where :meth:`Lane.answer` returns None (a body it does not handle) the
request goes to the ASGI app exactly as it would have, body included; an exception in the lane
is a 500, logged, and the connection closed. Answers are written synchronously, so the lane is
for work that does not wait on anything but the CPU and a local database.

Knows nothing about routes, signatures or what the answers say.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol
from urllib.parse import unquote

import httptools

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]  # (lower-case name, value) in arrival order


@dataclass(frozen=True)
class Answer:
    """A complete response: status, headers (``content-length`` is added), body."""

    status: int
    headers: Headers
    body: bytes


class Lane(Protocol):
    """The requests a server answers directly (see module docstring)."""

    max_body_bytes: int  # a longer body is refused with ``too_large()``

    def wants(self, raw_path: bytes) -> bool:
        """Whether a ``POST`` to ``raw_path`` (no query string) is this lane's."""

    def answer(self, raw_path: bytes, headers: Headers, body: bytes) -> Answer | None:
        """The answer to a complete request, or None: let the ASGI app answer it."""

    def too_large(self) -> Answer:
        """The answer to a body over ``max_body_bytes``."""


_PLAIN = [(b"content-type", b"text/plain; charset=utf-8")]
SERVER_ERROR = Answer(500, _PLAIN, b"Internal Server Error")  # a fault of ours answering


def decoded_path(raw_path: bytes) -> str:
    """A request's ``scope["path"]``: its raw path percent-decoded, as uvicorn decodes it (so
    ``/pools/%6fpen`` routes as ``/pools/open`` whichever server or front received it)."""
    path = raw_path.decode("latin-1")
    return unquote(path) if "%" in path else path


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and its line end."""
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def with_lane(base: type, lane: Lane) -> type:
    """A subclass of ``base`` (a uvicorn ``HttpToolsProtocol``, possibly guarded by
    ``http_limits``) that answers ``lane``'s requests directly."""

    class LaneProtocol(base):  # type: ignore[misc, valid-type]
        _lane_body: bytearray | None = None  # the lane's request under way: body so far
        _lane_path = b""

        def on_headers_complete(self) -> None:
            self._lane_body = None
            if self._lane_free() and self.parser.get_method() == b"POST":
                url = httptools.parse_url(self.url)
                if not url.query and lane.wants(url.path):
                    self._lane_body, self._lane_path = bytearray(), url.path
                    self._lane_head_done()
                    return
            super().on_headers_complete()

        def _lane_free(self) -> bool:
            idle = self.cycle is None or self.cycle.response_complete
            upgrade = self.parser.should_upgrade()
            return idle and not self.pipeline and not self.expect_100_continue and not upgrade

        def _lane_head_done(self) -> None:
            """What the head guard does when a head completes (no-op without the guard)."""
            if hasattr(self, "_head_complete"):
                self._head_complete()

        def on_body(self, body: bytes) -> None:
            if self._lane_body is None:
                super().on_body(body)
                return
            if self.transport.is_closing():
                return
            if hasattr(self, "_body_arrived") and not self._body_arrived(len(body)):
                self._lane_body = bytearray()  # refused by the head guard; let go of it
                return
            if len(self._lane_body) + len(body) > lane.max_body_bytes:
                self._lane_write(lane.too_large(), keep_alive=False)
                return
            self._lane_body += body  # one buffer: a body of tiny chunks costs its bytes only

        def on_message_complete(self) -> None:
            buffered = self._lane_body
            if buffered is None:
                super().on_message_complete()
                return
            self._lane_body = None
            if hasattr(self, "_body_done"):
                self._body_done()  # the head guard's body timer (no-op without the guard)
            if self.transport.is_closing():
                return
            body = bytes(buffered)
            try:
                answer = lane.answer(self._lane_path, self.headers, body)
            except Exception:  # a fault of ours: the peer gets a 500, the log the traceback
                log.exception("answering %r failed", self._lane_path)
                self._lane_write(SERVER_ERROR, keep_alive=False)
                return
            if answer is None:
                self._to_app(body)
                return
            self._lane_write(answer, keep_alive=self.parser.should_keep_alive())

        def _to_app(self, body: bytes) -> None:
            """Hand the complete request to the ASGI app, as if the lane were not there."""
            if hasattr(self, "_unanswered"):
                self._unanswered -= 1  # counted again by the guard's on_headers_complete
            super().on_headers_complete()
            if body:
                super().on_body(body)
            super().on_message_complete()

        def _lane_write(self, answer: Answer, keep_alive: bool) -> None:
            out = [status_line(answer.status)]
            for name, value in (*self.server_state.default_headers, *answer.headers):
                out += [name, b": ", value, b"\r\n"]
            out += [b"content-length: ", b"%d" % len(answer.body), b"\r\n"]
            if not keep_alive:
                out.append(b"connection: close\r\n")
            out += [b"\r\n", answer.body]
            self.transport.write(b"".join(out))
            if not keep_alive:
                self.transport.close()
            self.on_response_complete()

    return LaneProtocol
