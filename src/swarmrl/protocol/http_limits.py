"""Limits every swarmrl HTTP server puts on a connection before a request reaches the app.

uvicorn bounds neither the size of a request head (request line plus headers) nor the time a
peer may take to send it or its body, and a connection that never sends anything is never
dropped: one 96 MiB header, a body trickled in 2-byte chunks or a few hundred silent sockets tie
up a server. ``guarded_http(limits)`` returns a uvicorn HTTP protocol class (for
``uvicorn.Config(http=...)``) that

* answers ``431`` and closes the connection as soon as a head passes ``max_head_bytes``,
  counted on the bytes received (a head complete in one read is counted too);
* closes a connection whose head is not complete ``head_timeout_s`` seconds after it opened
  (a silent socket, a slow-loris header), or ``max(head_timeout_s, keep_alive_s)`` after its
  previous response ended;
* answers ``413`` and closes once a body passes ``max_body_bytes``, counted as it arrives on the
  wire (chunked framing included: 2-byte chunks cost their framing too), and ``408`` once a
  body is not complete ``body_timeout_s`` seconds after its head;
* drops (at once, unanswered) a connection that keeps sending requests while it leaves the
  answers unread: more than ``max_pipelined`` requests queued behind the one being answered,
  or more than ``max_unread_bytes`` of answers waiting for the peer to read them (uvicorn
  parses every request of a read it has taken in and queues them all: 80,000 tiny pipelined
  requests held about 200 MB);
* answers uvicorn's own ``400`` for an unparsable request the same way: every refusal's body
  is ``limits.refusal(status, message)`` (plain text unless the server says otherwise), with
  ``connection: close``; no answer is written where a response has already begun.

It leaves requests whose body has arrived alone (a long-poll may wait as long as it likes).
It wraps whichever parser uvicorn would pick (httptools when installed, else h11); over
httptools each request's scope also offers zero-copy file sends (``protocol.zerocopy``).

These hooks subclass uvicorn's own protocol classes, which are not a public interface: they are
used only on the uvicorn versions in :data:`TESTED_UVICORN`. On any other version
:func:`uvicorn_options` logs one line and returns plain uvicorn options (its keep-alive and h11
limits only; heads, bodies and their times then go unbounded by this module).

Knows nothing about routes, signatures or the apps it serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn

from swarmrl.protocol import zerocopy
from swarmrl.protocol.fastlane import Lane, with_lane

log = logging.getLogger(__name__)

# the (major, minor) versions of uvicorn, lowest and newest, whose private protocol classes the
# hooks here are tested on (pyproject.toml bounds the dependency to the same range)
TESTED_UVICORN = ((0, 47), (0, 55))

Refusal = Callable[[int, str], tuple[bytes, bytes]]  # (status, message) -> (content type, body)


def plain_refusal(status: int, message: str) -> tuple[bytes, bytes]:
    """A refusal as plain text: the message."""
    return b"text/plain; charset=utf-8", message.encode()


@dataclass(frozen=True)
class HttpLimits:
    """What a peer may cost a server before its request is complete."""

    max_head_bytes: int = 64 * 1024  # request line + headers, bytes
    head_timeout_s: float = 10.0  # to send a complete head, from connect or the last response
    keep_alive_s: float = 5.0  # uvicorn's idle keep-alive after a response (clients stay below)
    max_body_bytes: int = 8 << 20  # a body as received, chunked framing included
    body_timeout_s: float = 30.0  # to send a complete body, from the end of its head
    max_pipelined: int = 64  # requests parsed and not yet answered on one connection
    max_unread_bytes: int = 4 << 20  # answers written and not yet read by a peer still sending
    refusal: Refusal = plain_refusal  # the body of a 400, 408, 413 or 431 this layer answers


def refusal_bytes(limits: HttpLimits, status: int, message: str) -> bytes:
    """The whole response refusing a request with ``status`` (the connection then closes)."""
    content_type, body = limits.refusal(status, message)
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode()),
            b"content-type: ",
            content_type,
            b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body),
            body,
        ]
    )


class _HeadGuard:
    """Mixin over a uvicorn HTTP protocol (see module docstring)."""

    limits: HttpLimits = HttpLimits()
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None
    _refused = False  # a refusal was written (or the connection cut): ignore what follows
    _in_body = False  # a head has arrived and its body has not ended
    _body_wire = 0  # bytes received in reads that began inside that body
    _body_cost = 0  # that body's bytes as the parser delivers them, with their chunk framing
    _chunked = False  # that body comes in chunks
    _body_timer: asyncio.TimerHandle | None = None
    _answered_early = False  # the request in its body was answered before the body ended

    def _await_head(self, within_s: float) -> None:
        self._armed = getattr(self, "_armed", 0) + 1  # times a next head was awaited
        self._head_bytes = 0
        self._awaiting_head = True
        self._cancel_head_timer()
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(
            within_s, self._head_timed_out
        )

    def _head_done(self) -> None:
        self._awaiting_head = False
        self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_pending(self) -> bool:
        return self._awaiting_head

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_pending() and not self.transport.is_closing():
            # an idle keep-alive connection ends this way too: routine, hence debug
            log.debug(
                "closed the connection from %s: no complete request head within %.0fs",
                self.client,
                self.limits.head_timeout_s,
            )
            self.transport.close()

    def _count_head(self, nbytes: int) -> bool:
        """Count bytes of a head still arriving; refuse (431) and close past the limit."""
        if not self._head_pending() or self.transport.is_closing():
            return True
        self._head_bytes += nbytes
        if self._head_bytes <= self.limits.max_head_bytes:
            return True
        self._refuse(431, f"request head over {self.limits.max_head_bytes} bytes")
        return False

    # -- bodies -------------------------------------------------------------------------
    def _body_begun(self) -> None:
        self._in_body, self._answered_early = True, False
        self._body_wire = self._body_cost = 0
        self._cancel_body_timer()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _body_done(self) -> None:
        self._in_body = False
        self._cancel_body_timer()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._in_body:
            self._refuse(408, f"request body not complete within {self.limits.body_timeout_s:g}s")

    def _count_body(self, nbytes: int) -> bool:
        """Count bytes received of a body; refuse (413) and close past the limit."""
        self._body_wire += nbytes
        if max(self._body_wire, self._body_cost) <= self.limits.max_body_bytes:
            return True
        self._refuse(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes")
        return False

    def _body_arrived(self, nbytes: int) -> bool:
        """Count ``nbytes`` of body the parser delivers, with the framing of the chunk they
        came in (a read's bytes are counted too, once the body has begun: the larger count
        decides); refuse (413) and close past the limit."""
        if not self._in_body:
            return True
        framing = len(b"%x" % nbytes) + 4 if self._chunked else 0  # "<size>\r\n" … "\r\n"
        self._body_cost += nbytes + framing
        return self._count_body(0)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless a response has begun) and close the connection."""
        self._head_done()
        self._body_done()
        if self._refused or self.transport.is_closing():
            self._refused = True
            return
        self._refused = True
        log.warning("refused %s: %d %s", self.client, status, message)
        cycle = getattr(self, "cycle", None)
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if not answering and not self._answered_early:  # else the peer just sees the close
            self.transport.write(refusal_bytes(self.limits, status, message))
        self.transport.close()

    def _unread_past_limit(self) -> bool:
        """Drop the connection of a peer sending more while our answers to it go unread
        (a refusal could not reach it, and would answer the wrong request of its pipeline)."""
        unread = self.transport.get_write_buffer_size()
        if unread <= self.limits.max_unread_bytes or self._refused:
            return False
        self._drop(f"{unread} bytes of answers unread while it sends more")
        return True

    def _drop(self, why: str) -> None:
        self._head_done()
        self._body_done()
        self._refused = True
        log.warning("dropped the connection from %s: %s", self.client, why)
        self.transport.abort()

    # -- protocol hooks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head(self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        self._answered_early = self._in_body
        if not self.transport.is_closing():  # before a pipelined next head completes in super()
            limits = self.limits  # an idle kept-alive connection may wait out its keep-alive
            self._await_head(max(limits.head_timeout_s, limits.keep_alive_s))
        super().on_response_complete()  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses, in this server's refusal form."""
        self._refuse(400, msg)


