"""The names of a run's submission counts, defined once, and how each is counted from the ledger.

Every place that shows a run's submissions (the console, ``report.json`` and ``report.png``,
the dashboard, ``swarmrl ledger verify``, Prometheus) uses these words with these meanings:

- **taken in**: submissions the pool stored (one ``submission`` ledger entry each), whatever
  happened to them afterwards.
- **checked**: taken in and replayed by a validator to a verdict of its own (a ``verdict``
  entry that is not soft). Work not drawn for a check is taken in but never checked.
- **accepted**: made trainable: checked and passed, or stored unchecked and then released by a
  later passed spot check of the same node (``release`` entries). Accepted work can still be
  invalidated later, when its node is banned before the trainer used it.
- **rejected**: checked and failed (a hard verdict: the validator judged it dishonest).
- **expired**: given up without blame before anyone replayed it (a soft verdict, e.g. its
  version was pruned first); neither checked nor accepted.
- **invalidated**: struck out after being taken in, as a penalty: the untrained work of a
  banned node and a unit a soft invalidation named (``invalidation`` entries).
- **trained**: acknowledged by the trainer as used for a step. The ledger does not record it;
  it is the pool's ``trained`` status (``None`` here when only the ledger is at hand).

A submission can be counted in several: taken in ⊇ checked = accepted-by-a-check + rejected.

Knows the ledger's entry kinds and bodies only; nothing about the pool's database, HTTP or how
counts are drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = ("taken_in", "checked", "accepted", "rejected", "expired", "invalidated", "trained")


@dataclass
class SubmissionCounts:
    """One set of counts (module docstring), for a run or a node; ``trained`` is None when
    it is not known (the ledger alone does not say)."""

    taken_in: int = 0
    checked: int = 0
    accepted: int = 0
    rejected: int = 0
    expired: int = 0
    invalidated: int = 0
    trained: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)

    def text(self) -> str:
        """``12 taken in, 5 checked, 9 accepted, 1 rejected, 0 expired, 3 invalidated[, 8
        trained]``: the words in the same order everywhere."""
        parts = [f"{getattr(self, w)} {w.replace('_', ' ')}" for w in WORDS if w != "trained"]
        if self.trained is not None:
            parts.append(f"{self.trained} trained")
        return ", ".join(parts)


@dataclass
class LedgerCounts:
    """The counts for the whole ledger and per node id, built one entry at a time
    (:meth:`add`, in ledger order)."""

    total: SubmissionCounts = field(default_factory=SubmissionCounts)
    by_node: dict[str, SubmissionCounts] = field(default_factory=dict)
    # submission ids already counted as invalidated (a soft one may name an id twice)
    _invalidated: set[str] = field(default_factory=set, repr=False)

    def node(self, node_id: str) -> SubmissionCounts:
        return self.by_node.get(node_id) or SubmissionCounts()

    def add(self, entry: dict[str, Any]) -> None:
        """Count one entry (a dict with ``kind``, ``node_id`` and ``body``); kinds other than
        submission, verdict, release and invalidation are ignored."""
        kind, body, node = entry["kind"], entry["body"], entry.get("node_id")
        if node is None or kind not in ("submission", "verdict", "release", "invalidation"):
            return
        adds: dict[str, int] = {}
        if kind == "submission":
            adds["taken_in"] = 1
        elif kind == "verdict":
            if body.get("accept"):
                adds = {"checked": 1, "accepted": 1}
            elif body.get("severity") == "soft":
                adds["expired"] = 1
            else:
                adds = {"checked": 1, "rejected": 1}
        elif kind == "release":
            adds["accepted"] = len(body.get("submission_ids", []))
        else:
            ids = set(body.get("dropped_submissions") or [])
            if body.get("severity") != "hard" and body.get("submission_id"):
                ids.add(body["submission_id"])
            adds["invalidated"] = len(ids - self._invalidated)
            self._invalidated |= ids
        mine = self.by_node.setdefault(node, SubmissionCounts())
        for word, n in adds.items():
            for counts in (mine, self.total):
                setattr(counts, word, getattr(counts, word) + n)


def count_ledger(entries: Iterable[dict[str, Any]]) -> LedgerCounts:
    """:class:`LedgerCounts` of these ledger entries, in order."""
    out = LedgerCounts()
    for entry in entries:
        out.add(entry)
    return out
