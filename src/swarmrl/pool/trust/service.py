"""Pool membership: pools, heartbeats, health sweeps (joins: ``swarmrl.pool.trust.joins``;
the admin views: ``swarmrl.pool.trust.views``).

Every public function runs one database transaction: it either commits the whole state change
together with its ledger entries, or raises a :class:`Rejected` and leaves nothing behind. The
functions are synchronous and run one at a time on each server process's event-loop thread
(``swarmrl.pool.web.app``). On PostgreSQL several server processes may share the database, so each
read-then-write is made safe by a lock or a constraint, said where it is taken: the ledger's
append lock (``swarmrl.ledger.chain.lock``), the node row in a lease and a rejoin, the node and
lease rows in a submission, the join bucket's row and the primary keys of nodes and used
invites in a join, and one sweeper at a time (an advisory lock). Work (leases, submissions, verdicts,
batches) lives in ``swarmrl.pool.flow.work``. Knows nothing about HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import PeerError
from swarmrl.fastsql import Fast
from swarmrl.identity.keys import KeyPair
from swarmrl.ledger.chain import Ledger
from swarmrl.ledger.reputation import reputation
from swarmrl.pool.rejections import (
    Conflict,
    Invalid,
    NodeBanned,
    NotFound,
    NotMember,
)
from swarmrl.pool.state import db
from swarmrl.pool.state.store import RolloutStore
from swarmrl.pool.trust import assignments, beats
from swarmrl.pool.trust.beats import LOG_TAIL_LINES, Beat, BeatBuffer
from swarmrl.pool.trust.health import RELEASES_LEASES, SILENCE_TRANSITIONS
from swarmrl.protocol.pool import (
    Heartbeat,
    HeartbeatReply,
    NodeMetadata,
    NodeView,
    PoolInfo,
    PoolSpec,
)


@dataclass
class Context:
    """What every pool operation needs: database, rollout store, ledger signer, limits, clock."""

    engine: sa.Engine
    store: RolloutStore
    key: KeyPair
    config: PoolConfig
    clock: Callable[[], float] = time.time
    started_at: float = field(default_factory=time.time)
    _specs: dict[str, PoolSpec] = field(default_factory=dict)
    # per pool: when a trainer's batch request last came back empty, and for which step
    # (swarmrl.pool.flow.admission)
    starved_at: dict[str, tuple[float, int]] = field(default_factory=dict)
    # per pool: the nodes waiting for a starving trainer's grant, and those waiting for an
    # ordinary one, each a swarmrl.pool.flow.admission.Askers (typed there: flow lies above trust)
    starving_asks: dict[str, Any] = field(default_factory=dict)
    lease_asks: dict[str, Any] = field(default_factory=dict)
    # heartbeats answered by this process and not yet written (swarmrl.pool.trust.beats)
    beats: BeatBuffer = field(default_factory=BeatBuffer)

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.key)

    def spec(self, conn: sa.Connection, pool_id: str) -> PoolSpec:
        """The spec of a pool (cached: specs never change), or :class:`NotFound`."""
        if pool_id not in self._specs:
            row = conn.execute(
                sa.select(db.pools.c.spec).where(db.pools.c.pool_id == pool_id)
            ).first()
            if row is None:
                raise NotFound(f"unknown pool {pool_id!r}")
            self._specs[pool_id] = PoolSpec.model_validate_json(row.spec)
        return self._specs[pool_id]

    def is_admin(self, conn: sa.Connection, pool_id: str, public_key_hex: str) -> bool:
        return public_key_hex in (self.key.public_key_hex, self.spec(conn, pool_id).owner_key)


_VERSION_QUERY = sa.select(db.pools.c.current_version).where(
    db.pools.c.pool_id == sa.bindparam("p")
)
_VERSION, _VERSION_LOCKED = Fast(_VERSION_QUERY), Fast(_VERSION_QUERY.with_for_update())
_NODE_QUERY = sa.select(db.nodes).where(
    db.nodes.c.pool_id == sa.bindparam("p"), db.nodes.c.node_id == sa.bindparam("n")
)
_NODE = Fast(_NODE_QUERY)
_IN_FLIGHT = Fast(
    sa.select(sa.func.count())
    .select_from(db.leases)
    .where(
        db.leases.c.pool_id == sa.bindparam("p"),
        db.leases.c.node_id == sa.bindparam("n"),
        db.leases.c.state == "active",
    )
)


def current_version(conn: sa.Connection, pool_id: str, *, lock: bool = False) -> int:
    """The pool's policy version; ``lock``: keep the pool's row locked until the transaction
    ends (as :func:`node_row`)."""
    query = _VERSION_LOCKED if lock else _VERSION
    return int(query.run(conn, {"p": pool_id}).scalar_one())


def leases_in_flight(conn: sa.Connection, pool_id: str, node_id: str) -> int:
    return int(_IN_FLIGHT.run(conn, {"p": pool_id, "n": node_id}).scalar_one())


_NODE_LOCKED = Fast(_NODE_QUERY.with_for_update())


def node_row(conn: sa.Connection, pool_id: str, node_id: str, *, lock: bool = False) -> Any:
    """The node's row, or :class:`NotFound` telling it to join. ``lock``: keep the row locked
    until the transaction ends (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's one writer
    needs nothing), so that what is read from it and written back cannot interleave with
    another process doing the same."""
    row = (_NODE_LOCKED if lock else _NODE).run(conn, {"p": pool_id, "n": node_id}).first()
    if row is None:
        raise NotFound(f"unknown node {node_id} in pool {pool_id!r}: join first")
    return row


def node_row_or_none(conn: sa.Connection, pool_id: str, node_id: str, *, lock: bool) -> Any:
    """The node's row or None; ``lock`` as in :func:`node_row`."""
    return (_NODE_LOCKED if lock else _NODE).run(conn, {"p": pool_id, "n": node_id}).first()


