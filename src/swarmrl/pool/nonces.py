"""The orchestrator's nonce store: signed-request nonces kept in the pool database.

Each (key, nonce) pair is stored until its timestamp leaves the request window, so a request
captured before a restart is refused after it, exactly as it would have been before. Expired
pairs are deleted at most every ``purge_every_s``. Runs on the orchestrator's event-loop thread
like every other database operation (``swarmrl.pool.app``). Safe across server processes
sharing PostgreSQL: a claim is an insert under the pair's primary key (of two processes
claiming one fresh pair, the second gets a duplicate key and refuses), and reusing an expired
pair is one conditional update (one process wins). Knows nothing about signatures
(``swarmrl.identity.requests``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from swarmrl.identity.requests import SignedRequest, replayed
from swarmrl.pool import db

# built once: a claim runs on every signed request
_t = db.nonces
_INSERT = _t.insert()
_PURGE = _t.delete().where(_t.c.expires_at <= sa.bindparam("now"))
_KEY = sa.and_(_t.c.public_key == sa.bindparam("k"), _t.c.nonce == sa.bindparam("n"))
# only a pair whose window has passed is renewed: of two processes reusing it at once, one wins
_RENEW = (
    _t.update()
    .where(_KEY, _t.c.expires_at <= sa.bindparam("now"))
    .values(expires_at=sa.bindparam("e"))
)


class DatabaseNonceStore:
    """A :class:`swarmrl.identity.requests.NonceStore` over the ``nonces`` table."""

    def __init__(
        self,
        engine: sa.Engine,
        clock: Callable[[], float] = time.time,
        purge_every_s: float = 10.0,
    ) -> None:
        self.engine, self.clock, self.purge_every_s = engine, clock, purge_every_s
        self._next_purge_s = 0.0

    def claim(self, public_key_hex: str, nonce: str, expires_at_s: float) -> bool:
        now = self.clock()
        if now >= self._next_purge_s:
            with self.engine.begin() as conn:
                conn.execute(_PURGE, {"now": now})
            self._next_purge_s = now + self.purge_every_s
        row = dict(public_key=public_key_hex, nonce=nonce, expires_at=expires_at_s)
        try:  # the common case, a fresh nonce, is one statement
            with self.engine.begin() as conn:
                conn.execute(_INSERT, row)
            return True
        except sa.exc.IntegrityError:
            pass
        key = {"k": public_key_hex, "n": nonce}
        with self.engine.begin() as conn:
            # an expired pair not yet purged: reuse it, once (a conditional update is atomic
            # across server processes; a pair purged meanwhile is inserted again)
            renewed = conn.execute(_RENEW, {**key, "now": now, "e": expires_at_s}).rowcount
            if renewed == 1:
                return True
        return self._insert_after_purge(row)

    def _insert_after_purge(self, row: dict[str, object]) -> bool:
        try:
            with self.engine.begin() as conn:
                conn.execute(_INSERT, row)
            return True
        except sa.exc.IntegrityError:  # present and live (or just claimed by another process)
            return False


# a fresh pair inserted (its nonce returned), an existing one left alone (nothing returned),
# without an error that would abort the caller's transaction
_INSERT_NEW = {
    "sqlite": sqlite.insert(_t).on_conflict_do_nothing().returning(_t.c.nonce),
    "postgresql": postgresql.insert(_t).on_conflict_do_nothing().returning(_t.c.nonce),
}


def claim_in(store: DatabaseNonceStore, who: SignedRequest, conn: sa.Connection) -> None:
    """Claim the nonce of ``who`` (verified with ``claim=False``) inside the caller's
    transaction, or raise :class:`~swarmrl.errors.ReplayedRequest`: one transaction for the
    claim and the request's own work instead of two. As :meth:`DatabaseNonceStore.claim`, a
    pair still inside its window is refused and an expired one is reused, once, across
    processes (the insert and the conditional update are each atomic)."""
    now = store.clock()
    if now >= store._next_purge_s:
        conn.execute(_PURGE, {"now": now})
        store._next_purge_s = now + store.purge_every_s
    key, nonce = who.public_key.hex, who.nonce
    row = dict(public_key=key, nonce=nonce, expires_at=who.nonce_expires_at)
    insert = _INSERT_NEW.get(conn.dialect.name)
    if insert is not None:
        fresh = conn.execute(insert, row).first() is not None
    else:  # another database: a savepoint keeps a duplicate key from aborting the transaction
        try:
            with conn.begin_nested():
                conn.execute(_INSERT, row)
            fresh = True
        except sa.exc.IntegrityError:
            fresh = False
    if fresh:
        return
    params = {"k": key, "n": nonce, "now": now, "e": who.nonce_expires_at}
    if conn.execute(_RENEW, params).rowcount != 1:
        raise replayed(nonce)
