"""``swarmrl dashboard RUN_DIR``: the orchestrator's read-only web dashboard over a finished run.

    swarmrl dashboard runs/arith-20260101-120000 [--host 127.0.0.1] [--port 8700] [--db URL]

Reads the run's pool database (``orchestrator/pool.db``, or ``--db`` for a run that used
PostgreSQL), its step rows, report, role status files and weight stores, and serves the same
pages the live orchestrator serves at ``/ui`` (``swarmrl.roles.orchestrator.dashboard``). The
ledger is verified against the run's orchestrator key (``keys/orchestrator.json``). Node log
tails need the token in ``orchestrator/ui-admin-token``. Serves until interrupted.

Knows how to find a run's pieces; the pages are the dashboard package's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import MissingPathError
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.pool.server import make_context
from swarmrl.pool.state.db import sqlite_url
from swarmrl.roles.orchestrator.dashboard.app import TOKEN_FILE, admin_token, build_dashboard
from swarmrl.roles.orchestrator.dashboard.data import RunData
from swarmrl.serving import ThreadServer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl dashboard", description="serve the read-only web dashboard of a run"
    )
    parser.add_argument("run_dir", help="run directory written by swarmrl run")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700, help="0 = any free port")
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    parser.add_argument("--db", default="", help="pool database URL (default: the run's SQLite)")
    return parser


def run_app(run_dir: Path, db_url: str = "") -> FastAPI:
    """An app serving the dashboard of ``run_dir`` at ``/ui/`` (``/`` redirects there)."""
    home = run_dir / "orchestrator"
    if not db_url:
        if not (home / "pool.db").is_file():
            raise MissingPathError(f"{run_dir} has no orchestrator/pool.db (pass --db URL)")
        db_url = sqlite_url(home / "pool.db")
    key_file = run_dir / "keys" / "orchestrator.json"
    key = load_keypair(key_file) if key_file.is_file() else None
    ctx = make_context(key or KeyPair.generate(), home, PoolConfig(db_url=db_url))
    data = RunData(ctx, run_dir, key.public_key_hex if key else None)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/")
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/", 307)

    app.mount("/ui", build_dashboard(data, admin_token(home)))
    return app


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise MissingPathError(f"no such run directory: {run_dir}")
    server = ThreadServer(run_app(run_dir, args.db), args.host, args.port, name="dashboard")
    server.start()
    print(f"dashboard of {run_dir} at {server.url}/ui/", flush=True)
    print(f"admin token (node logs): {run_dir / 'orchestrator' / TOKEN_FILE}", flush=True)
    server.run_until_stopped(args.port_file)
    return 0