def require_member(row: Any, allowed: tuple[str, ...] = ("healthy", "unhealthy")) -> None:
    if row.state == "banned":
        raise NodeBanned(f"node {row.node_id} is banned from this pool")
    if row.state not in allowed:
        raise NotMember(f"node {row.node_id} is {row.state}; join again to take part")


def node_view(conn: sa.Connection, row: Any) -> NodeView:
    in_flight = leases_in_flight(conn, row.pool_id, row.node_id)
    return NodeView(
        node_id=row.node_id,
        public_key=row.public_key,
        state=row.state,
        metadata=NodeMetadata.model_validate_json(row.metadata),
        joined_at=row.joined_at,
        last_beat_at=row.last_beat_at,
        model_version=row.model_version,
        reported_tokens_per_s=row.reported_tps,
        measured_tokens_per_s=row.measured_tps,
        leases_in_flight=in_flight,
        reputation=reputation(row.accepted, row.soft, row.hard, row.state == "banned"),
    )


# --- pools -----------------------------------------------------------------------------------


def create_pool(ctx: Context, spec: PoolSpec) -> PoolInfo:
    if spec.min_tasks_per_lease > spec.max_tasks_per_lease:
        raise Invalid("min_tasks_per_lease exceeds max_tasks_per_lease")
    if spec.validated_fraction > 0 and not spec.validators:
        # otherwise submissions would wait forever for a validator that cannot exist
        raise Invalid("validated_fraction > 0 needs at least one validator key")
    if spec.quorum > max(1, len(spec.validators)):
        raise Invalid(f"quorum {spec.quorum} exceeds the pool's {len(spec.validators)} validators")
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        exists = conn.execute(
            sa.select(db.pools.c.pool_id).where(db.pools.c.pool_id == spec.pool_id)
        ).first()
        if exists is not None:
            raise Conflict(f"pool {spec.pool_id!r} already exists")
        conn.execute(
            db.pools.insert(),
            dict(
                pool_id=spec.pool_id, spec=spec.model_dump_json(), current_version=0, created_at=now
            ),
        )
        ctx.ledger.append(
            conn,
            "pool_created",
            {"spec": spec.model_dump(mode="json")},
            pool_id=spec.pool_id,
            ts=now,
        )
        assignments.open_epoch(ctx, conn, spec.pool_id, 0, now)
    return PoolInfo(spec=spec, current_version=0, created_at=now)


def get_pool(ctx: Context, pool_id: str) -> PoolInfo:
    with ctx.engine.connect() as conn:
        spec = ctx.spec(conn, pool_id)
        row = conn.execute(sa.select(db.pools).where(db.pools.c.pool_id == pool_id)).one()
        finished = conn.execute(
            sa.select(db.run_progress.c.finished_at).where(db.run_progress.c.pool_id == pool_id)
        ).scalar()
    return PoolInfo(
        spec=spec,
        current_version=row.current_version,
        created_at=row.created_at,
        run_finished=finished is not None,
    )


def list_pools(ctx: Context) -> list[PoolInfo]:
    with ctx.engine.connect() as conn:
        rows = conn.execute(sa.select(db.pools).order_by(db.pools.c.pool_id)).all()
    return [
        PoolInfo(
            spec=PoolSpec.model_validate_json(r.spec),
            current_version=r.current_version,
            created_at=r.created_at,
        )
        for r in rows
    ]


