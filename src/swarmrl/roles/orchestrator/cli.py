"""``swarmrl orchestrator``: run the pool service (pools, nodes, leases, submissions, ledger).

    swarmrl orchestrator [CONFIG] --key orch.json [--db URL] [--store DIR|URL]
                         [--run-dir DIR] [--host 127.0.0.1] [--port 8600] [--pool spec.json …]
                         [--workers N | --fronts N] [--set pool.key=value …]

Applies the ``[pool]`` section of ``CONFIG`` (default: the embedded config) plus ``--set``
overrides; ``--db`` and ``--store``, when given, replace ``pool.db_url`` and
``pool.store_url``. A ``--pool`` spec that disagrees with a given ``CONFIG`` (sampling, group
size, task count, …) is refused at start (``swarmrl.pool.spec_check``). ``--workers N`` serves
the port from N processes (PostgreSQL only; :mod:`swarmrl.roles.orchestrator.workers`);
``--fronts N`` has N front processes hold the connections, parse HTTP and check signatures, and
bring every request to this one (:mod:`swarmrl.roles.orchestrator.fronts`, any database). Its
``/health`` answers with the settings it applies. Process wiring only; the service is
:mod:`swarmrl.pool`. Imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swarmrl.config.args import add_config_args, config_from_args
from swarmrl.config.pool import PoolConfig
from swarmrl.errors import UserError
from swarmrl.identity.keys import load_keypair
from swarmrl.logs import plain
from swarmrl.pool.cli import read_spec
from swarmrl.rolekit.toolkit import StatusReporter, add_tls_args, log_config, setup_logging
from swarmrl.roles.orchestrator.fronts import FrontGroup
from swarmrl.roles.orchestrator.workers import WorkerGroup, require_postgres
from swarmrl.serving import Tls

if TYPE_CHECKING:
    from swarmrl.ledger.export import LedgerTally
    from swarmrl.pool.trust.service import Context
    from swarmrl.protocol.pool import PoolSpec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl orchestrator", description="run the pool service"
    )
    add_config_args(parser)
    parser.add_argument("--key", required=True, help="orchestrator key file (signs the ledger)")
    parser.add_argument(
        "--db", default="", help="SQLAlchemy URL (default: pool.db_url, else SQLite in --run-dir)"
    )
    parser.add_argument(
        "--store",
        default="",
        help="rollout dir or fsspec URL (default: pool.store_url, else the run dir)",
    )
    parser.add_argument("--run-dir", default="runs/orchestrator", help="default db/store home")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8600, help="0 = any free port")
    add_tls_args(parser)
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port (more than 1 needs PostgreSQL)",
    )
    parser.add_argument(
        "--fronts",
        type=int,
        default=0,
        help="front processes that hold the connections, parse HTTP and check signatures "
        "for this one (0: none)",
    )
    # set on the further processes --workers starts: bind the port the first one holds
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pool", action="append", default=[], help="pool spec JSON to host")
    parser.add_argument("--name", default="orchestrator", help="name shown in logs")
    parser.add_argument(
        "--ui-run-dir",
        default=None,
        help="run directory whose curves, role status and weight stores the /ui dashboard shows",
    )
    parser.add_argument("--no-ui", action="store_true", help="do not serve the /ui dashboard")
    parser.add_argument(
        "--status-dir", default=None, help="write <name>.json status reports into this directory"
    )
    return parser


def pool_config(args: argparse.Namespace) -> PoolConfig:
    """The ``[pool]`` section this process applies: CONFIG, ``--set``, then ``--db``/``--store``;
    more than one ``--workers`` on a database other than PostgreSQL is a :class:`UserError`."""
    config = config_from_args(args)
    flags = {"db_url": args.db, "store_url": args.store}
    pool = config.pool.model_copy(update={k: v for k, v in flags.items() if v})
    require_postgres(pool.db_url, args.workers)  # before any log line: the refusal is one line
    if args.fronts and args.workers > 1:
        raise UserError("--fronts and --workers do not go together: choose one")
    if args.fronts < 0:
        raise UserError(f"--fronts must be 0 or more, not {args.fronts}")
    log_config(setup_logging(args.name), config)
    return pool


def pool_specs(args: argparse.Namespace) -> list[tuple[str, PoolSpec]]:
    """Each ``--pool`` spec; with ``CONFIG`` given, one that disagrees with it is refused in one
    line naming the keys (``swarmrl.pool.spec_check``)."""
    specs = [(path, read_spec(path)) for path in args.pool]
    if args.config is not None and specs:
        from swarmrl.pool.spec_check import check_spec

        config = config_from_args(args)
        for path, spec in specs:
            note = check_spec(spec, config, path)
            if note is not None:
                print(f"swarmrl orchestrator: warning: {note}", file=sys.stderr)
    return specs


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    specs = pool_specs(args)  # arguments are checked before the first log line
    tls = Tls.from_flags(args.tls_cert, args.tls_key)
    if tls is not None and args.fronts:
        raise UserError("--tls-cert does not go with --fronts (fronts serve plain HTTP)")
    keypair = load_keypair(args.key)
    config = pool_config(args)
    from swarmrl.ledger.export import LedgerTally
    from swarmrl.pool.rejections import Conflict
    from swarmrl.pool.server import ORCHESTRATOR_LIMITS, make_context, serve_forever
    from swarmrl.pool.trust import service

    ctx = make_context(keypair, args.run_dir, config)
    for path, spec in specs:
        try:
            service.create_pool(ctx, spec)
        except Conflict:  # already hosted (a restart): its state comes back from the database
            if service.get_pool(ctx, spec.pool_id).spec != spec:
                print(
                    f"swarmrl orchestrator: warning: pool {spec.pool_id!r} already exists with "
                    f"a different spec than {path}; keeping the stored one",
                    file=sys.stderr,
                )
    mounts = {} if args.no_ui else {"/ui": dashboard_app(ctx, args)}
    pools = [spec.pool_id for _, spec in specs]
    tally = LedgerTally(ctx.engine)
    coverage = EngineCoverage(
        logging.getLogger(f"swarmrl.{args.name}"), config.cross_engine_after_s
    )
    reporter = StatusReporter(
        "orchestrator",
        args.name,
        args.status_dir,
        2.0,  # each refresh queries the database: every 2 s is live enough for a display
        refresh=lambda r: report_pools(r, ctx, pools, tally, coverage),
    )
    fronts = (
        FrontGroup(args.fronts, config, ORCHESTRATOR_LIMITS.keep_alive_s) if args.fronts else None
    )
    with reporter, WorkerGroup(argv, args.workers - 1, args.name) as siblings:
        reporter.set(state="serving")
        serve_forever(
            ctx,
            args.host,
            args.port,
            args.port_file,
            mounts,
            reuse_port=args.workers > 1 or args.reuse_port,
            siblings=siblings if args.workers > 1 else None,
            fronts=fronts,
            tls=tls,
        )
        reporter.set(state="stopped")
    return 0


class EngineCoverage:
    """Logs when an engine of a pool's live members has had no validator of its own for
    ``grace_s`` (``PoolMetrics.engines_without_validator``: its units are then judged by
    another engine's validators, against the loose cross-engine means), and when it has one
    again; once per change, not per refresh. Engine names come from nodes: any but a plain word
    is logged quoted (``swarmrl.logs.plain``), so one holding a line break cannot forge a log
    line."""

    def __init__(self, log: logging.Logger, grace_s: float) -> None:
        self.log = log
        self.grace_s = grace_s
        self.since: dict[tuple[str, str], float] = {}  # (pool, engine) → first seen uncovered
        self.told: set[tuple[str, str]] = set()

    def note(self, pool_id: str, uncovered: list[str], now: float) -> None:
        for key in [k for k in self.since if k[0] == pool_id and k[1] not in uncovered]:
            del self.since[key]
            if key in self.told:
                self.told.discard(key)
                self.log.info(
                    "pool %s: engine %s has a validator of its own again", key[0], plain(key[1])
                )
        for engine in uncovered:
            key = (pool_id, engine)
            first = self.since.setdefault(key, now)
            if key not in self.told and now - first >= self.grace_s:
                self.told.add(key)
                self.log.warning(
                    "pool %s: nodes on engine %s, but no validator on %s has claimed for %.0f s: "
                    "other engines' validators judge their units, against the looser "
                    "cross-engine means; start a validator with inference.backend = %r",
                    pool_id,
                    plain(engine),
                    plain(engine),
                    now - first,
                    engine,
                )


def report_pools(
    reporter: StatusReporter,
    ctx: Context,
    pool_ids: list[str],
    tally: LedgerTally,
    coverage: EngineCoverage | None = None,
) -> None:
    """The status numbers of the hosted pools, summed: version, nodes, the submissions waiting
    for a check (``pending``) and the submission counts in the words of
    ``swarmrl.ledger.counts`` (taken_in, checked, accepted, ...; trained from the statuses).
    ``coverage`` logs the engines left without a validator of their own."""
    from swarmrl.pool.trust import views

    total: dict[str, float] = {}
    version = 0
    for pool_id in pool_ids:
        m = views.metrics(ctx, pool_id)
        if coverage is not None:
            coverage.note(pool_id, m.engines_without_validator, time.monotonic())
        version = max(version, m.current_version)
        subs = m.submissions_by_status
        counts = tally.counts(pool_id)
        counts.trained = subs.get("trained", 0)
        for key, n in [("pending", subs.get("pending", 0)), *counts.as_dict().items()]:
            total[key] = total.get(key, 0.0) + (n or 0)
        total["nodes"] = total.get("nodes", 0.0) + sum(m.nodes_by_state.values())
        total["banned"] = total.get("banned", 0.0) + m.nodes_by_state.get("banned", 0)
    reporter.set(version=version, **total)


def dashboard_app(ctx: Context, args: argparse.Namespace) -> Any:
    """The read-only dashboard over this orchestrator's database (and run directory, if given)."""
    from pathlib import Path

    from swarmrl.roles.orchestrator.dashboard.app import admin_token, build_dashboard
    from swarmrl.roles.orchestrator.dashboard.data import RunData

    run_dir = Path(args.ui_run_dir) if args.ui_run_dir else None
    data = RunData(ctx, run_dir, ctx.key.public_key_hex)
    return build_dashboard(data, admin_token(Path(args.run_dir)))
