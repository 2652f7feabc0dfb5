"""What the dashboard shows, gathered from the pool database and the run directory.

Sources, all read-only (the dashboard never writes to the database; heartbeats the orchestrator
buffered show once its flusher wrote them, within ``pool.heartbeat_flush_s``):

- the pool database (``swarmrl.pool``), when the run had a pool: pools, nodes, per-node
  submission counts, node log tails, and the ledger, read a page at a time through its indexes
  (``swarmrl.ledger.export.read_page``) and verified by :class:`LedgerCheck`;
- the run directory, when there is one (``swarmrl run`` layout, ``swarmrl.launch.plan``): step
  rows (``metrics.jsonl``, or the trainer's live ``trainer/steps.jsonl`` while it runs),
  ``report.json``, each role's ``status/<name>.json``, and the weight stores (the trainer's
  origin and each relay's ``shardcast`` store).

What costs the orchestrator is bounded: no read takes the whole ledger; the chain is verified
once (ledger entries never change once chained) in a background thread, in small chunks with
pauses, and afterwards only new entries; files are parsed again only when their size or
modification time changed. A missing or half-written file
is shown as absent, never an error: runs are read while they are being written. Knows nothing
about HTML or HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from copy import deepcopy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from swarmrl.identity.keys import canonical_json
from swarmrl.ledger.counts import LedgerCounts, SubmissionCounts
from swarmrl.ledger.export import head_count, read_entries_from, read_page
from swarmrl.ledger.verify import ChainCheck
from swarmrl.pool.state import db
from swarmrl.pool.trust import service
from swarmrl.pool.trust.service import Context
from swarmrl.protocol.pool import NodeView, PoolInfo, PoolSpec
from swarmrl.protocol.swarm import RoleStatus
from swarmrl.shardcast import store

STEP_FILES = ("metrics.jsonl", "trainer/steps.jsonl")
PAGES_CACHED = 64  # ledger pages kept (each at most 500 entries)


@dataclass
class NodeRow:
    """One node with what the nodes page adds to the pool's view of it."""

    view: NodeView
    # taken in, checked, accepted, rejected, ... (swarmrl.ledger.counts) from the part of the
    # ledger verified so far; trained from the pool's statuses
    counts: SubmissionCounts = field(default_factory=SubmissionCounts)
    ban_reason: str | None = None


@dataclass
class StoreVersions:
    """Ready versions in one weight store (the origin's or a relay's)."""

    name: str
    versions: list[int] = field(default_factory=list)


@dataclass
class LedgerPage:
    """Entries of one ledger page, newest first, and where the next (older) page starts."""

    entries: list[dict[str, Any]]
    total: int  # entries in the whole ledger
    older: int | None  # the ``before`` of the next page; None on the last page


@dataclass(frozen=True)
class ChainStatus:
    """The ledger's verification: ``verified`` (every entry), ``broken`` (``detail`` says
    where), ``checking`` (not every entry checked yet) or ``unchecked`` (``detail``: why)."""

    state: str
    detail: str


