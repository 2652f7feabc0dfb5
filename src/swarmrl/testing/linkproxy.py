"""A user-space TCP proxy that makes a link slow and lossy: delay, jitter, resets, byte rate.

The kernels this project is tested on have no ``netem``, so latency and loss cannot be added
with ``tc``; this proxy sits in front of a server's port instead. Per direction (``up``: client
to server, ``down``: server to client) it holds every chunk for ``delay_s`` plus a uniform
jitter in ``[-jitter_s, +jitter_s]`` (never reordering bytes: a chunk is never delivered before
the one ahead of it), and optionally paces the bytes to ``rate_bytes_per_s``. With probability
``reset_probability`` an accepted connection is reset at once (RST, no byte forwarded), which is
what a client sees of a lost SYN-ACK after its retries or of a dropped NAT mapping.

Packet loss here is modelled, not made: a proxy sees a byte stream, never packets (real loss,
dropped in the kernel, is ``swarmrl.testing.hosts.Host.lose``, with nftables). With ``loss``
each ``SEGMENT_BYTES`` of a chunk is "lost" with that probability, and a chunk holding a lost
segment is held one retransmission longer (``max(MIN_RTO_S, 2 * delay_s)``), holding back every
byte behind it as TCP's in-order delivery does. What this leaves out: the sender's congestion
window halving after a loss (a real 1 % loss at 150 ms RTT cuts one TCP flow's rate to a few
Mbit/s), so this model is kinder to bulk transfers than a real lossy link.

Corruption is made: with ``corrupt`` each ``SEGMENT_BYTES`` of a chunk has one bit flipped
with that probability, in whatever it carries (an HTTP head, a body, a shard), which is what a
broken middlebox or a lying relay's link delivers past TCP's checksum.

Run it in-process (``with LinkProxy(...) as proxy:``, a thread with its own event loop) or as a
process inside a network namespace (``python -m swarmrl.testing.linkproxy --listen ...``).
Knows nothing about HTTP, swarmrl's roles or namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Impairment:
    """What one direction of a link does to the bytes crossing it."""

    delay_s: float = 0.0  # one-way delay added to every chunk, seconds
    jitter_s: float = 0.0  # half-width of the uniform jitter around delay_s, seconds
    rate_bytes_per_s: float | None = None  # pacing; None: as fast as the sockets go
    loss: float = 0.0  # probability that one SEGMENT_BYTES segment is lost (module docstring)
    corrupt: float = 0.0  # probability that one SEGMENT_BYTES segment has a bit flipped


SEGMENT_BYTES = 1448  # a TCP segment's payload on a 1500-byte Ethernet link
MIN_RTO_S = 0.2  # Linux's smallest retransmission timeout


class LinkProxy:
    """Forward ``listen`` to ``target`` through an impaired link; ``address`` is where to connect."""

    def __init__(
        self,
        target: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        up: Impairment = Impairment(),
        down: Impairment = Impairment(),
        reset_probability: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= reset_probability <= 1.0:
            raise ValueError(f"reset_probability must be in [0, 1], got {reset_probability}")
        self.target = target
        self.up = up
        self.down = down
        self.reset_probability = reset_probability
        self.connections = 0  # connections accepted
        self.resets = 0  # of which reset on purpose
        self.stalls = 0  # chunks held one retransmission longer for a modelled loss
        self.flips = 0  # bits flipped on purpose
        self._listen = listen
        self._rng = random.Random(seed)
        self._live: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] = listen

    # -- in-process use ---------------------------------------------------------------------

    def __enter__(self) -> LinkProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except OSError as exc:
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="linkproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10.0):
            raise TimeoutError("link proxy did not start listening within 10 s")
        if failure:
            raise failure[0]
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)

    # -- the proxy itself ----------------------------------------------------------------------

    async def start(self) -> None:
        host, port = self._listen
        self._server = await asyncio.start_server(self._handle, host, port)
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], int(sockname[1]))

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def serve_forever(self) -> None:
        await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # asyncio (3.11) holds a server connection's task and its reader only weakly once the
        # connection is made: without this reference an idle connection's task is collected
        # mid-flight ("Task was destroyed but it is pending").
        task = asyncio.current_task()
        if task is not None:
            self._live.add(task)
            task.add_done_callback(self._live.discard)
        self.connections += 1
        if self._rng.random() < self.reset_probability:
            self.resets += 1
            sock = client_w.get_extra_info("socket")
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client_w.transport.abort()
            return
        try:
            server_r, server_w = await asyncio.wait_for(
                asyncio.open_connection(*self.target), timeout=10.0
            )
        except (TimeoutError, OSError, asyncio.CancelledError):
            client_w.transport.abort()
            return
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w, self.up),
                self._pipe(server_r, client_w, self.down),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            pass  # the proxy is stopping: a connection's task ends quietly, not as an error
        for writer in (client_w, server_w):
            writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, how: Impairment
    ) -> None:
        """Copy reader to writer, each chunk held until its delivery time; EOF passed on."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            last_due = 0.0
            try:
                while chunk := await reader.read(65536):
                    jitter = self._rng.uniform(-how.jitter_s, how.jitter_s) if how.jitter_s else 0.0
                    # Bytes on one TCP stream never overtake each other, whatever the jitter.
                    last_due = max(last_due, time.monotonic() + max(0.0, how.delay_s + jitter))
                    if how.loss:
                        segments = -(-len(chunk) // SEGMENT_BYTES)
                        if self._rng.random() < 1.0 - (1.0 - how.loss) ** segments:
                            self.stalls += 1
                            last_due += max(MIN_RTO_S, 2 * how.delay_s)
                    if how.corrupt:
                        chunk = self._flip(chunk, how.corrupt)
                    await queue.put((last_due, chunk))
            except OSError:
                pass
            await queue.put(None)

        async def write() -> None:
            paced_until = time.monotonic()
            while (item := await queue.get()) is not None:
                due, chunk = item
                for start in range(0, len(chunk), 16384 if how.rate_bytes_per_s else len(chunk)):
                    piece = chunk[start : start + 16384] if how.rate_bytes_per_s else chunk
                    now = time.monotonic()
                    wait = max(due, paced_until) - now
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if how.rate_bytes_per_s:
                        paced_until = max(paced_until, now) + len(piece) / how.rate_bytes_per_s
                    writer.write(piece)
                    await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        reading = asyncio.ensure_future(read())
        try:
            await write()
        except OSError:
            reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await reading

    def _flip(self, chunk: bytes, probability: float) -> bytes:
        """``chunk`` with one bit flipped in each segment drawn with ``probability``."""
        out = bytearray(chunk)
        for start in range(0, len(out), SEGMENT_BYTES):
            if self._rng.random() < probability:
                at = self._rng.randrange(start, min(start + SEGMENT_BYTES, len(out)))
                out[at] ^= 1 << self._rng.randrange(8)
                self.flips += 1
        return bytes(out)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m swarmrl.testing.linkproxy")
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter, each way")
    parser.add_argument("--rate-bytes", type=float, default=None, help="bytes/s each way")
    parser.add_argument("--loss", type=float, default=0.0, help="per segment (modelled)")
    parser.add_argument("--corrupt", type=float, default=0.0, help="per segment: one bit flipped")
    parser.add_argument("--reset-probability", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    way = Impairment(
        args.delay_ms / 1000, args.jitter_ms / 1000, args.rate_bytes, args.loss, args.corrupt
    )
    proxy = LinkProxy(args.target, args.listen, way, way, args.reset_probability, args.seed)
    asyncio.run(proxy.serve_forever())


if __name__ == "__main__":
    main()
