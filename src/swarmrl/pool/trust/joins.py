"""Joining a pool, and rejoining it after an ejection for silence.

A join admits a node: the pool's requirements checked against its metadata, a token of the
pool's join rate taken, for a closed pool a single-use invite signed by the pool's owner, and a
``node_joined`` ledger entry. A rejoin: a node the pool let go for silence comes back with its
own key, without an invite.

Silence is no offence: a node whose beats stopped (a network cut, a suspended machine, a
restart) was declared ``dead`` and then ``ejected`` by the health sweep
(``swarmrl.pool.trust.health``) and its leases were released. Its admission still stands, so a
signed rejoin request from the same key brings it back to ``healthy``: the request is signed
over its route, body, time and a single-use nonce (``swarmrl.identity.requests``), so only the
holder of the node's key can make it and a captured one cannot be replayed. A banned node stays
out (a hard invalidation is final), and a node the pool never admitted must join with an invite.
A join request from such a node (a worker restarted with its spent invite) is a rejoin too: see
:func:`join_or_rejoin`.

A rejoin changes the node's state, metadata and last sign of life, nothing else: its joining
time, its accepted / soft / hard counters, its credits (locked or dropped), its spot-check
record and its lease counter stay as they were, so coming back never improves a record. It
takes a token of the pool's join rate like a join, re-checks the pool's requirements against
the node's metadata now, and writes a ``node_rejoined`` ledger entry. Runs in one transaction;
knows nothing about HTTP.
"""

from __future__ import annotations

import sqlalchemy as sa

from swarmrl.errors import BadSignature, RateLimited
from swarmrl.identity.keys import canonical_json, verify_signature
from swarmrl.pool.rejections import Conflict, Expired, NodeBanned, Unauthorized
from swarmrl.pool.state import db
from swarmrl.pool.trust.limits import take_join_token
from swarmrl.pool.trust.service import Context, node_row, node_row_or_none, node_view
from swarmrl.protocol.pool import (
    JoinRequest,
    NodeMetadata,
    NodeView,
    PoolSpec,
    RejoinRequest,
    Requirements,
)


def _check_requirements(req: Requirements, meta: NodeMetadata) -> None:
    problems = []
    if req.engines and meta.engine not in req.engines:
        problems.append(f"engine {meta.engine!r} not in {req.engines}")
    if meta.memory_gb < req.min_memory_gb:
        problems.append(f"memory {meta.memory_gb:g} GiB < {req.min_memory_gb:g} GiB")
    if req.accelerators and meta.accelerator not in req.accelerators:
        problems.append(f"accelerator {meta.accelerator!r} not in {req.accelerators}")
    if problems:
        raise Unauthorized("node does not meet the pool's requirements: " + "; ".join(problems))


def _check_invite(
    conn: sa.Connection, spec: PoolSpec, req: JoinRequest, node_id: str, now: float
) -> str:
    invite = req.invite
    if invite is None:
        raise Unauthorized(f"pool {spec.pool_id!r} is closed: an invite from its owner is required")
    if invite.pool_id != spec.pool_id:
        raise Unauthorized(f"invite is for pool {invite.pool_id!r}, not {spec.pool_id!r}")
    try:
        verify_signature(spec.owner_key, canonical_json(invite.signed_part()), invite.signature)
    except BadSignature as exc:
        raise Unauthorized(f"invite is not signed by the pool owner ({exc})") from exc
    if invite.expires_at <= now:
        raise Expired(f"invite {invite.invite_id} expired at {invite.expires_at:.0f}")
    if invite.node_id is not None and invite.node_id != node_id:
        raise Unauthorized(f"invite {invite.invite_id} is for another node")
    used = conn.execute(
        sa.select(db.invites_used.c.node_id).where(db.invites_used.c.invite_id == invite.invite_id)
    ).first()
    if used is not None:
        raise Conflict(f"invite {invite.invite_id} was already used")
    conn.execute(
        db.invites_used.insert(),
        dict(invite_id=invite.invite_id, pool_id=spec.pool_id, node_id=node_id, used_at=now),
    )
    return invite.invite_id


