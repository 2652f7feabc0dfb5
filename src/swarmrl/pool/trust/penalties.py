"""Penalties: hard and soft invalidation of a node, and the credits they take back.

Hard: the node is banned, its leases are released, its untrained work (checked or not) is
dropped and listed in the ``invalidation`` entry, and every credit still inside its lock window
is taken back (one ``slash`` entry). Another node's answer that matched the twin of one of its
units (``swarmrl.pool.flow.twins``: credited unchecked, its samples equal to the banned node's)
goes to validators, listed as ``recheck`` in the entry: a copy of a falsified unit (a second
identity of the same party) fails its replay and bans its node in turn; an honest one passes
and keeps its credit (it trains in place of the dropped original, or, where the original
trained already, stays ``matched``: ``swarmrl.pool.flow.twins.repeats_served``). Soft: one unit is dropped (and its credit, if still
locked). Each writes an ``invalidation`` ledger entry in the
caller's transaction. Knows nothing about HTTP.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from swarmrl.pool.rejections import Conflict, NotFound
from swarmrl.pool.state import db
from swarmrl.pool.trust.service import Context, node_row, node_view, release_leases
from swarmrl.protocol.pool import NodeView

# statuses of work not yet handed to a trainer (swarmrl.pool.state.db): an invalidation drops it
UNTRAINED = ("pending", "disputed", "unchecked", "accepted")


def _drop_credits(
    ctx: Context, conn: sa.Connection, pool_id: str, node_id: str, where: Any, reason: str
) -> None:
    now = ctx.clock()
    rows = conn.execute(
        sa.select(db.credits.c.submission_id, db.credits.c.tokens).where(
            db.credits.c.pool_id == pool_id,
            db.credits.c.node_id == node_id,
            db.credits.c.dropped.is_(False),
            db.credits.c.unlock_at > now,
            where,
        )
    ).all()
    if not rows:
        return
    ids = [r.submission_id for r in rows]
    conn.execute(
        db.credits.update().where(db.credits.c.submission_id.in_(ids)).values(dropped=True)
    )
    body = {"dropped_tokens": sum(r.tokens for r in rows), "submission_ids": ids, "reason": reason}
    ctx.ledger.append(conn, "slash", body, pool_id=pool_id, node_id=node_id, ts=now)


def matched_copies(conn: sa.Connection, pool_id: str, node_id: str) -> list[str]:
    """The ``matched`` twins' answers, by nodes not banned, that repeat a submission of
    ``node_id``: what a hard invalidation of ``node_id`` sends to validators (module
    docstring), sorted."""
    subs, leases, nodes = db.submissions, db.leases, db.nodes
    originals = sa.select(subs.c.submission_id).where(
        subs.c.pool_id == pool_id, subs.c.node_id == node_id
    )
    query = (
        sa.select(subs.c.submission_id)
        .join(leases, leases.c.lease_id == subs.c.lease_id)
        .join(nodes, sa.and_(nodes.c.pool_id == subs.c.pool_id, nodes.c.node_id == subs.c.node_id))
        .where(
            subs.c.pool_id == pool_id,
            subs.c.status == "matched",
            leases.c.twin_of.in_(originals),
            nodes.c.state != "banned",
        )
    )
    return sorted(conn.execute(query).scalars())


def invalidate_in(
    ctx: Context,
    conn: sa.Connection,
    pool_id: str,
    node_id: str,
    severity: str,
    reason: str,
    submission_id: str | None,
) -> None:
    """Hard: ban, drop all locked credits and untrained work (named in the ``invalidation``
    entry). Soft: drop one unit."""
    now = ctx.clock()
    body: dict[str, Any] = {"severity": severity, "reason": reason, "submission_id": submission_id}
    node_where = sa.and_(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id)
    sub_where = sa.and_(db.submissions.c.pool_id == pool_id, db.submissions.c.node_id == node_id)
    if severity == "hard":
        # a leased unit is in the trainer's hands already; an accepted one is not (even if a
        # lease on it ran out), nor is work waiting for a check or for a later passed check
        # (swarmrl.pool.flow.spotcheck), so none of those is ever served again
        untrained = sa.and_(sub_where, db.submissions.c.status.in_(UNTRAINED))
        dropped = sorted(
            conn.execute(sa.select(db.submissions.c.submission_id).where(untrained)).scalars()
        )
        body["dropped_submissions"] = dropped
        copies = matched_copies(conn, pool_id, node_id)
        body["recheck"] = copies
        ctx.ledger.append(conn, "invalidation", body, pool_id=pool_id, node_id=node_id, ts=now)
        conn.execute(
            db.nodes.update().where(node_where).values(state="banned", hard=db.nodes.c.hard + 1)
        )
        release_leases(conn, pool_id, node_id)
        conn.execute(db.submissions.update().where(untrained).values(status="dropped"))
        if copies:  # to validators: a copy is exactly as trustworthy as the original was
            subs = db.submissions
            conn.execute(
                subs.update().where(subs.c.submission_id.in_(copies)).values(status="pending")
            )
        _drop_credits(ctx, conn, pool_id, node_id, sa.true(), f"hard invalidation: {reason}")
        return
    ctx.ledger.append(conn, "invalidation", body, pool_id=pool_id, node_id=node_id, ts=now)
    conn.execute(db.nodes.update().where(node_where).values(soft=db.nodes.c.soft + 1))
    if submission_id is not None:
        conn.execute(
            db.submissions.update()
            .where(
                sub_where,
                db.submissions.c.submission_id == submission_id,
                db.submissions.c.status.in_(UNTRAINED),
            )
            .values(status="dropped")
        )
        _drop_credits(
            ctx,
            conn,
            pool_id,
            node_id,
            db.credits.c.submission_id == submission_id,
            f"soft invalidation: {reason}",
        )


def invalidate(
    ctx: Context, pool_id: str, node_id: str, severity: str, reason: str, submission_id: str | None
) -> NodeView:
    with ctx.engine.begin() as conn:
        ctx.spec(conn, pool_id)
        row = node_row(conn, pool_id, node_id)
        if row.state == "banned":
            raise Conflict(f"node {node_id} is already banned")
        if submission_id is not None:
            owner = conn.execute(
                sa.select(db.submissions.c.node_id).where(
                    db.submissions.c.submission_id == submission_id,
                    db.submissions.c.pool_id == pool_id,
                )
            ).first()
            if owner is None or owner.node_id != node_id:
                raise NotFound(f"submission {submission_id} of node {node_id} not found")
        invalidate_in(ctx, conn, pool_id, node_id, severity, reason, submission_id)
        return node_view(conn, node_row(conn, pool_id, node_id))
