"""The admin views of a pool: its nodes, a node's log tail, and the pool's counts
(``PoolMetrics``). Each reads in one transaction after writing the buffered heartbeats, so what
it shows includes every beat this process answered. Knows nothing about HTTP.
"""

from __future__ import annotations

import json

import sqlalchemy as sa

from swarmrl.pool.state import db
from swarmrl.pool.trust.service import Context, current_version, flush_beats, node_row, node_view
from swarmrl.protocol.pool import NodeLogs, NodeView, PoolMetrics

ENGINES_SHOWN = 16  # engines of live members counted in PoolMetrics (as many as a spec accepts)


def list_nodes(ctx: Context, pool_id: str) -> list[NodeView]:
    flush_beats(ctx)
    with ctx.engine.connect() as conn:
        ctx.spec(conn, pool_id)
        rows = conn.execute(
            sa.select(db.nodes).where(db.nodes.c.pool_id == pool_id).order_by(db.nodes.c.joined_at)
        ).all()
        return [node_view(conn, r) for r in rows]


def node_logs(ctx: Context, pool_id: str, node_id: str) -> NodeLogs:
    flush_beats(ctx)
    with ctx.engine.connect() as conn:
        ctx.spec(conn, pool_id)
        row = node_row(conn, pool_id, node_id)
    return NodeLogs(node_id=node_id, lines=json.loads(row.log_tail))


def metrics(ctx: Context, pool_id: str) -> PoolMetrics:
    flush_beats(ctx)
    now = ctx.clock()
    with ctx.engine.connect() as conn:
        ctx.spec(conn, pool_id)

        def counts(table: sa.Table, column: sa.Column) -> dict[str, int]:
            rows = conn.execute(
                sa.select(column, sa.func.count())
                .where(table.c.pool_id == pool_id)
                .group_by(column)
            ).all()
            return {str(k): int(v) for k, v in rows}

        credited = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(db.credits.c.tokens), 0)).where(
                db.credits.c.pool_id == pool_id, db.credits.c.dropped.is_(False)
            )
        ).scalar_one()
        locked = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(db.credits.c.tokens), 0)).where(
                db.credits.c.pool_id == pool_id,
                db.credits.c.dropped.is_(False),
                db.credits.c.unlock_at > now,
            )
        ).scalar_one()
        validators = _validators_by_engine(ctx, conn, pool_id, now)
        nodes_by_engine = _nodes_by_engine(conn, pool_id)
        return PoolMetrics(
            pool_id=pool_id,
            current_version=current_version(conn, pool_id),
            nodes_by_state=counts(db.nodes, db.nodes.c.state),
            leases_active=counts(db.leases, db.leases.c.state).get("active", 0),
            submissions_by_status=counts(db.submissions, db.submissions.c.status),
            credited_tokens=int(credited),
            locked_tokens=int(locked),
            validators_by_engine=validators,
            nodes_by_engine=nodes_by_engine,
            engines_without_validator=without_validator(nodes_by_engine, validators),
        )


def _validators_by_engine(
    ctx: Context, conn: sa.Connection, pool_id: str, now: float
) -> dict[str, int]:
    """Validators that claimed within ``claim_timeout_s``, by the engine they named
    (``swarmrl.pool.flow.judging.engine_route``)."""
    seen = db.validator_engines
    rows = conn.execute(
        sa.select(seen.c.engine, sa.func.count())
        .where(seen.c.pool_id == pool_id, seen.c.seen_at >= now - ctx.config.claim_timeout_s)
        .group_by(seen.c.engine)
    ).all()
    return {str(e): int(n) for e, n in sorted(rows)}


def _nodes_by_engine(conn: sa.Connection, pool_id: str) -> dict[str, int]:
    """Live members (healthy, unhealthy) by the engine they declared at join: the
    :data:`ENGINES_SHOWN` most common. Nodes name their engine, so in a pool that accepts any,
    a crowd of identities could otherwise grow the metric's label set and the orchestrator's
    warnings without bound."""
    nodes = db.nodes
    count = sa.func.count().label("n")
    rows = conn.execute(
        sa.select(nodes.c.engine, count)
        .where(
            nodes.c.pool_id == pool_id,
            nodes.c.state.in_(("healthy", "unhealthy")),
            nodes.c.engine.is_not(None),
        )
        .group_by(nodes.c.engine)
        .order_by(count.desc(), nodes.c.engine)
        .limit(ENGINES_SHOWN)
    ).all()
    return {str(e): int(n) for e, n in sorted(rows)}


def without_validator(nodes_by_engine: dict[str, int], validators: dict[str, int]) -> list[str]:
    """The engines of live members that no validator named lately, while one of another engine
    did (with none claiming at all, nothing is judged, which the pending count shows)."""
    if not validators:
        return []
    return sorted(set(nodes_by_engine) - set(validators))
