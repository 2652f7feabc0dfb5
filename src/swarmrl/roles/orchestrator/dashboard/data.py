"""What the dashboard shows, gathered from the pool database and the run directory.

Sources, all read-only:

- the pool database (``swarmrl.pool``): pools, nodes, per-node submission counts, node log tails,
  the ledger and its chain verification (``swarmrl.ledger.verify``);
- the run directory, when there is one (``swarmrl run`` layout, ``swarmrl.launch.swarm``): step
  rows (``metrics.jsonl``, or the trainer's live ``trainer/steps.jsonl`` while it runs),
  ``report.json``, each role's ``status/<name>.json``, and the weight stores (the trainer's
  origin and each relay's ``shardcast`` store).

A missing or half-written file is shown as absent, never an error: runs are read while they
are being written. Knows nothing about HTML.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from swarmrl.ledger.export import read_entries
from swarmrl.ledger.verify import export_lines, verify_lines
from swarmrl.pool.state import db
from swarmrl.pool.trust import service
from swarmrl.pool.trust.service import Context
from swarmrl.protocol.pool import NodeView, PoolInfo
from swarmrl.protocol.swarm import RoleStatus
from swarmrl.shardcast import store

STEP_FILES = ("metrics.jsonl", "trainer/steps.jsonl")


@dataclass
class NodeRow:
    """One node with what the nodes page adds to the pool's view of it."""

    view: NodeView
    accepted: int = 0
    rejected: int = 0
    ban_reason: str | None = None


@dataclass
class StoreVersions:
    """Ready versions in one weight store (the origin's or a relay's)."""

    name: str
    versions: list[int] = field(default_factory=list)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line being written is left out)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class RunData:
    """A read-only view of one orchestrator's database and, if known, its run directory."""

    def __init__(self, ctx: Context, run_dir: Path | None, orchestrator_key: str | None) -> None:
        self.ctx = ctx
        self.run_dir = run_dir
        self.orchestrator_key = orchestrator_key

    # --- the run directory ----------------------------------------------------------------

    def step_rows(self) -> list[dict[str, Any]]:
        """The training loop's rows so far (the longest of the step files)."""
        if self.run_dir is None:
            return []
        found = [_json_lines(self.run_dir / name) for name in STEP_FILES]
        return max(found, key=len)

    def report(self) -> dict[str, Any]:
        if self.run_dir is None:
            return {}
        try:
            report = json.loads((self.run_dir / "report.json").read_text())
        except (OSError, ValueError):
            return {}
        return report if isinstance(report, dict) else {}

    def statuses(self) -> list[RoleStatus]:
        """Each role's latest status report, by name."""
        if self.run_dir is None or not (self.run_dir / "status").is_dir():
            return []
        out = []
        for path in sorted((self.run_dir / "status").glob("*.json")):
            try:
                out.append(RoleStatus.model_validate_json(path.read_bytes()))
            except (OSError, ValueError):
                continue
        return out

    def weight_stores(self) -> list[StoreVersions]:
        """The origin's and every relay's ready versions."""
        if self.run_dir is None:
            return []
        stores = [
            StoreVersions("origin", store.ready_versions(self.run_dir / "trainer" / "origin"))
        ]
        for relay in sorted(self.run_dir.glob("relay-*")):
            stores.append(StoreVersions(relay.name, store.ready_versions(relay)))
        return stores

    # --- the pool database ----------------------------------------------------------------

    def pools(self) -> list[PoolInfo]:
        return service.list_pools(self.ctx)

    def nodes(self, pool_id: str) -> list[NodeRow]:
        """Every node of a pool, with its verdict counts and, if banned, why."""
        rows = {v.node_id: NodeRow(v) for v in service.list_nodes(self.ctx, pool_id)}
        subs = db.submissions
        with self.ctx.engine.connect() as conn:
            counts = conn.execute(
                sa.select(subs.c.node_id, subs.c.status, sa.func.count())
                .where(subs.c.pool_id == pool_id)
                .group_by(subs.c.node_id, subs.c.status)
            ).all()
        for node_id, status, n in counts:
            row = rows.get(node_id)
            if row is None:
                continue
            if status == "rejected":
                row.rejected += int(n)
            elif status in ("accepted", "leased", "trained"):
                row.accepted += int(n)
        for entry in self.ledger(pool_id=pool_id, kind="invalidation"):
            row = rows.get(entry["node_id"] or "")
            body = entry["body"]
            if row is not None and row.view.state == "banned" and body.get("severity") == "hard":
                row.ban_reason = row.ban_reason or str(body.get("reason", ""))
        return list(rows.values())

    def node_logs(self, pool_id: str, node_id: str) -> list[str]:
        return service.node_logs(self.ctx, pool_id, node_id).lines

    def ledger(
        self, *, pool_id: str | None = None, node_id: str = "", kind: str = ""
    ) -> list[dict[str, Any]]:
        """Ledger entries in sequence order, filtered by pool, node id prefix and kind."""
        return [
            e
            for e in read_entries(self.ctx.engine)
            if (pool_id is None or e["pool_id"] == pool_id)
            and (not node_id or (e["node_id"] or "").startswith(node_id))
            and (not kind or e["kind"] == kind)
        ]

    def verify_ledger(self) -> tuple[bool | None, str]:
        """(True, detail) when the chain verifies, (False, what broke), (None, why not checked)."""
        if self.orchestrator_key is None:
            return None, "not checked: the orchestrator's public key is unknown here"
        entries = read_entries(self.ctx.engine)
        report = verify_lines(export_lines(entries), self.orchestrator_key)
        if report.ok:
            return True, f"{len(entries)} entries, hash chain and signatures verified"
        return False, f"broken at {report.first_bad}: {report.reason}"
