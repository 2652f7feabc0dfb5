"""Zero-copy response bodies: ``os.sendfile`` from a file straight into a connection's socket.

ASGI has no way to hand a server a file descriptor, so every byte of a body passes through
Python: a read into a new buffer, a ``bytes`` copy, the socket send. For the gigabytes of
verified shards a relay serves that is most of its CPU. :func:`attach` puts a
:class:`ZeroCopy` under ``scope["extensions"][EXTENSION]`` of each request a uvicorn
``httptools`` connection parses; an app that finds it sends the response head as usual, then
``await zc.sendfile(fd, offset, count)``, then an empty final ``http.response.body``. The
kernel moves the bytes from the page cache to the socket; nothing is copied in user space.

The socket is written through a duplicate of its descriptor, registered with the event loop
for writability only while the kernel's send buffer is full; the transport's own buffer is
drained first, and the response head's ``Content-Length`` bookkeeping of uvicorn is told how
many bytes went out. A peer that stops reading for ``stall_s`` seconds is dropped.

Where the extension is absent (the h11 parser, another server) apps stream bodies the
ordinary way. Knows nothing about routes or what the files hold.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

EXTENSION = "swarmrl.zerocopy"
STALL_S = 30.0  # a peer that accepts no byte for this long is dropped


class ZeroCopy:
    """Sends file ranges into one request's connection (see module docstring)."""

    def __init__(self, cycle: Any, stall_s: float | None = None) -> None:
        self._cycle = cycle  # uvicorn's httptools RequestResponseCycle
        self.stall_s = STALL_S if stall_s is None else stall_s

    async def sendfile(self, fd: int, offset: int, count: int) -> int:
        """Send ``count`` bytes of ``fd`` from ``offset``; return how many went out.

        Fewer than ``count`` means the file ended early, the peer went away or stalled: the
        connection is closed then (the body is short of its ``Content-Length``) and the caller
        must not send the final body message.
        """
        cycle = self._cycle
        transport: asyncio.Transport = cycle.transport
        sock = transport.get_extra_info("socket")
        if sock is None or transport.is_closing() or cycle.disconnected:
            return 0
        loop = asyncio.get_running_loop()
        while transport.get_write_buffer_size() > 0:  # the head goes first
            if transport.is_closing():
                return 0
            await asyncio.sleep(0.001)
        out = os.dup(sock.fileno())
        sent = 0
        try:
            sent = await _send_all(loop, transport, out, fd, offset, count, self.stall_s)
        finally:
            os.close(out)
            cycle.expected_content_length -= sent
            if sent < count:
                transport.close()
        return sent


async def _send_all(
    loop: asyncio.AbstractEventLoop,
    transport: asyncio.Transport,
    out: int,
    fd: int,
    offset: int,
    count: int,
    stall_s: float,
) -> int:
    sent = 0
    while sent < count and not transport.is_closing():
        try:
            n = os.sendfile(out, fd, offset + sent, count - sent)
        except BlockingIOError:
            if not await _writable(loop, out, stall_s):
                break
            continue
        except OSError:  # the peer reset or closed the connection
            break
        if n == 0:  # the file is shorter than promised
            break
        sent += n
    return sent


async def _writable(loop: asyncio.AbstractEventLoop, out: int, timeout_s: float) -> bool:
    """Wait until ``out`` can take more bytes; False after ``timeout_s`` without."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(out, wake)
    try:
        await asyncio.wait_for(ready, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(out)


def attach(scope: dict[str, Any], cycle: Any) -> None:
    """Offer zero-copy sends to the app that will answer ``scope`` (on ``cycle``)."""
    # over TLS the socket carries ciphertext: bytes must go through the transport's encryption
    encrypted = cycle.transport.get_extra_info("ssl_object") is not None
    if hasattr(os, "sendfile") and scope.get("type") == "http" and not encrypted:
        scope.setdefault("extensions", {})[EXTENSION] = ZeroCopy(cycle)
