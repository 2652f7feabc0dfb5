"""A front process of the orchestrator (``swarmrl orchestrator --fronts N``).

It serves the public port (``SO_REUSEPORT``: the kernel spreads the nodes' connections over the
fronts) with uvicorn and the same HTTP limits as the orchestrator, reads each request whole
(a body over the pool's cap is refused here, as the orchestrator would), checks the signature
of a ``POST`` without a query string (ed25519 and the time window, never the nonce: that
needs the pool's state), and sends the request with that finding to the orchestrator over its
Unix socket (``swarmrl.pool.web.bridge``), then writes back the answer. A request whose signature
did not pass is sent on all the same, marked unchecked: the orchestrator checks it again and
answers and records the refusal as it always does. The front keeps no state of its own; while
the orchestrator cannot be reached it answers 503 and connects again for the next request.

Run by the orchestrator, not by hand::

    python -m swarmrl.pool.web.front --bridge SOCKET --port P [--port-file F] …

Knows nothing about pool rules.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
from typing import Any

from swarmrl.errors import InfraError, OversizedRequest, PeerError
from swarmrl.identity.requests import HEADER_SIGNATURE, MemoryNonceStore, RequestVerifier
from swarmrl.pool.web.answers import error_response, pool_limits, unavailable
from swarmrl.pool.web.bridge import frame, read_frame
from swarmrl.pool.web.hotroutes import headers_of
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.serving import FullCollections, ThreadServer

log = logging.getLogger(__name__)

_GONE = unavailable(InfraError("the orchestrator behind this front cannot be reached"))
_UNAVAILABLE = (_GONE.status_code, _GONE.raw_headers, bytes(_GONE.body))  # the app's own 503
_SIGNED = HEADER_SIGNATURE.lower().encode()


class Link:
    """The front's one connection to the orchestrator: frames out, answers matched by id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[tuple[int, list[Any], bytes]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Lock | None = None

    async def ask(self, head: dict[str, Any], body: bytes) -> tuple[int, list[Any], bytes]:
        """The orchestrator's answer (status, headers, body); 503 when it cannot be reached."""
        try:
            writer = await self._connected()
        except OSError:
            return _UNAVAILABLE
        request_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        writer.write(frame({**head, "i": request_id}, body))
        try:
            return await answer
        finally:
            self._waiting.pop(request_id, None)

    async def _connected(self) -> asyncio.StreamWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                asyncio.get_running_loop().create_task(self._answers(reader, self._writer))
            return self._writer

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, body = await read_frame(reader)
                waiting = self._waiting.get(head["i"])
                if waiting is not None and not waiting.done():
                    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["h"]]
                    waiting.set_result((head["s"], headers, body))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("the orchestrator closed the bridge")
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None
            for waiting in list(self._waiting.values()):  # asked on this connection: lost
                if not waiting.done():
                    waiting.set_result(_UNAVAILABLE)


class FrontApp:
    """The ASGI app of a front (module docstring)."""

    def __init__(self, link: Link, verifier: RequestVerifier, max_body_bytes: int) -> None:
        self.link, self.verifier, self.max_body_bytes = link, verifier, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = await self._body(receive)
        if body is None:
            too_large = OversizedRequest(
                f"request body exceeds the limit of {self.max_body_bytes} bytes"
            )
            response = error_response(too_large)
            await _respond(send, response.status_code, response.raw_headers, bytes(response.body))
            return
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        headers = scope["headers"]
        head = {
            "m": scope["method"],
            "p": raw_path.decode("latin-1"),
            "q": query.decode("latin-1"),
            "h": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers],
            "c": list(scope["client"]) if scope.get("client") else None,
            "v": self._checked(scope["method"], raw_path, query, headers, body),
        }
        await _respond(send, *await self.link.ask(head, body))

    async def _body(self, receive: Any) -> bytes | None:
        """The whole body, or None once it passes the cap (the rest is not read)."""
        buffered, more = bytearray(), True  # one buffer: tiny messages cost their bytes only
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return b""
            chunk = message.get("body", b"")
            if len(buffered) + len(chunk) > self.max_body_bytes:
                return None
            buffered += chunk
            more = message.get("more_body", False)
        return bytes(buffered)

    def _checked(
        self, method: str, raw_path: bytes, query: bytes, headers: list[Any], body: bytes
    ) -> bool:
        """Whether the request's signature and time are good (the nonce left to the pool)."""
        if method != "POST" or query or not any(k == _SIGNED for k, _ in headers):
            return False
        try:
            self.verifier.verify(
                method, raw_path.decode("latin-1"), body, headers_of(headers), claim=False
            )
        except PeerError:
            return False
        return True


async def _respond(send: Any, status: int, headers: list[Any], body: bytes) -> None:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    kept.append((b"content-length", b"%d" % len(body)))
    await send({"type": "http.response.start", "status": status, "headers": kept})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bridge", required=True, help="the orchestrator's Unix socket")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--window-s", type=float, required=True)
    parser.add_argument("--future-s", type=float, required=True)
    parser.add_argument("--keep-alive-s", type=float, default=30.0)
    parser.add_argument("--full-gc-every-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    verifier = RequestVerifier(
        MemoryNonceStore(),  # never asked: the front claims no nonce
        window_s=args.window_s,
        max_future_s=args.future_s,
        max_body_bytes=args.max_body_bytes,
    )
    app = FrontApp(Link(args.bridge), verifier, args.max_body_bytes)
    server = ThreadServer(
        app,
        args.host,
        args.port,
        name="front",
        nodelay=True,
        reuse_port=True,
        backlog=4096,
        **uvicorn_options(
            pool_limits(HttpLimits(keep_alive_s=args.keep_alive_s), args.max_body_bytes)
        ),
    )
    # thousands of kept-alive connections: the orchestrator's reason to collect fully on a
    # schedule (swarmrl.serving.FullCollections) holds here too
    full_gc = FullCollections(args.full_gc_every_s).start() if args.full_gc_every_s > 0 else None
    server.start()
    try:
        server.run_until_stopped(args.port_file)
    finally:
        if full_gc is not None:
            full_gc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
