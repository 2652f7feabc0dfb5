"""The orchestrator's database: tables and engine creation.

SQLite by default (one file, WAL journal) or PostgreSQL by URL, through SQLAlchemy Core. All
state that must survive a restart lives here: pools, nodes, invites used, leases, submissions,
credits, per-node evidence, request nonces and the ledger (``swarmrl.ledger.chain``). Rollout
bytes live in the rollout store, not here. Knows nothing about HTTP or the protocol's rules.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import sqlalchemy as sa

from swarmrl import fastsql
from swarmrl.errors import UserError
from swarmrl.ledger.chain import ledger_metadata

metadata = ledger_metadata  # one schema; the ledger table is defined by swarmrl.ledger

pools = sa.Table(
    "pools",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),  # PoolSpec JSON
    sa.Column("current_version", sa.Integer, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
)

nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("node_id", sa.String(32), primary_key=True),
    sa.Column("public_key", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("metadata", sa.Text, nullable=False),  # NodeMetadata JSON
    # NodeMetadata.engine as of the node's last join (validators' claims route by it)
    sa.Column("engine", sa.String(64), nullable=True),
    sa.Column("joined_at", sa.Float, nullable=False),
    sa.Column("last_beat_at", sa.Float, nullable=True),
    sa.Column("status", sa.String(16), nullable=True),
    sa.Column("model_version", sa.Integer, nullable=True),
    sa.Column("reported_tps", sa.Float, nullable=True),
    sa.Column("measured_tps", sa.Float, nullable=True),
    sa.Column("log_tail", sa.Text, nullable=False, default="[]"),
    sa.Column("lease_counter", sa.Integer, nullable=False, default=0),
    sa.Column("accepted", sa.Integer, nullable=False, default=0),
    sa.Column("soft", sa.Integer, nullable=False, default=0),
    sa.Column("hard", sa.Integer, nullable=False, default=0),
)

invites_used = sa.Table(
    "invites_used",
    metadata,
    sa.Column("invite_id", sa.String(32), primary_key=True),
    sa.Column("pool_id", sa.String(64), nullable=False),
    sa.Column("node_id", sa.String(32), nullable=False),
    sa.Column("used_at", sa.Float, nullable=False),
)

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("lease_id", sa.String(32), primary_key=True),
    sa.Column("pool_id", sa.String(64), nullable=False),
    sa.Column("node_id", sa.String(32), nullable=False),
    # active → submitted | expired; expired → reassigned (once; reassigned_to names the new lease)
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("work", sa.Text, nullable=False),  # WorkUnit JSON
    # tasks in the unit (len(work.task_indices)): admission sums it over active leases
    sa.Column("n_tasks", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("deadline", sa.Float, nullable=False),
    sa.Column("reassigned_to", sa.String(32), nullable=True),
    # a twin (swarmrl.pool.flow.twins): the unchecked submission whose unit this lease repeats,
    # and that submission's node (never leased its own twin); state twin (waiting for another
    # node) → reassigned, or → lapsed when nobody took it by its deadline
    sa.Column("twin_of", sa.String(32), nullable=True),
    sa.Column("twin_node", sa.String(32), nullable=True),
    # the node a waiting twin is offered to first, drawn at random among the healthy others
    # (NULL: anyone but twin_node); open to all after lease_target_s or once it is not healthy
    sa.Column("twin_taker", sa.String(32), nullable=True),
    sa.Index("ix_leases_node_state", "pool_id", "node_id", "state"),
    sa.Index("ix_leases_twin_of", "twin_of"),
    sa.Index("ix_leases_state_deadline", "state", "deadline"),
)

submissions = sa.Table(
    "submissions",
    metadata,
    sa.Column("submission_id", sa.String(32), primary_key=True),
    sa.Column("pool_id", sa.String(64), nullable=False),
    sa.Column("lease_id", sa.String(32), nullable=False, unique=True),
    sa.Column("node_id", sa.String(32), nullable=False),
    sa.Column("received_at", sa.Float, nullable=False),
    sa.Column("rollout_key", sa.String(256), nullable=False),
    sa.Column("n_samples", sa.Integer, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=False),
    sa.Column("min_version", sa.Integer, nullable=False),
    sa.Column("auth", sa.Text, nullable=False),  # node key, signature, body digest (JSON)
    # pending (to be checked) → accepted | rejected | disputed (a rejection awaiting its quorum)
    # | quarantined (unservable); unchecked (not selected) → accepted once checks of later
    # submissions of its node passed, or pending when drawn for a check then
    # (swarmrl.pool.flow.spotcheck), or once its twin's equal output arrived, or pending when
    # that output differs; a twin's own submission → matched (credited, never trained: its
    # samples are the other's) (swarmrl.pool.flow.twins), pending again when a ban rechecks it
    # and back to matched if its original trained already; accepted → leased (in a batch) → trained
    # (acknowledged) or back to accepted (lease expired); any untrained one → dropped
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("validated", sa.Boolean, nullable=False),
    sa.Column("claimed_by", sa.String(64), nullable=True),
    sa.Column("claim_expires_at", sa.Float, nullable=True),
    sa.Column("verdict", sa.Text, nullable=True),  # Verdict JSON without behaviour log-probs
    sa.Column("consumed_step", sa.Integer, nullable=True),
    # unchecked: checks of later submissions of its node passed since it arrived
    # (swarmrl.pool.flow.spotcheck releases it at the pool's release_after_checks)
    sa.Column("passes_after", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Index("ix_submissions_pool_status", "pool_id", "status"),
)

credits = sa.Table(
    "credits",
    metadata,
    sa.Column("submission_id", sa.String(32), primary_key=True),
    sa.Column("pool_id", sa.String(64), nullable=False),
    sa.Column("node_id", sa.String(32), nullable=False, index=True),
    sa.Column("tokens", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("unlock_at", sa.Float, nullable=False),
    sa.Column("dropped", sa.Boolean, nullable=False, default=False),
)

# per-pool assignment secrets, committed in the ledger when opened and revealed when closed
# (swarmrl.pool.trust.assignments)
assignment_secrets = sa.Table(
    "assignment_secrets",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("epoch", sa.Integer, primary_key=True),
    sa.Column("secret", sa.String(64), nullable=False),
    sa.Column("opened_at", sa.Float, nullable=False),
    sa.Column("revealed_at", sa.Float, nullable=True),
)

# submissions leased to a trainer in a batch and not yet acknowledged (their status is
# "leased"); an expired lease returns the submission to "accepted" (swarmrl.pool.flow.batches)
batch_leases = sa.Table(
    "batch_leases",
    metadata,
    sa.Column("submission_id", sa.String(32), primary_key=True),
    sa.Column("pool_id", sa.String(64), nullable=False),
    sa.Column("holder", sa.String(64), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
)

# per-node spot-check record: checks passed since the node's last failed one, which sets its
# check rate (swarmrl.pool.flow.spotcheck)
spot_rates = sa.Table(
    "spot_rates",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("node_id", sa.String(32), primary_key=True),
    sa.Column("clean", sa.Integer, nullable=False),
)

# per-node evidence: one CUSUM per measure over the node's accepted units' measurements, from
# every validator (swarmrl.pool.trust.evidence, swarmrl.ledger.evidence)
node_evidence = sa.Table(
    "node_evidence",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("node_id", sa.String(32), primary_key=True),
    sa.Column("measure", sa.String(16), primary_key=True),
    sa.Column("value", sa.Float, nullable=False),  # S
    sa.Column("units", sa.Integer, nullable=False),
    sa.Column("total", sa.Float, nullable=False),  # sum of the units' x
)

# the engine each validator last claimed with, and when (swarmrl.pool.flow.judging routes a unit
# to a validator of its node's engine while one is seen)
validator_engines = sa.Table(
    "validator_engines",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("validator", sa.String(64), primary_key=True),
    sa.Column("engine", sa.String(64), nullable=False),
    sa.Column("seen_at", sa.Float, nullable=False),
)

# validators' votes on a disputed submission (a rejection awaiting its quorum)
spot_votes = sa.Table(
    "spot_votes",
    metadata,
    sa.Column("submission_id", sa.String(32), primary_key=True),
    sa.Column("validator", sa.String(64), primary_key=True),
    sa.Column("accept", sa.Boolean, nullable=False),
)

# what the trainer said about its run: its length, its batch size, and when it finished
# (swarmrl.pool.flow.progress); a pool whose trainer said nothing has no row
run_progress = sa.Table(
    "run_progress",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("steps", sa.Integer, nullable=True),
    sa.Column("tasks_per_step", sa.Integer, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    # the highest step whose whole batch the trainer holds (TrainerProgress); None = not told
    sa.Column("batched_through", sa.Integer, nullable=True),
)

# the join rate limit's token bucket per pool (swarmrl.pool.trust.limits): in the database, so that
# several server processes share one bucket instead of each admitting the whole rate
join_buckets = sa.Table(
    "join_buckets",
    metadata,
    sa.Column("pool_id", sa.String(64), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("last_s", sa.Float, nullable=False),
)

# (key, nonce) pairs of signed requests, kept until their timestamp leaves the request window, so
# a request captured before a restart cannot be replayed after it (swarmrl.pool.state.nonces)
nonces = sa.Table(
    "nonces",
    metadata,
    sa.Column("public_key", sa.String(64), primary_key=True),
    sa.Column("nonce", sa.String(64), primary_key=True),
    sa.Column("expires_at", sa.Float, nullable=False, index=True),
)

# a row written when an orchestrator that kept heartbeat nonces in memory stopped cleanly (every
# nonce it claimed written to ``nonces``), taken by the next one to start
# (swarmrl.pool.state.nonces)
clean_stops = sa.Table(
    "clean_stops",
    metadata,
    sa.Column("stopped_at", sa.Float, primary_key=True),
)


# PostgreSQL's codes for a transaction it aborted to break a deadlock or a serialisation
# conflict: the transaction changed nothing and may simply run again
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})


def is_retryable(exc: sa.exc.DBAPIError) -> bool:
    """Whether ``exc`` is a transaction the database aborted only because it raced another
    (decided by its SQLSTATE code), so that running it again is the whole remedy."""
    return getattr(exc.orig, "sqlstate", None) in RETRYABLE_SQLSTATES


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


# each SQLite connection's page cache, KiB (SQLite's default is 2,000): the hot tables' pages
SQLITE_CACHE_KIB = 64 << 10


def make_engine(url: str, fast_sql: bool = True) -> sa.Engine:
    """Engine for ``url`` with the schema created; SQLite gets WAL and a busy timeout.
    ``fast_sql`` false: every statement through SQLAlchemy (``swarmrl.fastsql.PUBLIC_PATH``)."""
    try:
        if url.startswith("sqlite"):
            # the connection returned last is taken first: a thread running one transaction
            # after another keeps using one connection, whose page cache another connection's
            # writes would otherwise invalidate each time (at 5,000 nodes the orchestrator made
            # ~23 read calls a request with two connections taken in turn, ~4 with this)
            engine = sa.create_engine(url, connect_args={"timeout": 30}, pool_use_lifo=True)

            @sa.event.listens_for(engine, "connect")
            def _pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
                # checkpoints (which fsync) run in WalCheckpointer's thread, not in a request
                cur.execute("PRAGMA wal_autocheckpoint=0")
                cur.close()
        else:
            engine = sa.create_engine(url, pool_pre_ping=True)
        metadata.create_all(engine)
        _add_lease_task_counts(engine)
        _add_batched_through(engine)
        _add_passes_after(engine)
        _add_twins(engine)
        _add_twin_taker(engine)
        _add_node_engine(engine)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise UserError(f"bad database URL {url!r}: {exc}") from exc
    except sa.exc.OperationalError as exc:
        raise UserError(f"cannot open database {url!r}: {exc.orig}") from exc
    return engine if fast_sql else engine.execution_options(**fastsql.PUBLIC_PATH)


def _add_batched_through(engine: sa.Engine) -> None:
    """A database made before ``run_progress.batched_through`` existed gets the column, empty
    (nothing told: admission leases as it did)."""
    if "batched_through" in {c["name"] for c in sa.inspect(engine).get_columns("run_progress")}:
        return
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE run_progress ADD COLUMN batched_through INTEGER"))


def _add_passes_after(engine: sa.Engine) -> None:
    """A database made before ``submissions.passes_after`` existed gets the column at 0: its
    unchecked work waits for the checks a pool with k = 1 (all made before) releases it at."""
    if "passes_after" in {c["name"] for c in sa.inspect(engine).get_columns("submissions")}:
        return
    with engine.begin() as conn:
        conn.execute(
            sa.text("ALTER TABLE submissions ADD COLUMN passes_after INTEGER NOT NULL DEFAULT 0")
        )


def _add_twins(engine: sa.Engine) -> None:
    """A database made before twin leases existed gets their columns, empty (no lease is a
    twin)."""
    if "twin_of" in {c["name"] for c in sa.inspect(engine).get_columns("leases")}:
        return
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE leases ADD COLUMN twin_of VARCHAR(32)"))
        conn.execute(sa.text("ALTER TABLE leases ADD COLUMN twin_node VARCHAR(32)"))
        conn.execute(sa.text("CREATE INDEX ix_leases_twin_of ON leases (twin_of)"))


def _add_twin_taker(engine: sa.Engine) -> None:
    """A database made before twins were offered to a drawn node first gets the column, empty
    (its waiting twins are open to anyone, as they were)."""
    if "twin_taker" in {c["name"] for c in sa.inspect(engine).get_columns("leases")}:
        return
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE leases ADD COLUMN twin_taker VARCHAR(32)"))


def _add_node_engine(engine: sa.Engine) -> None:
    """A database made before ``nodes.engine`` existed gets the column, filled in from each
    node's metadata (the engine it declared when it last joined)."""
    if "engine" in {c["name"] for c in sa.inspect(engine).get_columns("nodes")}:
        return
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE nodes ADD COLUMN engine VARCHAR(64)"))
        rows = conn.execute(sa.select(nodes.c.pool_id, nodes.c.node_id, nodes.c.metadata)).all()
        for row in rows:
            declared = json.loads(row.metadata).get("engine")
            conn.execute(
                nodes.update()
                .where(nodes.c.pool_id == row.pool_id, nodes.c.node_id == row.node_id)
                .values(engine=declared if isinstance(declared, str) else None)
            )


