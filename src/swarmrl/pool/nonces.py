"""The orchestrator's nonce store: signed-request nonces kept in the pool database.

Each (key, nonce) pair is stored until its timestamp leaves the request window, so a request
captured before a restart is refused after it, exactly as it would have been before. Expired
pairs are deleted at most every ``purge_every_s``. Runs on the orchestrator's event-loop thread
like every other database operation (``swarmrl.pool.app``). Knows nothing about signatures
(``swarmrl.identity.requests``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from swarmrl.pool import db

# built once: a claim runs on every signed request
_t = db.nonces
_INSERT = _t.insert()
_PURGE = _t.delete().where(_t.c.expires_at <= sa.bindparam("now"))
_KEY = sa.and_(_t.c.public_key == sa.bindparam("k"), _t.c.nonce == sa.bindparam("n"))
_SEEN = sa.select(_t.c.expires_at).where(_KEY)
_RENEW = _t.update().where(_KEY).values(expires_at=sa.bindparam("e"))


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
            seen = conn.execute(_SEEN, key).scalar_one_or_none()
            if seen is not None and seen > now:
                return False
            conn.execute(_RENEW, {**key, "e": expires_at_s})
        return True
