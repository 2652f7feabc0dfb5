"""Heartbeats written to the database in batches: a buffer per server process, one flush a second.

A heartbeat that leaves a node's state as it was (a healthy node saying "ok" again: nearly every
beat) changes only its liveness columns: ``last_beat_at``, ``status``, ``model_version``,
``reported_tps`` and the log tail. :class:`BeatBuffer` keeps the latest such beat per node (and
every log line beats brought) and :meth:`BeatBuffer.flush` writes them all in one transaction,
every ``pool.heartbeat_flush_s`` (the orchestrator's flusher, ``swarmrl.pool.web.app``). A beat that
changes the state (a dead or unhealthy node coming back, a node reporting an error) is written
at once, in the heartbeat's own transaction, together with whatever the buffer held for the node,
so membership, leases and bans never wait for a flush.

What survives a crash: everything committed. What a crash loses: the beats of the last flush
period (at most ``heartbeat_flush_s`` of liveness and log lines). No work, credit, verdict or
ledger entry depends on a buffered beat. A beat's nonce is claimed before the beat is answered:
in the database, or in the process's memory and written with the flush, with the rules of
``swarmrl.pool.state.nonces`` keeping a beat replayed after a restart refused. Silence is measured
from the later of a node's last written beat and the orchestrator's start
(``swarmrl.pool.trust.health``), so beats lost in a crash cost no node its membership.

Several server processes: each buffers the beats it answered and flushes them itself. A flush
moves only a node still in the state the beat saw (a ban, an ejection or a sweep committed by any
process in between stays; the node's next beat then writes at once), and takes the log tails it
extends row-locked in node order (PostgreSQL), so two flushes never lose each other's lines.
The one elected sweeper judges silence on what is written, which trails a node's last beat by
at most a flush period (1 s against ``unhealthy_after_s``, 15 s by default).
Knows nothing about HTTP or signatures; the heartbeat's checks live in
``swarmrl.pool.trust.service``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.pool.state import db, nonces

LOG_TAIL_LINES = 200  # log lines kept per node
_IN_CHUNK = 500  # node ids per IN list when reading log tails

_n = db.nodes
_THIS_NODE = sa.and_(_n.c.pool_id == sa.bindparam("p"), _n.c.node_id == sa.bindparam("n"))
_LIVENESS = dict(
    last_beat_at=sa.bindparam("now"),
    status=sa.bindparam("status"),
    model_version=sa.bindparam("version"),
    reported_tps=sa.bindparam("tps"),
)
# a buffered beat: only if the node is still in the state the beat saw
_FLUSH = Fast(_n.update().where(_THIS_NODE, _n.c.state == sa.bindparam("seen")).values(**_LIVENESS))
_FLUSH_TAIL = Fast(
    _n.update()
    .where(_THIS_NODE, _n.c.state == sa.bindparam("seen"))
    .values(**_LIVENESS, log_tail=sa.bindparam("tail"))
)
# a state-changing beat: only if the node is still a member that beats may revive
_REVIVABLE = ("healthy", "unhealthy", "dead")
_WRITE = Fast(
    _n.update()
    .where(_THIS_NODE, _n.c.state.in_(_REVIVABLE))
    .values(**_LIVENESS, state=sa.bindparam("state"))
)
_WRITE_TAIL = Fast(
    _n.update()
    .where(_THIS_NODE, _n.c.state.in_(_REVIVABLE))
    .values(**_LIVENESS, state=sa.bindparam("state"), log_tail=sa.bindparam("tail"))
)


@dataclass
class Beat:
    """A node's latest beat not yet written; ``lines``: every log line beats brought since the
    last write, oldest first, already cut to the line limit."""

    state: str  # the state the beat leaves the node in (and, buffered, the state it found)
    at: float  # Unix seconds, orchestrator clock
    status: str
    model_version: int | None
    tokens_per_s: float | None
    lines: list[str] = field(default_factory=list)

    def then(self, later: Beat) -> Beat:
        """This beat followed by ``later``: the later values, the log lines of both."""
        lines = (self.lines + later.lines)[-LOG_TAIL_LINES:]
        return Beat(
            later.state, later.at, later.status, later.model_version, later.tokens_per_s, lines
        )


Key = tuple[str, str]  # (pool_id, node_id)


class BeatBuffer:
    """Beats answered but not yet written, by (pool, node); one per server process."""

    def __init__(self) -> None:
        self._pending: dict[Key, Beat] = {}
        # nonces of beats and leases claimed in this process's memory, written with the next
        # flush (swarmrl.pool.state.nonces.HotNonces)
        self._nonces: list[dict[str, object]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add_nonce(self, row: dict[str, object]) -> None:
        self._nonces.append(row)

    def add(self, pool_id: str, node_id: str, beat: Beat) -> None:
        key = (pool_id, node_id)
        earlier = self._pending.get(key)
        self._pending[key] = beat if earlier is None else earlier.then(beat)

    def take(self, pool_id: str, node_id: str) -> Beat | None:
        """Remove and return the node's buffered beat (to be written with a newer one)."""
        return self._pending.pop((pool_id, node_id), None)

    def flush(self, engine: sa.Engine) -> int:
        """Write every buffered beat, and the nonces added, in one transaction; the number of
        beats written. If the transaction fails the beats go back into the buffer (under any
        newer ones), the nonces too, and the error propagates."""
        if not self._pending and not self._nonces:
            return 0
        pending, self._pending = self._pending, {}
        claimed, self._nonces = self._nonces, []
        try:
            with engine.begin() as conn:
                nonces.insert_claimed(conn, claimed)
                write(conn, pending.items(), buffered=True)
        except BaseException:
            for key, beat in pending.items():
                newer = self._pending.get(key)
                self._pending[key] = beat if newer is None else beat.then(newer)
            self._nonces[:0] = claimed
            raise
        return len(pending)