class _FileCache:
    """Parsed files, parsed again only when their size or modification time changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[Path, tuple[tuple[int, int], Any]] = {}

    def get(self, path: Path, parse: Any, absent: Any) -> Any:
        try:
            st = path.stat()
        except OSError:
            return absent
        stamp = (st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._seen.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = parse(path)
        with self._lock:
            self._seen[path] = (stamp, value)
        return value


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


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class LedgerCheck:
    """The ledger's hash chain and signatures, verified once and then only as it grows.

    A background thread feeds entries to a :class:`~swarmrl.ledger.verify.ChainCheck` ``chunk``
    at a time, pausing ``pause_s`` between chunks so the orchestrator's own requests keep the
    processor; :meth:`status` starts it when entries are unchecked and says how far it got.
    """

    def __init__(
        self, engine: sa.Engine, orchestrator_key: str, chunk: int = 200, pause_s: float = 0.02
    ) -> None:
        self.engine = engine
        self.chunk, self.pause_s = chunk, pause_s
        self._check = ChainCheck(orchestrator_key)
        self._lock = threading.Lock()
        self._feeding = threading.Lock()  # a feed and a copy of the counts exclude each other
        self._thread: threading.Thread | None = None

    def status(self) -> ChainStatus:
        """How far the chain verifies; starts checking entries not checked yet."""
        total = head_count(self.engine)
        report = self._check.report
        if not report.ok:
            return ChainStatus("broken", f"at {report.first_bad}: {report.reason}")
        if report.entries >= total:
            return ChainStatus("verified", f"{total} entries, hash chain and signatures")
        self._start()
        return ChainStatus("checking", f"{report.entries} of {total} entries verified so far")

    def counts(self) -> LedgerCounts:
        """Submission counts (``swarmrl.ledger.counts``) of the entries verified so far."""
        with self._feeding:
            return deepcopy(self._check.report.counts)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="ledger-check", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        check = self._check
        while check.report.ok:
            entries = read_entries_from(self.engine, check.report.entries, self.chunk)
            if not entries:
                return
            for entry in entries:
                with self._feeding:
                    if not check.feed(canonical_json(entry)):
                        return
            time.sleep(self.pause_s)


@dataclass(frozen=True)
class DataRecipe:
    """What a :class:`RunData` is made of, in a form that can be sent to another process (the
    database URL with its password: it travels over a pipe, never on a command line)."""

    db_url: str | None
    run_dir: Path | None
    orchestrator_key: str | None
    no_pool: str
    no_key: str

    def open(self) -> RunData:
        """A view of its own, on an engine of its own that only reads."""
        engine = None
        if self.db_url is not None:
            sqlite = self.db_url.startswith("sqlite")
            connect = {"timeout": 30} if sqlite else {}
            engine = sa.create_engine(self.db_url, connect_args=connect, pool_pre_ping=not sqlite)
        return RunData(
            engine, self.run_dir, self.orchestrator_key, no_pool=self.no_pool, no_key=self.no_key
        )


class RunData:
    """A read-only view of one orchestrator's database (if the run had a pool) and, if known,
    its run directory.

    ``pool``: the live orchestrator's :class:`~swarmrl.pool.trust.service.Context`, the database
    engine of a finished run, or None when there is no pool (a colocated run); ``no_pool``
    then says why, in one line. ``orchestrator_key`` (hex) is what the ledger is verified
    against; None shows it unchecked, with ``no_key`` as the reason.
    """

    def __init__(
        self,
        pool: Context | sa.Engine | None,
        run_dir: Path | None,
        orchestrator_key: str | None,
        *,
        no_pool: str = "this run has no pool",
        no_key: str = "the orchestrator's public key is unknown here",
    ) -> None:
        self.engine = pool.engine if isinstance(pool, Context) else pool
        self.run_dir = run_dir
        self.orchestrator_key = orchestrator_key
        self.no_pool, self.no_key = no_pool, no_key
        self._files = _FileCache()
        # ledger pages by (before, node prefix, kind, limit): entries older than ``before``
        # never change, so neither does such a page
        self._pages: OrderedDict[tuple[int, str, str, int], list[dict[str, Any]]] = OrderedDict()
        self._pages_lock = threading.Lock()
        self.ledger_check = (
            LedgerCheck(self.engine, orchestrator_key)
            if self.engine is not None and orchestrator_key is not None
            else None
        )

    def recipe(self) -> DataRecipe:
        """How to open this view again in another process (``.pagework``)."""
        url = None
        if self.engine is not None:
            url = self.engine.url.render_as_string(hide_password=False)
        return DataRecipe(url, self.run_dir, self.orchestrator_key, self.no_pool, self.no_key)

    @property
    def has_pool(self) -> bool:
        return self.engine is not None

    # --- the run directory ----------------------------------------------------------------

    def step_rows(self) -> list[dict[str, Any]]:
        """The training loop's rows so far (the longest of the step files)."""
        if self.run_dir is None:
            return []
        found = [self._files.get(self.run_dir / name, _json_lines, []) for name in STEP_FILES]
        return max(found, key=len)

    def report(self) -> dict[str, Any]:
        if self.run_dir is None:
            return {}
        return self._files.get(self.run_dir / "report.json", _json_object, {})

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
        if self.engine is None:
            return []
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(db.pools).order_by(db.pools.c.pool_id)).all()
        return [
            PoolInfo(
                spec=PoolSpec.model_validate_json(r.spec),
                current_version=r.current_version,
                created_at=r.created_at,
            )
            for r in rows
        ]

    def nodes(self, pool_id: str) -> list[NodeRow]:
        """Every node of a pool, with its verdict counts and, if banned, why."""
        if self.engine is None:
            return []
        subs = db.submissions
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(db.nodes)
                .where(db.nodes.c.pool_id == pool_id)
                .order_by(db.nodes.c.joined_at)
            ).all()
            rows = {r.node_id: NodeRow(service.node_view(conn, r)) for r in found}
            counts = conn.execute(
                sa.select(subs.c.node_id, subs.c.status, sa.func.count())
                .where(subs.c.pool_id == pool_id)
                .group_by(subs.c.node_id, subs.c.status)
            ).all()
        verified = self._verified_counts()
        for node_id, row in rows.items():
            row.counts = replace(verified.node(node_id), trained=0)
        for node_id, status, n in counts:
            row = rows.get(node_id)
            if row is not None and status == "trained":
                row.counts.trained = int(n)
        for row in rows.values():  # a hard invalidation's reason, through the ledger's indexes
            if row.view.state != "banned":
                continue
            found = read_page(
                self.engine,
                head_count(self.engine),
                100,
                kind="invalidation",
                pool_id=pool_id,
                node_prefix=row.view.node_id,
            )
            hard = [e for e in found if e["body"].get("severity") == "hard"]
            row.ban_reason = str(hard[-1]["body"].get("reason", "")) if hard else None
        return list(rows.values())

    def node_logs(self, pool_id: str, node_id: str) -> list[str]:
        if self.engine is None:
            return []
        with self.engine.connect() as conn:
            row = service.node_row(conn, pool_id, node_id)
        return list(json.loads(row.log_tail))

    def ledger_page(
        self, *, before: int | None = None, node_prefix: str = "", kind: str = "", limit: int = 50
    ) -> LedgerPage:
        """One page of entries older than ``before`` (the newest when None), newest first,
        filtered by node id prefix and kind."""
        if self.engine is None:
            return LedgerPage([], 0, None)
        total = head_count(self.engine)
        before = total if before is None else min(before, total)
        key = (before, node_prefix, kind, limit)
        with self._pages_lock:
            entries = self._pages.get(key)
            if entries is not None:
                self._pages.move_to_end(key)
        if entries is None:
            entries = read_page(self.engine, before, limit, kind=kind, node_prefix=node_prefix)
            with self._pages_lock:
                self._pages[key] = entries
                while len(self._pages) > PAGES_CACHED:
                    self._pages.popitem(last=False)
        older = entries[-1]["seq"] if len(entries) == limit and entries[-1]["seq"] > 0 else None
        return LedgerPage(entries, total, older)

    def _verified_counts(self) -> LedgerCounts:
        """The submission counts of the ledger entries verified so far (none without a key)."""
        if self.ledger_check is None:
            return LedgerCounts()
        self.ledger_check.status()  # goes on checking entries added since
        return self.ledger_check.counts()

    def verify_ledger(self) -> ChainStatus:
        """The chain's verification so far (checking goes on in the background)."""
        if self.engine is None:
            return ChainStatus("unchecked", self.no_pool)
        if self.ledger_check is None:
            return ChainStatus("unchecked", self.no_key)
        return self.ledger_check.status()
