"""Rejoining: a node the pool let go for silence comes back with its own key, without an invite.

Silence is no offence: a node whose beats stopped (a network cut, a suspended machine, a
restart) was declared ``dead`` and then ``ejected`` by the health sweep (``swarmrl.pool.health``)
and its leases were released. Its admission still stands, so a signed rejoin request from the
same key brings it back to ``healthy``: the request is signed over its route, body, time and a
single-use nonce (``swarmrl.identity.requests``), so only the holder of the node's key can make
it and a captured one cannot be replayed. A banned node stays out (a hard invalidation is
final), and a node the pool never admitted must join with an invite. A join request from such a
node (a worker restarted with its spent invite) is a rejoin too: see :func:`join_or_rejoin`.

A rejoin changes the node's state, metadata and last sign of life, nothing else: its joining
time, its accepted / soft / hard counters, its credits (locked or dropped), its spot-check
record and its lease counter stay as they were, so coming back never improves a record. It
takes a token of the pool's join rate like a join, re-checks the pool's requirements against
the node's metadata now, and writes a ``node_rejoined`` ledger entry. Runs in one transaction;
knows nothing about HTTP.
"""

from __future__ import annotations

import sqlalchemy as sa

from swarmrl.pool import db, service
from swarmrl.pool.rejections import NodeBanned, Unauthorized
from swarmrl.pool.service import (
    Context,
    _admit_new,
    _check_requirements,
    _node_view,
    node_row,
)
from swarmrl.protocol.pool import JoinRequest, NodeView, RejoinRequest

# states a rejoin brings back to healthy; a member (healthy, unhealthy) gets its view unchanged
RETURNS: tuple[str, ...] = ("dead", "ejected")


def rejoin(
    ctx: Context, pool_id: str, public_key_hex: str, node_id: str, req: RejoinRequest
) -> NodeView:
    """Bring ``node_id`` back after an ejection for silence (module docstring)."""
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        # locked: two rejoins at two server processes take turns, the second finds it healthy
        row = node_row(conn, pool_id, node_id, lock=True)  # never admitted: NotFound, join first
        if row.public_key != public_key_hex:
            raise Unauthorized(f"node {node_id} joined with another key")
        if row.state == "banned":
            raise NodeBanned(f"node {node_id} is banned from pool {pool_id!r}")
        if row.state not in RETURNS:
            return _node_view(conn, row)
        _check_requirements(spec.requirements, req.metadata)
        _admit_new(ctx, conn, pool_id, now)
        conn.execute(
            db.nodes.update()
            .where(
                db.nodes.c.pool_id == pool_id,
                db.nodes.c.node_id == node_id,
                db.nodes.c.state == row.state,
            )
            .values(
                state="healthy",
                metadata=req.metadata.model_dump_json(),
                last_beat_at=now,
                status="ok",
            )
        )
        body = {"from_state": row.state, "metadata": req.metadata.model_dump(mode="json")}
        ctx.ledger.append(conn, "node_rejoined", body, pool_id=pool_id, node_id=node_id, ts=now)
        return _node_view(conn, node_row(conn, pool_id, node_id))


def join_or_rejoin(
    ctx: Context, pool_id: str, public_key_hex: str, node_id: str, req: JoinRequest
) -> NodeView:
    """A join: a rejoin for a node let go for silence (its invite, if any, is not looked at),
    else ``swarmrl.pool.service.join``. Each re-reads the node in its own transaction."""
    with ctx.engine.connect() as conn:
        ctx.spec(conn, pool_id)
        state = conn.execute(
            sa.select(db.nodes.c.state).where(
                db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id
            )
        ).scalar()
    if state in RETURNS:
        return rejoin(ctx, pool_id, public_key_hex, node_id, RejoinRequest(metadata=req.metadata))
    return service.join(ctx, pool_id, public_key_hex, node_id, req)