# --- joining ---------------------------------------------------------------------------------


# --- health ----------------------------------------------------------------------------------


# Heartbeats are the most frequent request: their read is built once, and a beat that leaves the
# node's state as it was is buffered and written in a batch (swarmrl.pool.trust.beats).
_BEAT_READ = Fast(
    sa.select(
        db.nodes.c.node_id,
        db.nodes.c.state,
        db.pools.c.current_version,
        db.run_progress.c.finished_at,
    )
    .join(db.pools, db.pools.c.pool_id == db.nodes.c.pool_id)
    .outerjoin(db.run_progress, db.run_progress.c.pool_id == db.nodes.c.pool_id)
    .where(db.nodes.c.pool_id == sa.bindparam("p"), db.nodes.c.node_id == sa.bindparam("n"))
)


def heartbeat(
    ctx: Context,
    pool_id: str,
    node_id: str,
    beat: Heartbeat,
    claim: Callable[[sa.Connection], None] | None = None,
) -> HeartbeatReply:
    """Record a node's beat: buffered if it leaves the node's state as it was, else written at
    once (with what the buffer held for the node), so state changes never wait for a flush.

    ``claim(conn)``: claims the request's nonce first, in the beat's transaction (raising
    :class:`~swarmrl.errors.ReplayedRequest` if it was used); the claim stands even when the
    beat is then refused, as a claim made before the operation would."""
    limit = ctx.config.max_log_line_chars
    state = "unhealthy" if beat.status == "error" else "healthy"
    now_beat = Beat(
        state,
        ctx.clock(),
        beat.status,
        beat.model_version,
        beat.tokens_per_s,
        [line[:limit] for line in beat.log_tail[-LOG_TAIL_LINES:]],
    )
    with ctx.engine.connect() as conn:
        if claim is not None:
            claim(conn)
        try:
            row = _beating_member(ctx, conn, pool_id, node_id)
        except PeerError:
            if claim is not None:
                conn.commit()
            raise
        if row.state == state and ctx.config.heartbeat_flush_s > 0:
            if claim is not None:
                conn.commit()
            ctx.beats.add(pool_id, node_id, now_beat)  # once committed: a retry adds it once
        else:
            earlier = ctx.beats.take(pool_id, node_id)
            merged = now_beat if earlier is None else earlier.then(now_beat)
            try:
                beats.write(conn, [((pool_id, node_id), merged)], buffered=False)
                conn.commit()
            except BaseException:
                if earlier is not None:  # not written: it waits for the next flush or beat
                    ctx.beats.add(pool_id, node_id, earlier)
                raise
    return HeartbeatReply(
        state=state,
        current_version=row.current_version,
        next_beat_s=ctx.config.heartbeat_interval_s,
        run_finished=row.finished_at is not None,
    )


def _beating_member(ctx: Context, conn: sa.Connection, pool_id: str, node_id: str) -> Any:
    """The node's state and its pool's version, or the rejection of its beat."""
    ctx.spec(conn, pool_id)
    row = _BEAT_READ.run(conn, {"p": pool_id, "n": node_id}).first()
    if row is None:
        node_row(conn, pool_id, node_id)  # raises the "join first" rejection
    require_member(row, ("healthy", "unhealthy", "dead"))
    return row


def flush_beats(ctx: Context) -> int:
    """Write the beats this process buffered (``swarmrl.pool.trust.beats``); the number written."""
    return ctx.beats.flush(ctx.engine)


def release_leases(conn: sa.Connection, pool_id: str, node_id: str) -> None:
    """Expire a node's active leases so their tasks are reassigned (no penalty)."""
    conn.execute(
        db.leases.update()
        .where(
            db.leases.c.pool_id == pool_id,
            db.leases.c.node_id == node_id,
            db.leases.c.state == "active",
        )
        .values(state="expired")
    )


