"""The orchestrator's side of its front processes: requests that arrive over a Unix socket.

With ``swarmrl orchestrator --fronts N`` the public port belongs to N front processes
(``swarmrl.pool.web.front``): they hold the nodes' connections, parse HTTP and check request
signatures, the CPU-heavy work that needs no pool state, on the cores the orchestrator's own
event loop does not use. Each front sends every complete request here over one Unix-socket
connection and writes back the answer it gets. Nothing else changes: the same app answers
every request on the same single event loop (one database writer, arrival order kept per
front), with the same checks.

A frame is ``struct ">II"`` (head length, body length), a JSON head, then the body bytes.
Request head: ``i`` (the front's id for it), ``m`` (method), ``p`` (raw path), ``q`` (query
string), ``h`` (headers as ``[name, value]``, latin-1), ``c`` (the client's ``[host, port]``)
and ``v``: true when the front found the request's signature good. Answer head: ``i``,
``s`` (status), ``h`` (headers, without ``content-length``).

A heartbeat, lease or submission whose signature a front checked is answered by the app's
bridge lane (``swarmrl.pool.web.hotroutes.HotLane`` with the signature check left out: time
window, nonce and everything after it are checked here as always); every other request
(another route, or a hot one whose signature did not pass, which the app then refuses with its
usual answer and record) goes through the whole ASGI app in-process. The socket lives in a
directory only this user can enter, mode 0600: whatever connects is one of our fronts.

Knows nothing about pool rules.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
from typing import Any

from swarmrl.protocol.fastlane import SERVER_ERROR, Answer, Lane, decoded_path

log = logging.getLogger(__name__)

PREFIX = struct.Struct(">II")  # head length, body length
MAX_HEAD_BYTES = 1 << 20


def frame(head: dict[str, Any], body: bytes) -> bytes:
    """One frame: the prefix, ``head`` as JSON, ``body``."""
    raw = json.dumps(head, separators=(",", ":")).encode()
    return PREFIX.pack(len(raw), len(body)) + raw + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame's head and body; ``asyncio.IncompleteReadError`` at the end."""
    head_len, body_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    if head_len > MAX_HEAD_BYTES:
        raise ValueError(f"bridge frame head of {head_len} bytes")
    data = await reader.readexactly(head_len + body_len)
    return json.loads(data[:head_len]), data[head_len:]


def _latin1(pairs: list[list[str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs]


class Bridge:
    """Serves ``app`` (and ``lane``, for signature-checked hot requests) on a Unix socket."""

    def __init__(self, app: Any, lane: Lane, path: str) -> None:
        self.app, self.lane, self.path = app, lane, path
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._links: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Listen (on the running loop: the app's)."""
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop listening and close every front's connection (their readers end at EOF)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._links):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links.add(writer)
        try:
            while True:
                head, body = await read_frame(reader)
                self._handle(head, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front went away; its requests in the app finish and are dropped
        except Exception:  # a malformed frame from a front is a fault of ours: close it
            log.exception("bridge connection closed")
        finally:
            self._links.discard(writer)
            writer.close()

    def _handle(self, head: dict[str, Any], body: bytes, writer: asyncio.StreamWriter) -> None:
        if head["v"] and head["m"] == "POST" and not head["q"]:
            raw_path = head["p"].encode("latin-1")
            if self.lane.wants(raw_path):
                try:
                    answer = self.lane.answer(raw_path, _latin1(head["h"]), body)
                except Exception:  # a fault of ours: this request's 500, as the direct lane's
                    log.exception("answering %r failed", head["p"])
                    answer = SERVER_ERROR
                if answer is not None:
                    _write(writer, head["i"], answer)
                    return
        task = asyncio.get_running_loop().create_task(self._through_app(head, body, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _through_app(
        self, head: dict[str, Any], body: bytes, writer: asyncio.StreamWriter
    ) -> None:
        raw_path = head["p"].encode("latin-1")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": head["m"],
            "scheme": "http",
            "path": decoded_path(raw_path),  # as uvicorn gives it to the app directly
            "raw_path": raw_path,
            "query_string": head["q"].encode("latin-1"),
            "root_path": "",
            "headers": _latin1(head["h"]),
            "client": tuple(head["c"]) if head.get("c") else None,
            "server": None,
        }
        delivered = False
        status, headers, chunks = 500, [], []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays; the front says nothing more
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("%s %s failed", head["m"], head["p"])
            status, headers, chunks = 500, SERVER_ERROR.headers, [SERVER_ERROR.body]
        kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        _write(writer, head["i"], Answer(status, kept, b"".join(chunks)))


def _write(writer: asyncio.StreamWriter, request_id: int, answer: Answer) -> None:
    if writer.is_closing():
        return
    names = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in answer.headers]
    writer.write(frame({"i": request_id, "s": answer.status, "h": names}, answer.body))