def _add_lease_task_counts(engine: sa.Engine) -> None:
    """A database made before ``leases.n_tasks`` existed gets the column, filled in from each
    active lease's work unit (the only leases admission counts), so it serves on unchanged."""
    if "n_tasks" in {c["name"] for c in sa.inspect(engine).get_columns("leases")}:
        return
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE leases ADD COLUMN n_tasks INTEGER NOT NULL DEFAULT 0"))
        active = conn.execute(
            sa.select(leases.c.lease_id, leases.c.work).where(leases.c.state == "active")
        ).all()
        if active:
            conn.execute(
                leases.update()
                .where(leases.c.lease_id == sa.bindparam("lid"))
                .values(n_tasks=sa.bindparam("n")),
                [{"lid": lid, "n": len(json.loads(work)["task_indices"])} for lid, work in active],
            )


class WalCheckpointer:
    """Copies a SQLite write-ahead log into the database every ``period_s`` from its own thread.

    Requests then never pay for the checkpoint's fsync; a PASSIVE checkpoint never blocks the
    writer. Does nothing for other databases.
    """

    def __init__(self, engine: sa.Engine, period_s: float = 2.0) -> None:
        self.path = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-checkpoint", daemon=True)

    def start(self) -> None:
        if self.path:
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            while not self._stop.wait(self.period_s):
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()