def _admit_new(ctx: Context, conn: sa.Connection, pool_id: str, now: float) -> None:
    """Take a join token of the pool, or :class:`RateLimited` saying when to come back."""
    cfg = ctx.config
    wait_s = take_join_token(conn, pool_id, cfg.join_rate_per_s, cfg.join_burst, now)
    if wait_s > 0:
        raise RateLimited(
            f"too many new nodes joining pool {pool_id!r} (at most {cfg.join_rate_per_s:g}/s, "
            f"bursts of {cfg.join_burst}); try again in {wait_s:.1f} s"
        )


def join(
    ctx: Context, pool_id: str, public_key_hex: str, node_id: str, req: JoinRequest
) -> NodeView:
    """Admit a node (or return it unchanged if it is already a member).

    Two joins racing from two server processes (the same node twice, or two nodes with one
    single-use invite) both insert a row under one primary key (``nodes``, ``invites_used``,
    a pool's first ``join_buckets`` row); PostgreSQL makes the second wait for the first and
    then fail with a duplicate key. That join runs once more and now sees the committed state:
    the node is a member (its view is the answer) or the invite was used (409).
    """
    try:
        return _join(ctx, pool_id, public_key_hex, node_id, req)
    except sa.exc.IntegrityError:
        return _join(ctx, pool_id, public_key_hex, node_id, req)


def _join(
    ctx: Context, pool_id: str, public_key_hex: str, node_id: str, req: JoinRequest
) -> NodeView:
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        existing = node_row_or_none(conn, pool_id, node_id, lock=True)
        if existing is not None and existing.state == "banned":
            raise NodeBanned(f"node {node_id} is banned from pool {pool_id!r}")
        if existing is not None and existing.state != "ejected":
            return node_view(conn, existing)
        _check_requirements(spec.requirements, req.metadata)
        _admit_new(ctx, conn, pool_id, now)
        invite_id = None if spec.open else _check_invite(conn, spec, req, node_id, now)
        values = dict(
            public_key=public_key_hex,
            state="healthy",
            metadata=req.metadata.model_dump_json(),
            engine=req.metadata.engine,
            joined_at=now,
            last_beat_at=now,
            status="ok",
        )
        if existing is None:
            conn.execute(
                db.nodes.insert(),
                dict(
                    pool_id=pool_id,
                    node_id=node_id,
                    log_tail="[]",
                    lease_counter=0,
                    accepted=0,
                    soft=0,
                    hard=0,
                    **values,
                ),
            )
        else:
            conn.execute(
                db.nodes.update()
                .where(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id)
                .values(**values)
            )
        body = {"public_key": public_key_hex, "metadata": req.metadata.model_dump(mode="json")}
        ctx.ledger.append(
            conn,
            "node_joined",
            {**body, "invite_id": invite_id},
            pool_id=pool_id,
            node_id=node_id,
            ts=now,
        )
        return node_view(conn, node_row(conn, pool_id, node_id))


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
            return node_view(conn, row)
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
                engine=req.metadata.engine,
                last_beat_at=now,
                status="ok",
            )
        )
        body = {"from_state": row.state, "metadata": req.metadata.model_dump(mode="json")}
        ctx.ledger.append(conn, "node_rejoined", body, pool_id=pool_id, node_id=node_id, ts=now)
        return node_view(conn, node_row(conn, pool_id, node_id))


def join_or_rejoin(
    ctx: Context, pool_id: str, public_key_hex: str, node_id: str, req: JoinRequest
) -> NodeView:
    """A join: a rejoin for a node let go for silence (its invite, if any, is not looked at),
    else :func:`join`. Each re-reads the node in its own transaction."""
    with ctx.engine.connect() as conn:
        ctx.spec(conn, pool_id)
        state = conn.execute(
            sa.select(db.nodes.c.state).where(
                db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id
            )
        ).scalar()
    if state in RETURNS:
        return rejoin(ctx, pool_id, public_key_hex, node_id, RejoinRequest(metadata=req.metadata))
    return join(ctx, pool_id, public_key_hex, node_id, req)
