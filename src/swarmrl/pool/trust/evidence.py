"""Per-node evidence kept by the pool: every validator's measurements of a node's accepted units
add to one record per node in the database (``db.node_evidence``), so two validators, or a
validator or orchestrator restarted, see the same record.

The arithmetic (a one-sided CUSUM per measure, ``PoolSpec.evidence_drift`` and
``evidence_limit``) is ``swarmrl.ledger.evidence``'s, the one ``ledger verify`` re-derives the
records with from the verdict entries. Runs inside the caller's transaction, which holds the
node's row locked (``swarmrl.pool.flow.judging``), so two verdicts on one node add in the order
their ledger entries have. Knows nothing about HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping

import sqlalchemy as sa

from swarmrl.ledger.evidence import Cusum, add_unit
from swarmrl.pool.state import db
from swarmrl.protocol.pool import PoolSpec


def record(conn: sa.Connection, pool_id: str, node_id: str) -> dict[str, Cusum]:
    """The node's record: measure → its CUSUM (empty for a node without measured units)."""
    t = db.node_evidence
    rows = conn.execute(
        sa.select(t.c.measure, t.c.value, t.c.units, t.c.total).where(
            t.c.pool_id == pool_id, t.c.node_id == node_id
        )
    ).all()
    return {r.measure: Cusum(float(r.value), int(r.units), float(r.total)) for r in rows}


def add(
    conn: sa.Connection, spec: PoolSpec, node_id: str, measures: Mapping[str, float]
) -> str | None:
    """Add one accepted unit's ``measures`` to the node's record; the reason the unit is
    rejected for (the record passed its limit with it), or None."""
    t = db.node_evidence
    grown = record(conn, spec.pool_id, node_id)
    before = set(grown)
    flagged = add_unit(
        grown, measures, spec.evidence_drift, spec.evidence_limit, spec.evidence_measure_limits
    )
    for measure in measures:
        cusum = grown[measure]
        values = dict(value=cusum.value, units=cusum.units, total=cusum.total)
        if measure in before:
            conn.execute(
                t.update()
                .where(t.c.pool_id == spec.pool_id, t.c.node_id == node_id, t.c.measure == measure)
                .values(**values)
            )
        else:
            conn.execute(
                t.insert(), dict(pool_id=spec.pool_id, node_id=node_id, measure=measure, **values)
            )
    return flagged
