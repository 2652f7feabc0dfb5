"""Assignment secrets: what makes a node's tasks unpredictable to it, yet checkable afterwards.

Each pool has a current *assignment epoch* with a secret only the orchestrator knows (32 random
bytes, hex). Task draws and unit seeds mix the secret in (``swarmrl.pool.flow.scheduling``), so a
node cannot compute which tasks a key will be given before it holds the lease, and grinding
keys before joining buys it nothing. The secret is committed in advance: when an epoch opens,
the ledger gets an ``assignment_commit`` entry with ``sha256(secret)``; when the trainer
announces a newer policy version the epoch closes, its secret is revealed in an
``assignment_reveal`` entry and the next epoch opens. Anyone holding the ledger can then check
the reveal against the commitment and recompute every lease of that epoch from its work unit
(``assignment_epoch``, origin node, origin counter). Secrets live in the pool database and
survive restarts.

Runs inside the caller's transaction; knows nothing about HTTP or leases beyond the epoch.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.identity.keys import digest_hex
from swarmrl.pool.state import db

if TYPE_CHECKING:
    from swarmrl.pool.trust.service import Context


def commitment(secret: str) -> str:
    """The published digest of an epoch's secret: sha256 of its ASCII hex, hex."""
    return digest_hex(secret.encode())


def open_epoch(ctx: Context, conn: sa.Connection, pool_id: str, epoch: int, now: float) -> None:
    """Draw a fresh secret for ``epoch`` and commit to it in the ledger."""
    secret = secrets.token_hex(32)
    conn.execute(
        db.assignment_secrets.insert(),
        dict(pool_id=pool_id, epoch=epoch, secret=secret, opened_at=now, revealed_at=None),
    )
    body = {"epoch": epoch, "commitment": commitment(secret)}
    ctx.ledger.append(conn, "assignment_commit", body, pool_id=pool_id, ts=now)


# built once: read on every lease and submission
_OPEN_EPOCH = Fast(
    sa.select(db.assignment_secrets.c.epoch, db.assignment_secrets.c.secret)
    .where(
        db.assignment_secrets.c.pool_id == sa.bindparam("p"),
        db.assignment_secrets.c.revealed_at.is_(None),
    )
    .order_by(db.assignment_secrets.c.epoch.desc())
    .limit(1)
)


def current(ctx: Context, conn: sa.Connection, pool_id: str) -> tuple[int, str]:
    """(epoch, secret) of the pool's open epoch (opened now if the pool has none yet)."""
    t = db.assignment_secrets
    row = _OPEN_EPOCH.run(conn, {"p": pool_id}).first()
    if row is None:
        last = conn.execute(sa.select(sa.func.max(t.c.epoch)).where(t.c.pool_id == pool_id))
        previous = last.scalar_one()
        open_epoch(ctx, conn, pool_id, 0 if previous is None else previous + 1, ctx.clock())
        row = _OPEN_EPOCH.run(conn, {"p": pool_id}).one()
    return int(row.epoch), str(row.secret)


def rotate(ctx: Context, conn: sa.Connection, pool_id: str, now: float) -> int:
    """Reveal the open epoch's secret in the ledger and open the next epoch; returns it."""
    epoch, secret = current(ctx, conn, pool_id)
    t = db.assignment_secrets
    conn.execute(
        t.update().where(t.c.pool_id == pool_id, t.c.epoch == epoch).values(revealed_at=now)
    )
    body = {"epoch": epoch, "secret": secret}
    ctx.ledger.append(conn, "assignment_reveal", body, pool_id=pool_id, ts=now)
    open_epoch(ctx, conn, pool_id, epoch + 1, now)
    return epoch + 1
