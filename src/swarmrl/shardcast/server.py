"""The shardcast HTTP service (origin and relay alike) and a helper to run it in a thread.

Routes::

    GET /health                         {"status": "ok", "role": …, "latest": N,
                                         "config": the [shardcast] settings applied}
    GET /metrics                        Prometheus text format (``shardcast.metrics``)
    GET /versions                       VersionList
    GET /versions/wait?after=N&timeout=S   long-poll: answers as soon as a version > N is
                                        known, or after S seconds with the current list;
                                        ``&manifest=1``: with the newest version's signed
                                        manifest inline (``manifest``) when it is newer than N,
                                        so a far client saves the manifest's round trip
    GET /clients                        the version each client last reported
    GET /v/{version}/manifest           the signed manifest (JSON); 410 when pruned
    GET /v/{version}/shard/{index}      shard bytes; single-range ``Range`` supported
    GET /v/{version}/delta/{index}      delta blob bytes; ``Range`` supported

Clients report the version they hold with the ``X-Shardcast-Held-Version`` header (or the
``held`` query parameter) and name themselves with ``X-Shardcast-Client``. A shard of a
version still arriving is served as soon as it is verified; a request for one not yet here
waits up to ``shard_wait_s`` and then gets ``503`` with ``Retry-After``.

Shard and delta bodies go out with ``sendfile`` (``protocol.zerocopy``): only verified bytes
are in the catalog's files, so the kernel copies them from the page cache to the socket
(``shardcast.zero_copy = false``, or a server without the extension: streamed in chunks).

Knows nothing about signatures (what is in the catalog was verified before it got there).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.protocol import zerocopy
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.serving import ThreadServer, Tls
from swarmrl.shardcast import store
from swarmrl.shardcast.catalog import Catalog, ServedVersion
from swarmrl.shardcast.metrics import registry_for, render
from swarmrl.shardcast.recheck import recheck_store

SEND_CHUNK = 1 << 20


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end_exclusive)`` of a single ``bytes=`` range, ``None`` for the whole object.

    Raises ``ValueError`` for a malformed or unsatisfiable range (answered with 416).
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise ValueError(f"unsupported range {header!r}")
    first, _, last = spec.strip().partition("-")
    if first == "":
        length = int(last)
        if length <= 0:
            raise ValueError("empty suffix range")
        return max(0, size - length), size
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if start >= size or end <= start:
        raise ValueError(f"range {header!r} outside 0..{size}")
    return start, end


def _read_cached(fd: int, size: int, offset: int) -> bytes | None:
    """Read without blocking when the bytes are in the page cache (``RWF_NOWAIT``), else None.

    Hot shards are served straight from the event loop, which saves a thread hand-off per
    chunk (costly on a busy machine); anything that would wait for the disk goes to a thread.
    """
    if _NOWAIT is None:
        return None
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, _NOWAIT)
    except (BlockingIOError, OSError):
        return None
    if n == 0:
        return None  # end of file or nothing cached: let the thread path decide
    return bytes(buf) if n == size else bytes(buf[:n])


_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


class _FileSliceResponse(Response):
    """Sends ``length`` bytes of an already open file from ``offset`` (closes the fd):
    with ``sendfile`` where the server offers zero-copy sends, else streamed in chunks."""

    def __init__(
        self,
        fd: int,
        offset: int,
        length: int,
        status: int,
        headers: dict[str, str],
        catalog: Catalog,
        zero_copy: bool = True,
    ) -> None:
        """``zero_copy``: use the server's ``sendfile`` where it offers one."""
        super().__init__(status_code=status, headers=headers, media_type="application/octet-stream")
        self.fd, self.offset, self.length, self.catalog = fd, offset, length, catalog
        self.zero_copy = zero_copy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            zero_copy = (
                scope.get("extensions", {}).get(zerocopy.EXTENSION) if self.zero_copy else None
            )
            if scope.get("method") == "HEAD":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif zero_copy is not None:
                sent = await zero_copy.sendfile(self.fd, self.offset, self.length)
                self.catalog.count("bytes_served_total", sent)
                if sent == self.length:  # else the connection is closed, the body short
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await self._stream(send)
        finally:
            os.close(self.fd)

    async def _stream(self, send: Send) -> None:
        """The body through ASGI messages, chunk by chunk (servers without zero-copy)."""
        sent = 0
        while sent < self.length:
            want = min(SEND_CHUNK, self.length - sent)
            data = _read_cached(self.fd, want, self.offset + sent)
            if data is None:  # not in the page cache: read from disk off the event loop
                data = await anyio.to_thread.run_sync(os.pread, self.fd, want, self.offset + sent)
            if not data:
                break  # file shorter than the manifest says: the connection ends short
            sent += len(data)
            await send(
                {"type": "http.response.body", "body": data, "more_body": sent < self.length}
            )
        self.catalog.count("bytes_served_total", sent)


CLIENT_ID = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
MAX_VERSION = 2**63 - 1


