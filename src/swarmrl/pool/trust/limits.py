"""Rate limits of the orchestrator: a token bucket per pool for admitting new identities.

A bucket holds at most ``burst`` tokens and refills at ``rate_per_s``; admitting one new node
takes a token. Fresh keys cost nothing to make, so without a limit one peer could flood a pool
(and its ledger) with identities, or rejoin at once under a new key after a ban.

Buckets live in the pool database (``join_buckets``), read with their row locked and written
back in the join's own transaction: several server processes on one PostgreSQL database then
share one bucket (a per-process bucket would admit N times the rate), and a join that is
refused later in its transaction (a used invite) gives its token back by rolling back. A
restart keeps the bucket. Knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from swarmrl.pool.state import db


@dataclass
class TokenBucket:
    """``take(now)`` returns 0 when a token was taken, else the seconds until one is there."""

    rate_per_s: float
    burst: int
    tokens: float = -1.0  # -1: full on first use
    last_s: float = 0.0

    def take(self, now: float) -> float:
        if self.tokens < 0:
            self.tokens, self.last_s = float(self.burst), now
        # a clock that stepped back refills nothing (and never drains the bucket)
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last_s) * self.rate_per_s)
        self.last_s = max(self.last_s, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


_t = db.join_buckets
_READ = (
    sa.select(_t.c.tokens, _t.c.last_s).where(_t.c.pool_id == sa.bindparam("p")).with_for_update()
)
_WRITE = (
    _t.update()
    .where(_t.c.pool_id == sa.bindparam("p"))
    .values(tokens=sa.bindparam("tokens"), last_s=sa.bindparam("last"))
)


def take_join_token(
    conn: sa.Connection, pool_id: str, rate_per_s: float, burst: int, now: float
) -> float:
    """Take one token of ``pool_id``'s join bucket inside ``conn``'s transaction: 0 when taken,
    else the seconds until one is there. The bucket's row stays locked until the transaction
    ends, so concurrent joins of one pool (from any process) take tokens one after another."""
    row = conn.execute(_READ, {"p": pool_id}).first()
    if row is None:
        # a pool's first join: create its bucket full. Two processes doing this at once both
        # insert; the loser's duplicate key fails its transaction, and the join is retried
        # (``swarmrl.pool.trust.joins.join``), then finding the row.
        conn.execute(_t.insert(), dict(pool_id=pool_id, tokens=float(burst), last_s=now))
        bucket = TokenBucket(rate_per_s, burst, float(burst), now)
    else:
        bucket = TokenBucket(rate_per_s, burst, row.tokens, row.last_s)
    wait_s = bucket.take(now)
    if wait_s == 0.0:
        conn.execute(_WRITE, {"p": pool_id, "tokens": bucket.tokens, "last": bucket.last_s})
    return wait_s
