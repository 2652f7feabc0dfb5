"""What every re-derivation from a ledger alone shares: entries fed in sequence order, a pool's
parameters read from its ``pool_created`` entry, and a signed but malformed body reported as a
contradiction rather than raised.

A replay (``swarmrl.ledger.spotchecks``, ``swarmrl.ledger.evidence``) keeps one record per pool,
built from the pool's spec when its ``pool_created`` entry comes, and reads every other entry
against it. Knows nothing about what a replay recomputes, nor about databases or HTTP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from swarmrl.protocol.pool import PoolSpec

PoolRecord = TypeVar("PoolRecord")


def spec_value(spec: dict[str, Any], name: str) -> Any:
    """The ``PoolSpec`` field ``name`` as a ``pool_created`` entry's spec records it; the field's
    default where the entry was written before the field existed."""
    return spec.get(name, PoolSpec.model_fields[name].get_default(call_default_factory=True))


@dataclass
class LedgerReplay(ABC, Generic[PoolRecord]):
    """Folds ledger entries fed in sequence order into one record per pool.

    ``feed`` returns "" or why the entry contradicts the record; an entry whose fields are not
    what the replay reads says so in the same way (``subject`` names the replay in that line).
    """

    subject: ClassVar[str]
    pools: dict[str | None, PoolRecord] = field(default_factory=dict)

    def feed(self, entry: dict[str, Any]) -> str:
        try:
            return self._feed(entry)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a signed odd body
            return f"{self.subject} fields of a {entry.get('kind')!r} entry are malformed ({exc!r})"

    def _feed(self, entry: dict[str, Any]) -> str:
        kind, body, pool_id = entry["kind"], entry["body"], entry["pool_id"]
        if not isinstance(body, dict):
            return ""
        if kind == "pool_created":
            self.pools[pool_id] = self._pool(body.get("spec", {}))
            return ""
        return self._entry(entry, kind, body, pool_id)

    @abstractmethod
    def _pool(self, spec: dict[str, Any]) -> PoolRecord:
        """A new pool's record, from the spec of its ``pool_created`` entry."""

    @abstractmethod
    def _entry(self, entry: dict[str, Any], kind: str, body: dict[str, Any], pool_id: Any) -> str:
        """Read any other entry (``body`` is a dict); "" or why it contradicts the record."""