# the key of the sweeper's PostgreSQL advisory lock ("swarmswp"): one sweep at a time
SWEEPER_LOCK_KEY = 0x737761726D737770
_TRY_SWEEPER = sa.text("SELECT pg_try_advisory_xact_lock(:k)").bindparams(k=SWEEPER_LOCK_KEY)
_OVERDUE = (
    sa.select(db.leases.c.lease_id, db.leases.c.pool_id, db.leases.c.node_id)
    .where(db.leases.c.state == "active", db.leases.c.deadline < sa.bindparam("now"))
    .order_by(db.leases.c.deadline)
)
# a node whose row another transaction holds (it is leasing or submitting now) is left to the
# next sweep: a sweeper that appended to the ledger never waits for a row (see chain.lock)
_NODE_UNLESS_BUSY = (
    sa.select(db.nodes.c.node_id)
    .where(db.nodes.c.pool_id == sa.bindparam("p"), db.nodes.c.node_id == sa.bindparam("n"))
    .with_for_update(skip_locked=True)
)
# twin leases (swarmrl.pool.flow.twins) nobody took by their deadline, and taken ones that
# expired unanswered, lapse: their originals go back to the usual release
_LAPSE_TWINS = (
    db.leases.update()
    .where(
        db.leases.c.twin_of.is_not(None),
        db.leases.c.state.in_(("twin", "expired")),
        db.leases.c.deadline < sa.bindparam("now"),
    )
    .values(state="lapsed")
)
# a twin nobody can take any more: no node of its pool but the unit's own is healthy
_LAPSE_UNTAKEABLE_TWINS = (
    db.leases.update()
    .where(
        db.leases.c.twin_of.is_not(None),
        db.leases.c.state.in_(("twin", "expired")),
        ~sa.exists().where(
            db.nodes.c.pool_id == db.leases.c.pool_id,
            db.nodes.c.node_id != db.leases.c.twin_node,
            db.nodes.c.state == "healthy",
        ),
    )
    .values(state="lapsed")
)
_EXPIRE = (
    db.leases.update()
    .where(db.leases.c.lease_id == sa.bindparam("lease"), db.leases.c.state == "active")
    .values(state="expired")
)


def _elected(conn: sa.Connection) -> bool:
    """Whether this transaction is the one sweeper: on PostgreSQL, several server processes
    each run a sweeper loop, and the one that takes the sweeper lock sweeps while the others
    skip their turn (the lock ends with the transaction). SQLite has one process."""
    if conn.dialect.name != "postgresql":
        return True
    return bool(conn.execute(_TRY_SWEEPER).scalar_one())


def sweep(ctx: Context) -> dict[str, int]:
    """Advance node health and expire overdue leases (a soft invalidation each).

    Each health rule is one set-based update touching only the nodes it moves, so a sweep over
    a large, healthy pool reads almost nothing. Across processes a lease is expired once: one
    sweeper runs at a time (:func:`_elected`), a lease whose node is busy (a submission may be
    answering it) waits for the next sweep, and the expiry only moves a lease still active.
    """
    cfg, now = ctx.config, ctx.clock()
    changed = {"nodes": 0, "leases": 0}
    flush_beats(ctx)  # silence is judged on every beat this process answered
    last_sign = sa.func.coalesce(db.nodes.c.last_beat_at, db.nodes.c.joined_at)
    with ctx.engine.begin() as conn:
        if not _elected(conn):
            return changed
        for sources, target, threshold in SILENCE_TRANSITIONS:
            cutoff = now - getattr(cfg, threshold)
            if ctx.started_at >= cutoff:
                continue  # nobody can have been silent that long since this process started
            where = sa.and_(db.nodes.c.state.in_(sources), last_sign < cutoff)
            if target in RELEASES_LEASES:
                moved = conn.execute(
                    sa.select(db.nodes.c.pool_id, db.nodes.c.node_id).where(where)
                ).all()
                for pool_id, node_id in moved:
                    release_leases(conn, pool_id, node_id)
            changed["nodes"] += conn.execute(
                db.nodes.update().where(where).values(state=target)
            ).rowcount
        changed["leases"] += conn.execute(_LAPSE_TWINS, {"now": now}).rowcount
        changed["leases"] += conn.execute(_LAPSE_UNTAKEABLE_TWINS).rowcount
        for lease in conn.execute(_OVERDUE, {"now": now}).all():
            node = {"p": lease.pool_id, "n": lease.node_id}
            if conn.execute(_NODE_UNLESS_BUSY, node).first() is None:
                continue
            if conn.execute(_EXPIRE, {"lease": lease.lease_id}).rowcount != 1:
                continue
            changed["leases"] += 1
            conn.execute(
                db.nodes.update()
                .where(db.nodes.c.pool_id == lease.pool_id, db.nodes.c.node_id == lease.node_id)
                .values(soft=db.nodes.c.soft + 1)
            )
            body = {
                "severity": "soft",
                "reason": "lease expired unanswered",
                "lease_id": lease.lease_id,
            }
            ctx.ledger.append(
                conn, "invalidation", body, pool_id=lease.pool_id, node_id=lease.node_id, ts=now
            )
    return changed
