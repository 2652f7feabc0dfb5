"""``swarmrl dashboard RUN_DIR``: the orchestrator's read-only web dashboard over a finished run.

    swarmrl dashboard runs/arith-20260101-120000 [--host 127.0.0.1] [--port 8700] [--db URL]

Serves the pages the live orchestrator serves at ``/ui`` (``swarmrl.roles.orchestrator.dashboard``)
over what the run directory holds:

- a swarm run (``swarmrl run CONFIG``): its pool database (``orchestrator/pool.db``, or ``--db``
  for a run whose pool lived in PostgreSQL), step rows, report, role status files and weight
  stores. The database is audited and its ledger verified against the orchestrator's public key,
  taken from the key file the run wrote (``keys/orchestrator.key``) or, without it, from the
  key ``report.json`` records (``ledger.orchestrator_key``). With neither, the tool says so in
  one line and shows the ledger unchecked: a key made up here could only fail to verify.
- a colocated run (``swarmrl run CONFIG --colocated``): no pool, so the curves and the report.

Node, version and log pages need the token in ``orchestrator/ui-admin-token``. Serves until
interrupted. Knows how to find a run's pieces; the pages are the dashboard package's.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from swarmrl.errors import LedgerMismatch, MissingPathError
from swarmrl.identity import load_keypair
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.pool.trust.audit import audit
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.roles.orchestrator.dashboard.app import TOKEN_FILE, admin_token, build_dashboard
from swarmrl.roles.orchestrator.dashboard.data import RunData
from swarmrl.serving import ThreadServer

KEY_FILE = "keys/orchestrator.key"  # what swarmrl run writes (swarmrl.launch.plan.SwarmPlan.key)


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


@dataclass
class RunPieces:
    """Where a run directory keeps what the dashboard shows."""

    db_url: str  # "" when the run had no pool
    orchestrator_key: str | None  # hex public key; None when the run directory holds none
    key_source: str  # where the key came from, or why there is none
    colocated: bool


# The pages take no bodies (GET and HEAD): a peer may send a head of at most 16 KiB within 10 s
# and a body of at most 64 KiB within 10 s, whichever path answers, or the socket is closed.
LIMITS = HttpLimits(
    max_head_bytes=16 << 10, head_timeout_s=10.0, max_body_bytes=64 << 10, body_timeout_s=10.0
)


def _report(run_dir: Path) -> dict:
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def find_pieces(run_dir: Path, db_url: str = "") -> RunPieces:
    """The run's pool database, orchestrator key and mode; a swarm run without its database is
    a :class:`MissingPathError`."""
    report = _report(run_dir)
    colocated = report.get("mode") == "colocated" or not (run_dir / "pool.json").is_file()
    db_file = run_dir / "orchestrator" / "pool.db"
    if not db_url and db_file.is_file():
        db_url = sqlite_url(db_file)
    if not db_url and not colocated:
        raise MissingPathError(
            f"{run_dir} has no orchestrator/pool.db (pass --db URL where its pool lived)"
        )
    key_file = run_dir / KEY_FILE
    recorded = (report.get("ledger") or {}).get("orchestrator_key")
    if key_file.is_file():
        key, source = load_keypair(key_file).public_key_hex, str(key_file)
    elif isinstance(recorded, str) and recorded:
        key, source = recorded, f"{run_dir / 'report.json'} (ledger.orchestrator_key)"
    else:
        key = None
        source = f"{run_dir} has neither {KEY_FILE} nor a key recorded in report.json"
    return RunPieces(db_url, key, source, colocated and not db_url)


def run_app(run_dir: Path, db_url: str = "") -> FastAPI:
    """An app serving the dashboard of ``run_dir`` at ``/ui/`` (``/`` redirects there)."""
    pieces = find_pieces(run_dir, db_url)
    engine: sa.Engine | None = None
    if pieces.db_url:
        engine = make_engine(pieces.db_url)
        if pieces.orchestrator_key is not None:  # a database that disagrees with its ledger
            try:
                audit(engine, pieces.orchestrator_key)
            except LedgerMismatch:
                engine.dispose()
                raise
    data = RunData(
        engine,
        run_dir,
        pieces.orchestrator_key,
        no_pool="this run trained colocated: it had no pool, nodes or ledger",
        no_key=pieces.key_source,
    )
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.api_route("/", methods=["GET", "HEAD"])
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/", 307)

    # a colocated run has no orchestrator (and no admin pages worth a token file in its folder)
    token = secrets.token_urlsafe(24) if pieces.colocated else admin_token(run_dir / "orchestrator")
    ui = build_dashboard(data, token)
    app.mount("/ui", ui)
    app.state.pieces, app.state.pages = pieces, ui.state.pages
    return app


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    run_dir = Path(args.run_dir).expanduser()
    if not run_dir.is_dir():
        raise MissingPathError(f"no such run directory: {run_dir}")
    app = run_app(run_dir, args.db)
    pieces: RunPieces = app.state.pieces
    if pieces.db_url and pieces.orchestrator_key is None:
        print(
            f"swarmrl dashboard: the ledger is shown unchecked: {pieces.key_source}",
            file=sys.stderr,
            flush=True,
        )
    server = ThreadServer(app, args.host, args.port, name="dashboard", **uvicorn_options(LIMITS))
    server.start()
    if pieces.colocated:
        print(f"dashboard of {run_dir} (colocated: curves and report) at {server.url}/ui/")
    else:
        print(f"dashboard of {run_dir} at {server.url}/ui/")
        print(f"admin token (nodes, versions, logs): {run_dir / 'orchestrator' / TOKEN_FILE}")
    sys.stdout.flush()
    try:
        server.run_until_stopped(args.port_file)
    finally:
        app.state.pages.close()
    return 0
