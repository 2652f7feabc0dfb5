"""Running the orchestrator: build its context from paths and serve it with uvicorn.

:class:`OrchestratorServer` binds 127.0.0.1 (or a given host) on a port — 0 picks a free one —
and serves in a background thread until :meth:`stop`; the CLI uses :func:`serve_forever`.
Knows nothing about pool rules.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import WaitTimeout
from swarmrl.identity.keys import KeyPair
from swarmrl.pool.app import build_app
from swarmrl.pool.db import make_engine, sqlite_url
from swarmrl.pool.service import Context
from swarmrl.pool.store import RolloutStore


def make_context(key: KeyPair, run_dir: str | Path, config: PoolConfig | None = None) -> Context:
    """Context with the database and store named by ``config`` (defaults under ``run_dir``)."""
    config = config or PoolConfig()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(config.db_url or sqlite_url(run_dir / "pool.db"))
    store = RolloutStore(config.store_url or str(run_dir / "rollouts"))
    return Context(engine=engine, store=store, key=key, config=config)


def _uvicorn(ctx: Context) -> uvicorn.Server:
    config = uvicorn.Config(
        build_app(ctx),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=30,
        backlog=4096,
    )
    return uvicorn.Server(config)


class OrchestratorServer:
    """The orchestrator served from a background thread; ``url`` is known once started."""

    def __init__(self, ctx: Context, host: str = "127.0.0.1", port: int = 0) -> None:
        self.ctx = ctx
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit this; without it small responses wait ~40 ms for a delayed ACK
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = _uvicorn(ctx)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self.sock]},
            daemon=True,
            name=f"orchestrator:{self.port}",
        )

    def start(self, timeout_s: float = 20.0) -> OrchestratorServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise WaitTimeout(f"orchestrator on {self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WaitTimeout(f"orchestrator on {self.url} did not stop within {timeout_s} s")
        self.sock.close()
        self.ctx.engine.dispose()

    def __enter__(self) -> OrchestratorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(ctx: Context, host: str, port: int, port_file: str | None = None) -> None:
    """Serve until interrupted; writes the bound port to ``port_file`` once listening."""
    server = OrchestratorServer(ctx, host, port)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: setattr(server._server, "should_exit", True))
    print(f"orchestrator listening on {server.url} (key {ctx.key.public_key_hex})", flush=True)
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(f"{server.port}\n")
        tmp.replace(port_file)
    try:
        while server._thread.is_alive():
            server._thread.join(0.5)
    finally:
        server.stop()
