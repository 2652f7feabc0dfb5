"""The contribution ledger: hash-chained entries signed by the orchestrator.

Entry ``k`` is the canonical JSON object ``{seq, ts, kind, pool_id, node_id, body, prev_hash}``;
``entry_hash = sha256(canonical_json(entry))`` and ``prev_hash`` of entry ``k`` is the
``entry_hash`` of entry ``k − 1`` (64 zeros for the first). The orchestrator signs the ASCII bytes
of ``entry_hash``. Changing, dropping, reordering or inserting any entry therefore breaks either
a hash, the chain or a signature, and anyone holding the orchestrator's public key can check an
export offline (``swarmrl.ledger.verify``).

Entries are appended inside the caller's database transaction, so a ledger entry exists exactly
when the state change it records was committed. Several orchestrator processes may share one
PostgreSQL ledger: an append first takes a transaction-scoped advisory lock (:func:`lock`), so
reading the head and inserting the next entry is one step across processes and the chain
cannot fork; the primary key on ``seq`` is the backstop (a fork would be a duplicate key, never
two entries). On SQLite one process writes and the database's single writer serialises appends.
This module knows nothing about pools beyond the entry kinds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.identity.keys import KeyPair, canonical_json, digest_hex

GENESIS_HASH = "0" * 64
EntryKind = Literal[
    "pool_created",
    "node_joined",
    "node_rejoined",  # a node ejected for silence came back with its key (swarmrl.pool.trust.joins)
    "submission",
    "verdict",
    "invalidation",
    "slash",
    "credit",
    "assignment_commit",
    "assignment_reveal",
    "vote",  # one validator's verdict on a disputed submission (swarmrl.pool.flow.spotcheck)
    # unchecked submissions made trainable by a later passed check, or a twin's comparison
    # (swarmrl.pool.flow.twins)
    "release",
]
ENTRY_KINDS: tuple[str, ...] = EntryKind.__args__  # type: ignore[attr-defined]

ledger_metadata = sa.MetaData()
ledger_table = sa.Table(
    "ledger",
    ledger_metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("pool_id", sa.String(64), nullable=True),
    sa.Column("node_id", sa.String(32), nullable=True, index=True),
    sa.Column("body", sa.Text, nullable=False),  # canonical JSON, hashed byte for byte
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("entry_hash", sa.String(64), nullable=False),
    sa.Column("signature", sa.String(128), nullable=False),
    # the dashboard's ledger pages filtered by kind, newest first (invalidations, verdicts …)
    sa.Index("ix_ledger_kind_seq", "kind", "seq"),
)


# built once: an append runs on most state changes, and building a statement costs as much as
# running it
_LAST_ENTRY = Fast(
    sa.select(ledger_table.c.seq, ledger_table.c.entry_hash)
    .order_by(ledger_table.c.seq.desc())
    .limit(1)
)
_INSERT = Fast(ledger_table.insert())
# the key of the ledger's PostgreSQL advisory lock (any fixed 64-bit number; "swarmled")
LEDGER_LOCK_KEY = 0x737761726D6C6564
_LOCK = sa.text("SELECT pg_advisory_xact_lock(:k)").bindparams(k=LEDGER_LOCK_KEY)


def lock(conn: sa.Connection) -> None:
    """Hold the ledger's append lock until ``conn``'s transaction ends (PostgreSQL; a no-op on
    SQLite, whose one writer already serialises transactions).

    Taking it again in the same transaction is free. Transactions take row locks before this
    lock, and once holding it wait for no row (a sweep that appends several entries takes each
    further row only if it is free), so no two transactions wait on each other in a cycle.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(_LOCK)


def entry_core(
    seq: int, ts: float, kind: str, pool_id: str | None, node_id: str | None, body: Any, prev: str
) -> dict[str, Any]:
    """The hashed part of an entry."""
    return {
        "seq": seq,
        "ts": ts,
        "kind": kind,
        "pool_id": pool_id,
        "node_id": node_id,
        "body": body,
        "prev_hash": prev,
    }


def entry_hash(core: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of an entry's hashed part, hex."""
    return digest_hex(canonical_json(core))


@dataclass(frozen=True)
class Entry:
    """One entry to append: its kind, body and subjects; ``ts`` None = now."""

    kind: EntryKind
    body: dict[str, Any]
    pool_id: str | None = None
    node_id: str | None = None
    ts: float | None = None


class Ledger:
    """Appends signed, chained entries through a SQLAlchemy connection."""

    def __init__(self, signer: KeyPair) -> None:
        self.signer = signer

    def append(
        self,
        conn: sa.Connection,
        kind: EntryKind,
        body: dict[str, Any],
        *,
        pool_id: str | None = None,
        node_id: str | None = None,
        ts: float | None = None,
    ) -> int:
        """Append one entry inside ``conn``'s transaction; returns its sequence number."""
        return self.append_many(conn, [Entry(kind, body, pool_id, node_id, ts)])[0]

    def append_many(self, conn: sa.Connection, entries: list[Entry]) -> list[int]:
        """Append ``entries`` in order inside ``conn``'s transaction, with one read of the head
        and one insert statement; returns their sequence numbers."""
        for entry in entries:
            if entry.kind not in ENTRY_KINDS:
                raise ValueError(f"unknown ledger entry kind {entry.kind!r}")
        lock(conn)
        last = _LAST_ENTRY.run(conn).first()
        seq, prev = (0, GENESIS_HASH) if last is None else (last.seq + 1, last.entry_hash)
        rows, seqs = [], []
        for entry in entries:
            ts = round(time.time() if entry.ts is None else entry.ts, 6)
            core = entry_core(seq, ts, entry.kind, entry.pool_id, entry.node_id, entry.body, prev)
            digest = entry_hash(core)
            rows.append(
                dict(
                    seq=seq,
                    ts=ts,
                    kind=entry.kind,
                    pool_id=entry.pool_id,
                    node_id=entry.node_id,
                    body=canonical_json(entry.body).decode(),
                    prev_hash=prev,
                    entry_hash=digest,
                    signature=self.signer.sign(digest.encode()),
                )
            )
            seqs.append(seq)
            seq, prev = seq + 1, digest
        if rows:
            _INSERT.run(conn, rows[0] if len(rows) == 1 else rows)
        return seqs


def attestation_message(entries: int, last_hash: str, at: float) -> bytes:
    """What the orchestrator signs to attest that its ledger held ``entries`` entries ending
    in ``last_hash`` at time ``at``: the bytes an export header's attestation is checked on."""
    return canonical_json(
        {"kind": "ledger-head", "entries": entries, "last_hash": last_hash, "at": at}
    )


def attest(
    signer: KeyPair, entries: int, last_hash: str, at: float | None = None
) -> dict[str, Any]:
    """A signed statement of the ledger's head, for an export header."""
    at = round(time.time() if at is None else at, 3)
    signature = signer.sign(attestation_message(entries, last_hash, at))
    return {"entries": entries, "last_hash": last_hash, "at": at, "signature": signature}
