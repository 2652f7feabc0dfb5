"""Running the orchestrator: build its context from paths and serve it (``swarmrl.serving``).

:class:`OrchestratorServer` binds 127.0.0.1 (or a given host) on a port — 0 picks a free one —
and serves in a background thread until :meth:`stop`; the CLI uses :func:`serve_forever`.
Knows nothing about pool rules.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import LedgerMismatch
from swarmrl.identity.keys import KeyPair
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.pool.state.store import RolloutStore
from swarmrl.pool.trust.audit import audit
from swarmrl.pool.trust.service import Context
from swarmrl.pool.web.answers import pool_limits
from swarmrl.pool.web.app import build_app
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.serving import FullCollections, ThreadServer, Tls

# nodes beat every few seconds over kept-alive connections: keep them open for 30 s
ORCHESTRATOR_LIMITS = HttpLimits(keep_alive_s=30.0)


def make_context(key: KeyPair, run_dir: str | Path, config: PoolConfig | None = None) -> Context:
    """Context with the database and store named by ``config`` (defaults under ``run_dir``).

    The database is audited against its ledger first (``swarmrl.pool.trust.audit``): a cut or edited
    database is a :class:`~swarmrl.errors.LedgerMismatch`, and nothing is served from it.
    """
    config = config or PoolConfig()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(config.db_url or sqlite_url(run_dir / "pool.db"), config.fast_sql)
    try:
        audit(engine, key.public_key_hex)
    except LedgerMismatch:
        engine.dispose()
        raise
    store = RolloutStore(config.store_url or str(run_dir / "rollouts"))
    return Context(engine=engine, store=store, key=key, config=config)


class OrchestratorServer(ThreadServer):
    """The orchestrator served from a background thread; ``url`` is known once constructed."""

    def __init__(
        self,
        ctx: Context,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: HttpLimits = ORCHESTRATOR_LIMITS,
        mounts: Mapping[str, Any] | None = None,
        reuse_port: bool = False,
        bridge: str | None = None,
        tls: Tls | None = None,
    ) -> None:
        """``limits``: what a connection may cost before its request head is complete;
        ``mounts``: further ASGI apps served under path prefixes (the dashboard at ``/ui``);
        ``reuse_port``: other server processes of this database share the port (PostgreSQL
        only: see ``swarmrl.pool.trust.service`` for what keeps them apart); ``bridge``: also serve
        front processes on this Unix socket (``swarmrl.pool.web.bridge``); ``tls``: serve
        HTTPS."""
        self.ctx = ctx
        self.app = app = build_app(ctx, shared=reuse_port, bridge=bridge)
        for prefix, sub in (mounts or {}).items():
            app.mount(prefix, sub)
        # nodelay: without it small responses wait ~40 ms for a delayed ACK
        super().__init__(
            app,
            host,
            port,
            name="orchestrator",
            nodelay=True,
            reuse_port=reuse_port,
            tls=tls,
            backlog=4096,
            # heartbeats, leases and submissions straight from the parser (pool.hotroutes),
            # unless pool.direct_lane or pool.hot_routes is off (the lane is None then)
            **uvicorn_options(
                pool_limits(limits, ctx.config.max_body_bytes), lane=app.state.hot_lane
            ),
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            self.ctx.engine.dispose()


def serve_forever(
    ctx: Context,
    host: str,
    port: int,
    port_file: str | None = None,
    mounts: Mapping[str, Any] | None = None,
    *,
    reuse_port: bool = False,
    siblings: Siblings | None = None,
    fronts: Fronts | None = None,
    tls: Tls | None = None,
) -> None:
    """Serve until interrupted; writes the bound port to ``port_file`` once listening.

    ``siblings``: further server processes sharing the port (``reuse_port``), started once
    this one listens and before the port file is written (so whoever waits for the file finds
    all of them serving); serving stops when one of them ends. ``fronts``: front processes
    that serve ``host:port`` instead and bring every request here over a Unix socket
    (``swarmrl.pool.web.bridge``; this process then listens on a free loopback port of its own);
    started once this one listens, stopped with it, and serving stops when one of them ends.
    """
    bridge = fronts.bridge if fronts is not None else None
    own_host, own_port = ("127.0.0.1", 0) if fronts is not None else (host, port)
    server = OrchestratorServer(
        ctx, own_host, own_port, mounts=mounts, reuse_port=reuse_port, bridge=bridge, tls=tls
    )
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    every_s = ctx.config.full_gc_every_s
    full_gc = FullCollections(every_s).start() if every_s > 0 else None
    others: Siblings | Fronts | None = siblings if fronts is None else fronts
    try:
        public = server.port
        if siblings is not None:
            siblings.start(server.port)
        if fronts is not None:
            public = fronts.start(host, port)
        url = f"{'https' if tls else 'http'}://{host}:{public}"
        print(f"orchestrator listening on {url} (key {ctx.key.public_key_hex})", flush=True)
        if port_file:
            tmp = Path(port_file + ".tmp")
            tmp.write_text(f"{public}\n")
            tmp.replace(port_file)
        while server.alive() and (others is None or others.alive()):
            server.thread.join(0.5)
    finally:
        if fronts is not None:
            fronts.stop()
        server.stop()
        if full_gc is not None:
            full_gc.stop()


class Siblings(Protocol):
    """Other server processes of one orchestrator (``swarmrl orchestrator --workers N``)."""

    def start(self, port: int) -> None:
        """Start them on ``port``; return once they all listen (or raise)."""

    def alive(self) -> bool:
        """Whether all of them still run."""


class Fronts(Protocol):
    """Front processes of one orchestrator (``swarmrl orchestrator --fronts N``)."""

    bridge: str  # the Unix socket they bring requests to

    def start(self, host: str, port: int) -> int:
        """Start them on ``host:port`` (0: a free port); return the port once all listen."""

    def alive(self) -> bool:
        """Whether all of them still run."""

    def stop(self) -> None:
        """Stop them."""