def _parse_held(raw: str) -> int | None:
    """The version a client says it holds; None when that is not a version number."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19):
        return None
    value = int(raw)
    return value if value <= MAX_VERSION else None


def _client_report(request: Request, catalog: Catalog) -> Response | None:
    """Record the version the client says it holds; a 400 answer when what it says is malformed."""
    held_raw = request.headers.get("x-shardcast-held-version") or request.query_params.get("held")
    client = request.headers.get("x-shardcast-client")
    if client is None and request.client is not None:
        client = request.client.host
    held = None
    if held_raw is not None:
        held = _parse_held(held_raw)
        if held is None:
            catalog.count("client_reports_refused_total")
            return JSONResponse({"error": "the held version must be a non-negative integer"}, 400)
    if client is None:
        return None
    if CLIENT_ID.fullmatch(client) is None:
        catalog.count("client_reports_refused_total")
        return JSONResponse(
            {"error": "X-Shardcast-Client must be 1-64 characters of A-Z a-z 0-9 . _ : @ -"}, 400
        )
    catalog.report_client(client, held)
    return None


def _listing(catalog: Catalog, inline: ServedVersion | None = None) -> Response:
    """The catalog's version list as JSON; with ``inline``, that version's signed manifest
    spliced in (``manifest``) as the bytes it was stored as: every client parked on a long-poll
    is answered at once when a version arrives, so the manifest is not decoded and encoded again
    per answer."""
    body = catalog.version_list().model_dump_json(exclude={"manifest"}).encode()
    if inline is not None:
        body = body[:-1] + b',"manifest":' + inline.manifest_json + b"}"
    return Response(body, media_type="application/json")


def build_app(
    catalog: Catalog,
    config: ShardcastConfig | None = None,
    role: str = "origin",
    watch_disk: bool = False,
) -> Starlette:
    """The ASGI app over ``catalog``; ``watch_disk`` picks up versions another process publishes."""
    cfg = config or ShardcastConfig()
    catalog.max_clients = cfg.max_clients

    async def health(request: Request) -> Response:
        body = {"status": "ok", "role": role, "latest": catalog.latest()}
        return JSONResponse({**body, "config": cfg.model_dump(mode="json")})

    registry = registry_for(catalog)

    async def metrics(request: Request) -> Response:
        body, content_type = render(registry)
        return Response(body, media_type=content_type)

    async def versions(request: Request) -> Response:
        refused = _client_report(request, catalog)
        if refused is not None:
            return refused
        catalog.count("listings_served_total")
        return _listing(catalog)

    async def versions_wait(request: Request) -> Response:
        refused = _client_report(request, catalog)
        if refused is not None:
            return refused
        try:
            after = int(request.query_params.get("after", "-1"))
            hold = min(
                float(request.query_params.get("timeout", cfg.long_poll_timeout_s)),
                cfg.long_poll_timeout_s,
            )
        except ValueError:
            return JSONResponse({"error": "after and timeout must be numbers"}, status_code=400)
        deadline = time.monotonic() + max(0.0, hold)
        while True:
            latest = catalog.latest()
            left = deadline - time.monotonic()
            newer = latest is not None and latest > after
            if newer or left <= 0 or catalog.closing:
                asked = newer and request.query_params.get("manifest") == "1"
                entry = catalog.get(latest) if asked and latest is not None else None
                if entry is not None:
                    catalog.count("manifests_inline_total")
                return _listing(catalog, entry)
            await catalog.wait_change(left)

    async def clients(request: Request) -> Response:
        latest = catalog.latest()
        body = {
            cid: {
                "held": c.held,
                "behind": latest is not None and (c.held is None or c.held < latest),
                "last_seen": c.last_seen,
            }
            for cid, c in list(catalog.clients.items())
        }
        return JSONResponse({"latest": latest, "clients": body})

    def _entry(request: Request) -> ServedVersion | None:
        return catalog.get(int(request.path_params["version"]))

    async def manifest(request: Request) -> Response:
        entry = _entry(request)
        if entry is None:
            oldest = catalog.oldest()
            if oldest is not None and int(request.path_params["version"]) < oldest:
                # older than anything kept: pruned, and it will not come back
                return JSONResponse({"error": "version pruned", "oldest": oldest}, status_code=410)
            return JSONResponse({"error": "unknown version"}, status_code=404)
        catalog.count("manifests_served_total")
        return Response(entry.manifest_json, media_type="application/json")

    async def _serve_slice(request: Request, kind: str) -> Response:
        version, index = int(request.path_params["version"]), int(request.path_params["index"])
        deadline = time.monotonic() + cfg.shard_wait_s
        while True:
            entry = catalog.get(version)
            if entry is None:
                catalog.count(f"{kind}_not_found_total")
                return JSONResponse({"error": f"unknown version {version}"}, status_code=404)
            flags = entry.shard_ready if kind == "shard" else entry.delta_ready
            if not 0 <= index < len(flags):
                return JSONResponse({"error": f"no {kind} {index} in v{version}"}, status_code=404)
            if flags[index]:
                break
            left = deadline - time.monotonic()
            if left <= 0 or catalog.closing:
                catalog.count(f"{kind}_not_ready_total")
                return JSONResponse(
                    {"error": f"{kind} {index} of v{version} still arriving"},
                    status_code=503,
                    headers={"Retry-After": "1"},
                )
            await catalog.wait_change(left)
        if kind == "shard":
            owner = next(f for f in entry.manifest.files if f.shards[-1].index >= index)
            shard = next(s for s in owner.shards if s.index == index)
            rel, base, size = owner.path, shard.offset, shard.size
        else:
            rel, base, size = None, 0, entry.manifest.deltas[index].size
        try:
            span = parse_range(request.headers.get("range"), size)
        except ValueError as exc:
            return JSONResponse(
                {"error": str(exc)}, status_code=416, headers={"Content-Range": f"bytes */{size}"}
            )
        start, end = span if span is not None else (0, size)
        fd = None
        for _ in range(2):  # the directory may be renamed (promoted) between lookup and open
            entry = catalog.get(version) or entry
            path = (
                entry.directory / rel
                if rel is not None
                else store.delta_path(entry.directory, index)
            )
            try:
                fd = os.open(path, os.O_RDONLY)
                break
            except FileNotFoundError:
                await asyncio.sleep(0.01)
        if fd is None:
            return JSONResponse({"error": f"{kind} {index} of v{version} is gone"}, status_code=404)
        headers = {"Content-Length": str(end - start), "Accept-Ranges": "bytes"}
        status = 200
        if span is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        catalog.count(f"{kind}_requests_total")
        return _FileSliceResponse(
            fd, base + start, end - start, status, headers, catalog, cfg.zero_copy
        )

    async def shard(request: Request) -> Response:
        return await _serve_slice(request, "shard")

    async def delta(request: Request) -> Response:
        return await _serve_slice(request, "delta")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        catalog.attach_loop(asyncio.get_running_loop())
        task = None
        if watch_disk:

            async def watch() -> None:
                while True:  # a local stat() loop; remote peers are told through long-polls
                    await anyio.to_thread.run_sync(catalog.refresh)
                    await asyncio.sleep(0.2)

            task = asyncio.create_task(watch())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/versions", versions),
        Route("/versions/wait", versions_wait),
        Route("/clients", clients),
        Route("/v/{version:int}/manifest", manifest),
        Route("/v/{version:int}/shard/{index:int}", shard),
        Route("/v/{version:int}/delta/{index:int}", delta),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.catalog = catalog
    # no route reads a request body: one is bounded as tightly as a head, in size and in time
    app.state.limits = HttpLimits(
        max_head_bytes=cfg.max_header_bytes,
        head_timeout_s=cfg.header_timeout_s,
        keep_alive_s=cfg.keep_alive_s,
        max_body_bytes=cfg.max_header_bytes,
        body_timeout_s=cfg.header_timeout_s,
    )
    return app


class RunningServer(ThreadServer):
    """The shardcast app served from a background thread; stopping it first answers the
    long-polls and shard waits its catalog holds."""

    def __init__(
        self, app: Starlette, host: str = "127.0.0.1", port: int = 0, tls: Tls | None = None
    ) -> None:
        self.catalog: Catalog | None = getattr(app.state, "catalog", None)
        limits = getattr(app.state, "limits", None) or HttpLimits()
        super().__init__(
            app,
            host,
            port,
            name="shardcast",
            tls=tls,
            timeout_graceful_shutdown=1,
            **uvicorn_options(limits),
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.catalog is not None:
            self.catalog.close()  # long-polls and shard waits answer now
        super().stop(timeout_s)


def serve_in_thread(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout_s: float = 15.0,
    tls: Tls | None = None,
) -> RunningServer:
    """Start ``app`` on ``host:port`` (0 = ephemeral) and wait until it accepts connections
    (``tls``: over HTTPS)."""
    running = RunningServer(app, host, port, tls)
    running.start(timeout_s)
    return running


def serve_until_signal(
    app: Starlette,
    host: str,
    port: int,
    on_stop: Callable[[], None] | None = None,
    tls: Tls | None = None,
) -> int:
    """Serve ``app`` until SIGINT/SIGTERM (or the server thread dies); the CLI verbs' loop."""
    running = serve_in_thread(app, host, port, tls=tls)
    print(f"serving on {running.url}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0) and running.alive():
        pass
    if on_stop is not None:
        on_stop()
    running.stop()
    return 0


def serve_origin(
    store_dir: str | Path,
    config: ShardcastConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    role: str = "origin",
) -> RunningServer:
    """Serve the ready versions of ``store_dir`` from a background thread (the trainer's origin).

    Versions a ``Publisher`` adds to the store are picked up within ~0.2 s and pushed to
    long-polling relays and clients at once.
    """
    cfg = config or ShardcastConfig()
    if cfg.recheck_on_start:  # digests only: the publisher's key is not known here
        recheck_store(Path(store_dir))
    catalog = Catalog(store_dir, cfg.keep_versions)
    catalog.refresh()
    return serve_in_thread(build_app(catalog, cfg, role=role, watch_disk=True), host, port)
