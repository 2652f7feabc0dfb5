"""Limits every swarmrl HTTP server puts on a connection before a request reaches the app.

uvicorn bounds neither the size of a request head (request line plus headers) nor the time a
peer may take to send it, and a connection that never sends anything is never dropped: one
96 MiB header or a few hundred silent sockets tie up a server. ``guarded_http(limits)`` returns
a uvicorn HTTP protocol class (for ``uvicorn.Config(http=...)``) that

* answers ``431 Request Header Fields Too Large`` and closes the connection as soon as more
  than ``max_head_bytes`` arrive without a complete head;
* closes a connection whose head is not complete ``head_timeout_s`` seconds after it opened
  (a silent socket, a slow-loris header), or ``max(head_timeout_s, keep_alive_s)`` after its
  previous response ended;

and leaves requests whose head has arrived alone (a long-poll may wait as long as it likes).
It wraps whichever parser uvicorn would pick (httptools when installed, else h11); over
httptools each request's scope also offers zero-copy file sends (``protocol.zerocopy``).

Knows nothing about routes, signatures or the apps it serves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from swarmrl.protocol import zerocopy
from swarmrl.protocol.fastlane import Lane, with_lane

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """What a peer may cost a server before its request head is complete."""

    max_head_bytes: int = 64 * 1024  # request line + headers, bytes
    head_timeout_s: float = 10.0  # to send a complete head, from connect or the last response
    keep_alive_s: float = 5.0  # uvicorn's idle keep-alive after a response (clients stay below)


_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


class _HeadGuard:
    """Mixin over a uvicorn HTTP protocol (see module docstring)."""

    limits: HttpLimits = HttpLimits()
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None

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
            log.info(
                "dropping %s: no complete request head within %.0fs",
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
        message = f"request head over {self.limits.max_head_bytes} bytes".encode()
        log.warning("refused %s: %s", self.client, message.decode())
        self.transport.write(_REFUSAL % (len(message), message))
        self.transport.close()
        self._head_done()
        return False

    # -- protocol hooks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head(self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # before a pipelined next head completes in super()
            limits = self.limits  # an idle kept-alive connection may wait out its keep-alive
            self._await_head(max(limits.head_timeout_s, limits.keep_alive_s))
        super().on_response_complete()  # type: ignore[misc]


class _GuardedH11(_HeadGuard, H11Protocol):
    def _head_pending(self) -> bool:
        import h11

        return self._awaiting_head and self.conn.their_state is h11.IDLE

    def data_received(self, data: bytes) -> None:
        import h11

        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_done()
        else:
            self._count_head(len(data))


def _guarded_httptools() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class _GuardedHttpTools(_HeadGuard, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        _unanswered = 0  # heads parsed whose response has not ended (pipelining queues them)
        _heads = 0  # heads completed on this connection (the direct lane counts its own)

        def data_received(self, data: bytes) -> None:
            before = (self._heads, self._armed)
            super().data_received(data)
            # Bytes in which a head completed, or a request was answered (the direct lane of
            # ``fastlane`` answers while parsing, and the next head is awaited at once), belong
            # to that request, not to the next head. Bytes of a next head sharing a read with
            # the end of a request go uncounted: at most one read beyond the limit.
            if (self._heads, self._armed) == before:
                self._count_head(len(data))

        def on_headers_complete(self) -> None:
            self._heads += 1
            self._unanswered += 1
            self._head_done()
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.scope is self.scope:
                zerocopy.attach(self.scope, self.cycle)  # before the app's task first runs

        def _head_pending(self) -> bool:
            return self._awaiting_head and self._unanswered == 0

        def on_response_complete(self) -> None:
            self._unanswered = max(0, self._unanswered - 1)
            super().on_response_complete()

    return _GuardedHttpTools


def guarded_http(limits: HttpLimits, parser: str = "auto", lane: Lane | None = None) -> type:
    """A uvicorn HTTP protocol class enforcing ``limits``; ``parser`` is "h11", "httptools" or
    "auto" (httptools when installed, else h11, as uvicorn chooses); ``lane``: requests the
    httptools protocol answers directly (``swarmrl.protocol.fastlane``; ignored over h11)."""
    if parser not in ("auto", "h11", "httptools"):
        raise ValueError(f"parser must be auto, h11 or httptools, got {parser!r}")
    httptools = _guarded_httptools() if parser != "h11" else None
    if parser == "httptools" and httptools is None:
        raise ValueError("httptools is not installed")
    base = httptools or _GuardedH11
    if lane is not None and httptools is not None:
        base = with_lane(httptools, lane)
    return type(f"Guarded{base.__name__}", (base,), {"limits": limits})


def uvicorn_options(
    limits: HttpLimits, parser: str = "auto", lane: Lane | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` that apply ``limits`` (``parser`` and ``lane``:
    see :func:`guarded_http`)."""
    return {
        "http": guarded_http(limits, parser, lane),
        "timeout_keep_alive": limits.keep_alive_s,
        # h11's own cap (a 400) sits above ours, which counts whole reads of up to 256 KiB
        "h11_max_incomplete_event_size": limits.max_head_bytes + (512 << 10),
    }
