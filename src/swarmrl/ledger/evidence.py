"""Per-node evidence arithmetic (a one-sided CUSUM per measure), and its re-derivation from a
ledger alone.

Each accepted unit's measurements ``x`` (``Verdict.evidence``: normalised by the threshold each
is judged against, 1 = at the threshold; measured by ``swarmrl.toploc.evidence``) are added to
its node's record, per measure::

    S_0 = 0,   S_n = max(0, S_{n-1} + x_n − k),   flagged when S_n > h

with ``k = PoolSpec.evidence_drift`` and ``h = PoolSpec.evidence_limit`` (0: records kept,
nobody flagged), or the measure's own ``PoolSpec.evidence_measure_limits``. The pool keeps the
records in its database (``swarmrl.pool.trust.evidence``), so every validator's units count
toward one record per node and a restart loses none; the unit that flags a node is recorded as
a hard rejection whose reason gives the evidence.

:class:`EvidenceReplay` folds ledger entries in order and recomputes every record from the
``verdict`` entries that carry measurements (the same operations in the same order, so the
same floats): a verdict that accepts a unit the record flags, or rejects one for evidence the
record does not give, or a flagged node the ledger never bans, is reported. ``k`` and ``h`` come
from the pool's ``pool_created`` entry (``swarmrl.ledger.replay``). Knows nothing about
databases or HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarmrl.ledger.replay import LedgerReplay, spec_value
from swarmrl.protocol.pool import EVIDENCE_CAP

EVIDENCE_PREFIX = "evidence: "  # the reason of a rejection for evidence starts so


@dataclass
class Cusum:
    """One measure's running record of a node: S, the units added and their sum of x."""

    value: float = 0.0
    units: int = 0
    total: float = 0.0

    def add(self, x: float, drift: float) -> float:
        self.value = max(0.0, self.value + x - drift)
        self.units += 1
        self.total += x
        return self.value


def add_unit(
    record: dict[str, Cusum],
    measures: Mapping[str, float],
    drift: float,
    limit: float,
    limits: Mapping[str, float] | None = None,
) -> str | None:
    """Add one accepted unit's ``measures`` to a node's ``record`` (measure → its CUSUM, grown
    in place); the reason the node is flagged (one line), or None. ``limits``: a measure's own
    limit in place of ``limit`` (``PoolSpec.evidence_measure_limits``)."""
    flagged = None
    for name, x in measures.items():
        cusum = record.setdefault(name, Cusum())
        value = cusum.add(min(EVIDENCE_CAP, max(0.0, x)), drift)
        h = (limits or {}).get(name, limit)
        if h > 0 and value > h and flagged is None:
            flagged = (
                f"{EVIDENCE_PREFIX}{name} consistently off over {cusum.units} accepted units "
                f"(mean x {cusum.total / cusum.units:.2f}; CUSUM "
                f"{value:.2f} > {h:g} at drift {drift:g})"
            )
    return flagged


@dataclass
class _Pool:
    drift: float
    limit: float
    limits: dict[str, float]  # a measure's own limit
    records: dict[str, dict[str, Cusum]] = field(default_factory=dict)  # node → measure → S
    flagged: dict[str, str] = field(default_factory=dict)  # node → submission that flagged it


@dataclass
class EvidenceReplay(LedgerReplay[_Pool]):
    """Recomputes the per-node evidence from ledger entries fed in sequence order.

    ``feed`` returns "" or why the entry contradicts the record (module docstring); ``finish``
    checks that every node the record flags is banned (``banned``: node ids the ledger bans).
    """

    subject: ClassVar[str] = "evidence"
    verdicts: int = 0  # verdicts whose measurements were added

    def _pool(self, spec: dict[str, Any]) -> _Pool:
        limits = spec_value(spec, "evidence_measure_limits")
        return _Pool(
            float(spec_value(spec, "evidence_drift")),
            float(spec_value(spec, "evidence_limit")),
            {str(k): float(v) for k, v in dict(limits).items()},
        )

    def _entry(self, entry: dict[str, Any], kind: str, body: dict[str, Any], pool_id: Any) -> str:
        pool = self.pools.get(pool_id)
        measures = body.get("evidence")
        if kind != "verdict" or pool is None or measures is None:
            return ""
        node, sid = str(entry["node_id"]), str(body.get("submission_id"))
        values = {str(k): float(v) for k, v in dict(measures).items()}
        record = pool.records.setdefault(node, {})
        flagged = add_unit(record, values, pool.drift, pool.limit, pool.limits)
        self.verdicts += 1
        if flagged is not None:
            pool.flagged.setdefault(node, sid)
        if body.get("accept") and flagged is not None:
            return (
                f"verdict accepts submission {sid} of node {node}, but the ledger's record of "
                f"the node says {flagged}"
            )
        if not body.get("accept") and flagged is None:
            return (
                f"verdict rejects submission {sid} of node {node} for evidence, but the ledger's "
                "record of the node does not pass the limit"
            )
        return ""

    def finish(self, banned: set[str]) -> str:
        """Why the record disagrees with the bans (a flagged node never banned), or ""."""
        for pool in self.pools.values():
            for node, sid in pool.flagged.items():
                if node not in banned:
                    return (
                        f"node {node}: the ledger's evidence flags it at submission {sid}, but "
                        "it is not banned"
                    )
        return ""

    def nodes_flagged(self) -> int:
        return sum(len(p.flagged) for p in self.pools.values())
