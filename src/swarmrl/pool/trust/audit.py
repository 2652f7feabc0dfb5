"""The start-up audit: the pool database must agree with its own ledger before it is served.

The ledger is hash-chained and signed (``swarmrl.ledger``), but the tables the orchestrator
works from (pools, nodes, submissions, credits) are plain rows anyone with database access can
edit, and the ledger's own tail can be cut. So before serving, the orchestrator re-verifies the
whole chain against its key and re-derives from the ledger what those tables must say:

- every pool was created in the ledger, and every submission row has its ledger entry (and the
  reverse): a cut tail or an emptied ledger leaves rows without entries;
- a node's accepted / soft / hard counters equal its verdicts and invalidations in the ledger,
  and it is banned exactly when the ledger holds a hard invalidation of it;
- a submission the ledger says was rejected is ``rejected`` and one it says was accepted is not;
  an accepted unit the ledger shows no verdict for was credited by the orchestrator;
- every credit row has its ``credit`` entry with the same tokens, and is dropped exactly when a
  ``slash`` entry names it;
- a submission's status agrees with its recorded spot-check decision, and unchecked work is
  trainable only after a ``release`` entry names it (one it sends to a check counts as
  checked; the decisions themselves are re-derived
  by the chain verification, ``swarmrl.ledger.spotchecks``);
- each node's evidence record (``node_evidence``) is the one its verdicts' measurements give
  (``swarmrl.ledger.evidence``), number for number: a record reset or deleted would let a node
  start over.

Any disagreement is a :class:`LedgerMismatch` naming the first few, and the orchestrator does not
start. :func:`check_node_signature` re-checks, from what is stored, that a node really signed a
submission (the request body is kept in the rollout store). Knows nothing about HTTP; reads,
never writes.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from swarmrl.errors import CorruptData, LedgerMismatch
from swarmrl.identity.keys import digest_hex, verify_signature
from swarmrl.identity.requests import request_message
from swarmrl.ledger.evidence import EvidenceReplay
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.verify import export_lines, verify_lines
from swarmrl.pool.state import db
from swarmrl.pool.state.store import RolloutStore

SHOWN = 3  # disagreements named in the error


@dataclass
class LedgerFacts:
    """What the ledger says the tables must hold."""

    pools: set[str] = field(default_factory=set)
    submissions: set[str] = field(default_factory=set)
    verdicts: dict[str, bool] = field(default_factory=dict)  # submission id → accepted
    credits: dict[str, int] = field(default_factory=dict)  # submission id → tokens
    slashed: set[str] = field(default_factory=set)  # submission ids whose credit was dropped
    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (pool, node, what)
    checked: dict[str, bool] = field(default_factory=dict)  # submission id → spot-checked
    released: set[str] = field(default_factory=set)  # unchecked, made trainable by a check
    validated_pools: set[str] = field(default_factory=set)  # pools with validators
    evidence: EvidenceReplay = field(default_factory=EvidenceReplay)  # the per-node records

    def add(self, entry: dict[str, Any]) -> None:
        kind, body, pool = entry["kind"], entry["body"], entry["pool_id"]
        self.evidence.feed(entry)
        who = (pool, entry["node_id"])
        if kind == "pool_created":
            self.pools.add(pool)
            if body["spec"].get("validators"):
                self.validated_pools.add(pool)
        elif kind == "submission":
            self.submissions.add(body["submission_id"])
            if "check" in body:
                self.checked[body["submission_id"]] = bool(body["check"]["checked"])
        elif kind == "release":
            self.released.update(body["submission_ids"])
            for sid in body.get("replay", []):  # sent to a check at release instead
                self.checked[sid] = True
        elif kind == "verdict":
            self.verdicts[body["submission_id"]] = bool(body["accept"])
            self.counts[(*who, "accepted")] += bool(body["accept"])
        elif kind == "credit":
            self.credits[body["submission_id"]] = int(body["tokens"])
        elif kind == "slash":
            self.slashed.update(body["submission_ids"])
        elif kind == "invalidation":
            self.counts[(*who, "hard" if body["severity"] == "hard" else "soft")] += 1
            for sid in body.get("recheck", []):  # matched copies of its units, sent to a check
                self.checked[sid] = True


def ledger_facts(engine: sa.Engine, orchestrator_key: str) -> LedgerFacts:
    """Verify the chain and fold it into :class:`LedgerFacts`; a broken chain raises."""
    entries = read_entries(engine)
    report = verify_lines(export_lines(entries), orchestrator_key)
    if not report.ok:
        raise LedgerMismatch(
            f"the ledger in the pool database does not verify ({report.first_bad}: "
            f"{report.reason}); refusing to start on it"
        )
    facts = LedgerFacts()
    for entry in entries:
        facts.add(entry)
    return facts


def _disagreements(conn: sa.Connection, facts: LedgerFacts) -> list[str]:
    out: list[str] = []
    pools = set(conn.execute(sa.select(db.pools.c.pool_id)).scalars())
    if pools != facts.pools:
        out.append(f"pools {sorted(pools ^ facts.pools)[:SHOWN]} differ from the ledger's")
    for n in conn.execute(sa.select(db.nodes)).all():
        for what in ("accepted", "soft", "hard"):
            want = facts.counts[(n.pool_id, n.node_id, what)]
            if getattr(n, what) != want:
                out.append(f"node {n.node_id}: {what} = {getattr(n, what)}, ledger says {want}")
        banned = facts.counts[(n.pool_id, n.node_id, "hard")] > 0
        if (n.state == "banned") != banned:
            out.append(f"node {n.node_id} is {n.state}; the ledger says banned = {banned}")
    subs = conn.execute(
        sa.select(db.submissions.c.submission_id, db.submissions.c.pool_id, db.submissions.c.status)
    ).all()
    rows = {s.submission_id for s in subs}
    for sid in sorted(rows ^ facts.submissions)[:SHOWN]:
        where = "ledger" if sid in rows else "submissions table"
        out.append(f"submission {sid} is missing from the {where}")
    for s in subs:
        verdict = facts.verdicts.get(s.submission_id)
        if verdict is False and s.status != "rejected":
            out.append(f"submission {s.submission_id} is {s.status}; the ledger says rejected")
        elif verdict is not False and s.status == "rejected":
            out.append(f"submission {s.submission_id} is rejected without a ledger verdict")
        elif verdict is None and s.status in ("accepted", "leased", "trained"):
            if s.submission_id not in facts.credits:
                out.append(f"submission {s.submission_id} is {s.status} without a verdict")
    out += _spot_check_disagreements(subs, facts)
    out += _evidence_disagreements(conn, facts)
    for c in conn.execute(sa.select(db.credits)).all():
        tokens = facts.credits.get(c.submission_id)
        if tokens != c.tokens:
            out.append(f"credit of {c.submission_id}: {c.tokens} tokens, ledger says {tokens}")
        if c.dropped != (c.submission_id in facts.slashed):
            out.append(f"credit of {c.submission_id}: dropped = {c.dropped} disagrees with ledger")
    return out


def _spot_check_disagreements(subs: list[Any], facts: LedgerFacts) -> list[str]:
    """A submission's status must agree with the spot-check decision its ledger entry records:
    unchecked work is trainable only once a ``release`` entry names it
    (``swarmrl.pool.flow.spotcheck``)."""
    out = []
    for s in subs:
        checked = facts.checked.get(s.submission_id)
        if checked is None:
            continue
        if s.status == "unchecked" and checked:
            out.append(f"submission {s.submission_id} is unchecked; the ledger says checked")
        if checked or s.pool_id not in facts.validated_pools:
            continue
        if s.status in ("pending", "disputed"):
            out.append(f"submission {s.submission_id} is {s.status}; the ledger says unchecked")
        trainable = s.status in ("accepted", "leased", "trained")
        if trainable and s.submission_id not in facts.released:
            out.append(f"submission {s.submission_id} is {s.status} but was never released")
    return out


def _evidence_disagreements(conn: sa.Connection, facts: LedgerFacts) -> list[str]:
    """Each node's evidence rows must be the records the ledger's measurements give."""
    want = {
        (pool_id, node, measure): (c.value, c.units, c.total)
        for pool_id, pool in facts.evidence.pools.items()
        for node, record in pool.records.items()
        for measure, c in record.items()
    }
    t = db.node_evidence
    have = {
        (r.pool_id, r.node_id, r.measure): (float(r.value), int(r.units), float(r.total))
        for r in conn.execute(sa.select(t)).all()
    }
    return [
        f"evidence {m} of node {node}: (S, units, sum) = {have.get((pool_id, node, m))}, "
        f"the ledger's measurements give {want.get((pool_id, node, m))}"
        for pool_id, node, m in sorted(set(want) | set(have), key=str)
        if want.get((pool_id, node, m)) != have.get((pool_id, node, m))
    ]


def audit(engine: sa.Engine, orchestrator_key: str) -> None:
    """Raise :class:`LedgerMismatch` unless the tables agree with a verifying ledger."""
    facts = ledger_facts(engine, orchestrator_key)
    with engine.connect() as conn:
        problems = _disagreements(conn, facts)
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise LedgerMismatch(
            "the pool database disagrees with its ledger: "
            + "; ".join(problems[:SHOWN])
            + more
            + "; refusing to start on it"
        )


def check_node_signature(store: RolloutStore, pool_id: str, submission: Any) -> None:
    """Re-check a node's signature over a stored submission (a row of ``submissions``, or a
    ledger ``submission`` entry's body with ``submission_id``); raises
    :class:`~swarmrl.errors.BadSignature` or :class:`~swarmrl.errors.CorruptData`."""
    auth = submission if isinstance(submission, dict) else json.loads(submission.auth)
    sid = submission["submission_id"] if isinstance(submission, dict) else submission.submission_id
    body = store.get_request(f"{pool_id}/{sid}.parquet")
    if digest_hex(body) != auth["body_digest"]:
        raise CorruptData(f"the stored request of submission {sid} is not the one signed")
    message = request_message(
        "POST",
        f"/pools/{pool_id}/submissions",
        auth["body_digest"],
        auth["timestamp_ms"],
        auth["nonce"],
    )
    verify_signature(auth["node_key"], message, auth["signature"])