def write(conn: sa.Connection, beats: Iterable[tuple[Key, Beat]], *, buffered: bool) -> None:
    """Write ``beats`` in the caller's transaction. ``buffered``: each moves its node only if
    the node is still in ``beat.state``; otherwise each sets the state of a node that beats may
    revive (healthy, unhealthy or dead)."""
    ordered = sorted(beats, key=lambda item: item[0])  # one lock order for every writer
    tails = _extended_tails(conn, [(key, beat.lines) for key, beat in ordered if beat.lines])
    plain, with_tail = [], []
    for (pool_id, node_id), beat in ordered:
        params = {
            "p": pool_id,
            "n": node_id,
            "now": beat.at,
            "status": beat.status,
            "version": beat.model_version,
            "tps": beat.tokens_per_s,
            ("seen" if buffered else "state"): beat.state,
        }
        tail = tails.get((pool_id, node_id))
        if tail is None:
            plain.append(params)
        else:
            with_tail.append({**params, "tail": tail})
    if plain:
        (_FLUSH if buffered else _WRITE).run(conn, plain)
    if with_tail:
        (_FLUSH_TAIL if buffered else _WRITE_TAIL).run(conn, with_tail)


def _extended_tails(conn: sa.Connection, new: list[tuple[Key, list[str]]]) -> dict[Key, str]:
    """The stored log tail of each node in ``new`` with its new lines appended (JSON, the last
    :data:`LOG_TAIL_LINES`), read row-locked (PostgreSQL) in the order given."""
    stored: dict[Key, str] = {}
    by_pool: dict[str, list[str]] = {}
    for (pool_id, node_id), _ in new:
        by_pool.setdefault(pool_id, []).append(node_id)
    for pool_id, node_ids in by_pool.items():
        for i in range(0, len(node_ids), _IN_CHUNK):
            query = (
                sa.select(_n.c.node_id, _n.c.log_tail)
                .where(_n.c.pool_id == pool_id, _n.c.node_id.in_(node_ids[i : i + _IN_CHUNK]))
                .order_by(_n.c.node_id)
                .with_for_update()
            )
            for node_id, tail in conn.execute(query):
                stored[(pool_id, node_id)] = tail
    return {
        key: json.dumps((json.loads(stored[key]) + lines)[-LOG_TAIL_LINES:])
        for key, lines in new
        if key in stored
    }