def _guarded_h11() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _GuardedH11(_HeadGuard, H11Protocol):  # type: ignore[misc, valid-type]
        def _head_pending(self) -> bool:
            return self._awaiting_head and self.conn.their_state is h11.IDLE

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            in_body = self._in_body
            super().data_received(data)
            if self._refused or self._unread_past_limit():
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._head_done()
                if in_body:
                    self._count_body(len(data))
                else:  # the head ended in this read
                    self._body_begun()
                    self._count_body(len(data))
            elif state is not h11.IDLE:
                self._head_done()
                self._body_done()
            else:
                self._body_done()
                self._count_head(len(data))

    return _GuardedH11


def _guarded_httptools() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class _GuardedHttpTools(_HeadGuard, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        _unanswered = 0  # heads parsed whose response has not ended (pipelining queues them)
        _heads = 0  # heads completed on this connection (the direct lane counts its own)
        _head_size = 0  # bytes of the head being parsed (request line and header lines)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            before = (self._heads, self._armed)
            in_body = self._in_body
            super().data_received(data)
            if self._refused or self._unread_past_limit():
                return
            # Bytes in which a head completed, or a request was answered (the direct lane of
            # ``fastlane`` answers while parsing, and the next head is awaited at once), belong
            # to that request, not to the next head: the parser's callbacks count those heads.
            if (self._heads, self._armed) != before:
                return
            if in_body and self._in_body:  # the same body, still arriving
                self._count_body(len(data))
            else:
                self._count_head(len(data))

        def on_message_begin(self) -> None:
            self._head_size, self._chunked = 0, False
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_grew(len(url) + 16)  # with the method and the version
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_grew(len(name) + len(value) + 4)  # with ": " and the line's end
            if name.lower() == b"transfer-encoding":
                self._chunked = True
            super().on_header(name, value)

        def _head_grew(self, nbytes: int) -> None:
            self._head_size += nbytes
            limit = self.limits.max_head_bytes
            if self._head_size > limit:
                self._refuse(431, f"request head over {limit} bytes")

        # Once refused, the parser still reads the rest of the read at hand (at most 256 KiB);
        # nothing of it reaches the app: no request, and no body that would look complete.
        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._head_complete()
            if self._refused:  # dropped: too many requests queued unanswered
                return
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.scope is self.scope:
                zerocopy.attach(self.scope, self.cycle)  # before the app's task first runs

        def _head_complete(self) -> None:
            """A request head is complete: its body's bytes and time are counted from now."""
            self._heads += 1
            self._unanswered += 1
            self._head_done()
            if self._unanswered > self.limits.max_pipelined:
                self._drop(f"over {self.limits.max_pipelined} pipelined requests unanswered")
                return
            self._body_begun()

        def on_body(self, body: bytes) -> None:
            if self._body_arrived(len(body)) and not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._body_done()
            if not self._refused:
                super().on_message_complete()

        def _head_pending(self) -> bool:
            return self._awaiting_head and self._unanswered == 0

        def on_response_complete(self) -> None:
            self._unanswered = max(0, self._unanswered - 1)
            super().on_response_complete()

    return _GuardedHttpTools


def recognised(version: str) -> bool:
    """Whether uvicorn ``version`` lies in :data:`TESTED_UVICORN`."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    lowest, newest = TESTED_UVICORN
    return len(major_minor) == 2 and lowest <= major_minor <= newest


def guarded_http(limits: HttpLimits, parser: str = "auto", lane: Lane | None = None) -> type:
    """A uvicorn HTTP protocol class enforcing ``limits``; ``parser`` is "h11", "httptools" or
    "auto" (httptools when installed, else h11, as uvicorn chooses); ``lane``: requests the
    httptools protocol answers directly (``swarmrl.protocol.fastlane``; ignored over h11)."""
    if parser not in ("auto", "h11", "httptools"):
        raise ValueError(f"parser must be auto, h11 or httptools, got {parser!r}")
    httptools = _guarded_httptools() if parser != "h11" else None
    if parser == "httptools" and httptools is None:
        raise ValueError("httptools is not installed")
    base = httptools or _guarded_h11()
    if lane is not None and httptools is not None:
        base = with_lane(httptools, lane)
    return type(f"Guarded{base.__name__}", (base,), {"limits": limits})


def uvicorn_options(
    limits: HttpLimits, parser: str = "auto", lane: Lane | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` that apply ``limits`` (``parser`` and ``lane``:
    see :func:`guarded_http`). On a uvicorn version outside :data:`TESTED_UVICORN`: plain
    uvicorn (``parser`` by name, no direct lane), with one log line saying so."""
    public = {
        "timeout_keep_alive": limits.keep_alive_s,
        # h11's own cap (a 400) sits above ours, which counts whole reads of up to 256 KiB
        "h11_max_incomplete_event_size": limits.max_head_bytes + (512 << 10),
    }
    if not recognised(uvicorn.__version__):
        lowest, newest = (".".join(map(str, v)) for v in TESTED_UVICORN)
        log.warning(
            "uvicorn %s is not a version the HTTP limits were tested on (%s to %s): serving "
            "with plain uvicorn, without the head and body limits or the direct lane",
            uvicorn.__version__,
            lowest,
            newest,
        )
        return {"http": parser, **public}
    return {"http": guarded_http(limits, parser, lane), **public}
