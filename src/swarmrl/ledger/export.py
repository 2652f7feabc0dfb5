"""Reading ledger entries out of a database and writing export files.

Knows the ledger table and the export format; knows nothing about pools beyond the
``pool_id`` each entry carries (:class:`LedgerTally` counts per pool).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from swarmrl.errors import UserError
from swarmrl.ledger.chain import ledger_table
from swarmrl.ledger.counts import LedgerCounts, SubmissionCounts
from swarmrl.ledger.verify import export_lines


def read_entries(engine: sa.Engine, last: int | None = None) -> list[dict[str, Any]]:
    """Entries in sequence order (only the newest ``last`` if given), in export form."""
    query = sa.select(ledger_table).order_by(
        ledger_table.c.seq.desc() if last else ledger_table.c.seq
    )
    if last:
        query = query.limit(last)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    if last:
        rows = rows[::-1]
    return [_export_form(r) for r in rows]


def read_entries_from(engine: sa.Engine, start: int, limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` entries with ``seq ≥ start``, in sequence order, in export form."""
    query = (
        sa.select(ledger_table)
        .where(ledger_table.c.seq >= start)
        .order_by(ledger_table.c.seq)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [_export_form(r) for r in conn.execute(query).all()]


def read_page(
    engine: sa.Engine,
    before: int,
    limit: int,
    *,
    kind: str = "",
    pool_id: str | None = None,
    node_prefix: str = "",
) -> list[dict[str, Any]]:
    """At most ``limit`` entries with ``seq < before``, newest first, in export form, filtered
    by kind, pool and node id prefix (lowercase hex). Each filter runs on an index (kind: ``ix_ledger_kind_seq``,
    node: the node id index, as a range), so a page costs its own rows, not the ledger's."""
    c = ledger_table.c
    query = sa.select(ledger_table).where(c.seq < before)
    if kind:
        query = query.where(c.kind == kind)
    if pool_id is not None:
        query = query.where(c.pool_id == pool_id)
    if node_prefix:
        # a range rather than LIKE ('p%' uses no index on SQLite by default); node ids are
        # lowercase hex, so every id starting with the prefix sorts below prefix + "g"
        query = query.where(c.node_id >= node_prefix, c.node_id < node_prefix + "g")
    query = query.order_by(c.seq.desc()).limit(limit)
    with engine.connect() as conn:
        return [_export_form(r) for r in conn.execute(query).all()]


def head_count(engine: sa.Engine) -> int:
    """The number of entries in the ledger (its last ``seq`` + 1; 0 when empty)."""
    with engine.connect() as conn:
        last = conn.execute(sa.select(sa.func.max(ledger_table.c.seq))).scalar()
    return 0 if last is None else int(last) + 1


def _export_form(r: sa.Row[Any]) -> dict[str, Any]:
    return {
        "seq": r.seq,
        "ts": r.ts,
        "kind": r.kind,
        "pool_id": r.pool_id,
        "node_id": r.node_id,
        "body": json.loads(r.body),
        "prev_hash": r.prev_hash,
        "entry_hash": r.entry_hash,
        "signature": r.signature,
    }


def open_ledger_db(url: str) -> sa.Engine:
    """An engine over an existing database that holds a ledger table (read only here)."""
    try:
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(ledger_table.name):
                raise UserError(f"database {url!r} holds no ledger")
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise UserError(f"bad database URL {url!r}: {exc}") from exc
    except sa.exc.OperationalError as exc:
        raise UserError(f"cannot open database {url!r}: {exc.orig}") from exc
    return engine


def write_export(engine: sa.Engine, out: str | Path) -> int:
    """Write every entry to ``out`` (JSON Lines, atomically); returns the entry count."""
    return write_entries(read_entries(engine), out)


def write_entries(
    entries: list[dict[str, Any]], out: str | Path, attestation: dict[str, Any] | None = None
) -> int:
    """Write ``entries`` (export form, in sequence order) as an export file, atomically, with
    the orchestrator's ``attestation`` of that head in the header when given."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_bytes(b"".join(line + b"\n" for line in export_lines(entries, attestation)))
        os.replace(tmp, out)
    except OSError:  # a full disk: leave no half-written (or empty) file behind
        tmp.unlink(missing_ok=True)
        raise
    return len(entries)


class LedgerTally:
    """Submission counts per pool (``swarmrl.ledger.counts``) of a live ledger, kept up to date
    by reading only the entries added since the last :meth:`counts` (``chunk`` at a time), so a
    long ledger costs its length once. Safe to call from several threads."""

    def __init__(self, engine: sa.Engine, chunk: int = 2000) -> None:
        self.engine, self.chunk = engine, chunk
        self._pools: dict[str, LedgerCounts] = {}
        self._next = 0  # seq of the first entry not counted yet
        self._lock = threading.Lock()

    def counts(self, pool_id: str) -> SubmissionCounts:
        """The counts of ``pool_id``'s entries so far (``trained`` left None: not a ledger
        fact)."""
        with self._lock:
            while entries := read_entries_from(self.engine, self._next, self.chunk):
                for entry in entries:
                    self._pools.setdefault(entry["pool_id"], LedgerCounts()).add(entry)
                self._next = entries[-1]["seq"] + 1
            found = self._pools.get(pool_id)
            return replace(found.total) if found else SubmissionCounts()
