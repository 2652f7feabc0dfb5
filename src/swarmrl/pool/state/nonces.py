"""The orchestrator's nonce store: signed-request nonces kept in the pool database.

Each (key, nonce) pair is stored until its timestamp leaves the request window, so a request
captured before a restart is refused after it, exactly as it would have been before. Expired
pairs are deleted at most every ``purge_every_s``. Runs on the orchestrator's event-loop thread
like every other database operation (``swarmrl.pool.web.app``). Safe across server processes
sharing PostgreSQL: a claim is an insert under the pair's primary key (of two processes
claiming one fresh pair, the second gets a duplicate key and refuses), and reusing an expired
pair is one conditional update (one process wins). Knows nothing about signatures
(``swarmrl.identity.requests``).

Heartbeats and leases, two of the three requests a node sends most, are claimed in memory
when one server process serves the database (:class:`HotNonces`): they cost no database write
of their own (a lease claiming in the table would take a transaction before the lease's own),
and the nonces claimed are written to the table with the buffered beats
(``swarmrl.pool.trust.beats``), in the same transaction, every ``heartbeat_flush_s``. A submission
claims its nonce in its own transaction (:func:`claim_in`), with the submission it commits.
What keeps a replay refused across a restart:

- a process starts by reading every pair of the table still inside its window (every nonce a
  process before it claimed and wrote), so a beat or lease it finds there is refused as a
  replay;
- a clean stop writes every claimed nonce and leaves a row in ``clean_stops``; a process that
  finds none (the one before it crashed, so the nonces of its last flush period may be lost)
  refuses every beat and lease signed before its start plus the accepted clock skew
  (``request_future_skew_s``), the latest time such a lost claim can carry. Honest nodes lose
  at most that many seconds of beats and leases after a crash (both are asked again; nothing
  of a node's work is lost); their membership is judged from the start
  (``swarmrl.pool.trust.health``).

Several server processes on one database (PostgreSQL) each claim every nonce in the table.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from swarmrl.errors import ReplayedRequest
from swarmrl.fastsql import Fast
from swarmrl.identity.requests import MemoryNonceStore, SignedRequest, replayed
from swarmrl.pool.state import db

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
    "sqlite": Fast(sqlite.insert(_t).on_conflict_do_nothing().returning(_t.c.nonce)),
    "postgresql": Fast(postgresql.insert(_t).on_conflict_do_nothing().returning(_t.c.nonce)),
}
_PURGE_FAST, _RENEW_FAST = Fast(_PURGE), Fast(_RENEW)


def claim_in(store: DatabaseNonceStore, who: SignedRequest, conn: sa.Connection) -> None:
    """Claim the nonce of ``who`` (verified with ``claim=False``) inside the caller's
    transaction, or raise :class:`~swarmrl.errors.ReplayedRequest`: one transaction for the
    claim and the request's own work instead of two. As :meth:`DatabaseNonceStore.claim`, a
    pair still inside its window is refused and an expired one is reused, once, across
    processes (the insert and the conditional update are each atomic)."""
    now = store.clock()
    if now >= store._next_purge_s:
        _PURGE_FAST.run(conn, {"now": now})
        store._next_purge_s = now + store.purge_every_s
    key, nonce = who.public_key.hex, who.nonce
    row = dict(public_key=key, nonce=nonce, expires_at=who.nonce_expires_at)
    insert = _INSERT_NEW.get(conn.dialect.name)
    if insert is not None:
        fresh = insert.run(conn, row).first() is not None
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
    if _RENEW_FAST.run(conn, params).rowcount != 1:
        raise replayed(nonce)


# many rows at once, those present skipped
_INSERT_OR_SKIP = {
    "sqlite": Fast(sqlite.insert(_t).on_conflict_do_nothing()),
    "postgresql": Fast(postgresql.insert(_t).on_conflict_do_nothing()),
}


def insert_claimed(conn: sa.Connection, rows: list[dict[str, object]]) -> None:
    """Write nonces already claimed in a process's memory (:class:`HotNonces`) in the caller's
    transaction; a pair already present stays as it is."""
    if not rows:
        return
    insert = _INSERT_OR_SKIP.get(conn.dialect.name)
    if insert is not None:
        insert.run(conn, rows)
        return
    for row in rows:  # another database: one savepoint per row
        try:
            with conn.begin_nested():
                conn.execute(_INSERT, row)
        except sa.exc.IntegrityError:
            pass


class HotNonces:
    """Heartbeat and lease nonces claimed by this server process, in memory (see the module's
    text).

    ``refused_before_s``: requests signed earlier are refused (0 after a clean stop)."""

    def __init__(self, refused_before_s: float = 0.0) -> None:
        self.refused_before_s = refused_before_s
        self._memory = MemoryNonceStore()

    @classmethod
    def at_start(cls, engine: sa.Engine, now_s: float, future_skew_s: float) -> HotNonces:
        """The nonces of a process starting at ``now_s`` over ``engine``'s database: the
        table's live pairs taken in, and requests signed before ``now_s + future_skew_s`` (the
        latest a request the process before it answered can carry) refused unless that process
        stopped cleanly."""
        clean = take_clean_stop(engine)
        hot_nonces = cls(0.0 if clean else now_s + future_skew_s)
        query = sa.select(_t.c.public_key, _t.c.nonce, _t.c.expires_at).where(
            _t.c.expires_at > now_s
        )
        with engine.connect() as conn:
            for key, nonce, until in conn.execute(query):
                hot_nonces._memory.claim(key, nonce, until)
        return hot_nonces

    def claim(self, who: SignedRequest) -> None:
        """Claim the nonce of ``who`` or raise :class:`ReplayedRequest`; the caller has it
        written later (:meth:`row`, with the buffered beats) unless it is in the table."""
        if who.timestamp_ms / 1000.0 < self.refused_before_s:
            raise ReplayedRequest(
                f"request signed at {who.timestamp_ms / 1000.0:.3f}, before "
                f"{self.refused_before_s:.3f}: the orchestrator restarted after an unclean stop "
                "and cannot know which requests signed earlier it answered; sign a new one"
            )
        if not self._memory.claim(who.public_key.hex, who.nonce, who.nonce_expires_at):
            raise replayed(who.nonce)

    @staticmethod
    def row(who: SignedRequest) -> dict[str, object]:
        """The table row of a claimed nonce."""
        return dict(public_key=who.public_key.hex, nonce=who.nonce, expires_at=who.nonce_expires_at)


_stops = db.clean_stops


def take_clean_stop(engine: sa.Engine) -> bool:
    """Whether the process before this one stopped cleanly (its row is taken, so a crash of
    this one is seen by the next). A database no node ever joined counts as clean."""
    with engine.begin() as conn:
        if conn.execute(_stops.delete()).rowcount > 0:
            return True
        return conn.execute(sa.select(db.nodes.c.node_id).limit(1)).first() is None


def record_clean_stop(engine: sa.Engine, at_s: float) -> None:
    """Leave the row :func:`take_clean_stop` looks for (every claimed nonce is written)."""
    with engine.begin() as conn:
        conn.execute(_stops.delete())
        conn.execute(_stops.insert(), {"stopped_at": at_s})
