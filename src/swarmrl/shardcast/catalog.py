"""What a shardcast server holds: versions (ready or still arriving), shard readiness, clients.

Shared between the HTTP handlers (an asyncio loop) and the threads that publish or replicate
versions: every mutation takes one lock, and wakes the loop's waiters (long-polls and
requests for shards still arriving) through ``call_soon_threadsafe``.

Knows nothing about HTTP or how versions are fetched.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.protocol.shardcast import Manifest, VersionInfo, VersionList
from swarmrl.shardcast import store


@dataclass
class ServedVersion:
    manifest: Manifest
    manifest_json: bytes
    directory: Path
    shard_ready: bytearray  # [shard_count] 1 = verified and servable
    delta_ready: bytearray  # [len(deltas)]
    complete: bool


@dataclass
class ClientReport:
    held: int | None
    last_seen: float = field(default_factory=time.time)


class Catalog:
    """Versions served from ``root`` plus the versions still arriving (see module docstring)."""

    def __init__(self, root: str | Path, keep_versions: int, max_clients: int = 1024) -> None:
        self.root = Path(root)
        self.keep = keep_versions
        self.max_clients = max_clients
        self._lock = threading.Lock()
        self._versions: dict[int, ServedVersion] = {}
        # least recently heard first; bounded by max_clients
        self.clients: OrderedDict[str, ClientReport] = OrderedDict()
        self.counters: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.closing = False

    # -- change notification -------------------------------------------------------------
    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._changed = asyncio.Event()

    def _fire(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fire)

    def close(self) -> None:
        """Wake every waiter for good (the server is stopping)."""
        self.closing = True
        self._notify()

    async def wait_change(self, timeout_s: float) -> None:
        """Return at the next change or after ``timeout_s`` seconds, whichever is first."""
        event = self._changed
        if event is None or timeout_s <= 0 or self.closing:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    # -- versions ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up ready versions on disk (published by another process) and forget pruned ones."""
        on_disk = set(store.ready_versions(self.root))
        changed = False
        with self._lock:
            for version in list(self._versions):
                if self._versions[version].complete and version not in on_disk:
                    del self._versions[version]
                    changed = True
        for version in on_disk:
            with self._lock:
                if version in self._versions:
                    continue
            directory = store.ready_dir(self.root, version)
            try:
                manifest = store.load_manifest(directory)
            except (OSError, ValueError):
                continue  # pruned between listing and reading
            self._put(version, manifest, directory, complete=True)  # keyed by what the disk says
            changed = True
        if changed:
            self._notify()

    def _put(self, version: int, manifest: Manifest, directory: Path, complete: bool) -> None:
        fill = 1 if complete else 0
        entry = ServedVersion(
            manifest=manifest,
            manifest_json=manifest.model_dump_json().encode(),
            directory=directory,
            shard_ready=bytearray([fill]) * manifest.shard_count,
            delta_ready=bytearray([fill]) * len(manifest.deltas),
            complete=complete,
        )
        with self._lock:
            self._versions[version] = entry

    def add_in_progress(self, manifest: Manifest, partial: Path) -> None:
        self._put(manifest.version, manifest, partial, complete=False)
        self._notify()

    def mark_shard(self, version: int, index: int) -> None:
        with self._lock:
            entry = self._versions.get(version)
            if entry is not None:
                entry.shard_ready[index] = 1
        self._notify()

    def mark_delta(self, version: int, index: int) -> None:
        with self._lock:
            entry = self._versions.get(version)
            if entry is not None:
                entry.delta_ready[index] = 1
        self._notify()

    def mark_complete(self, version: int, directory: Path) -> None:
        with self._lock:
            entry = self._versions[version]
            entry.directory = directory
            entry.complete = True
            entry.shard_ready[:] = b"\x01" * len(entry.shard_ready)
            entry.delta_ready[:] = b"\x01" * len(entry.delta_ready)
        self._notify()

    def drop(self, version: int) -> None:
        with self._lock:
            self._versions.pop(version, None)
        self._notify()

    def prune(self) -> list[int]:
        """Delete ready versions beyond ``keep`` on disk, then forget them."""
        doomed = store.prune(self.root, self.keep)
        for version in doomed:
            self.drop(version)
        return doomed

    def get(self, version: int) -> ServedVersion | None:
        with self._lock:
            return self._versions.get(version)

    def oldest(self) -> int | None:
        """The oldest version held (a request for anything older asks for a pruned one)."""
        with self._lock:
            return min(self._versions) if self._versions else None

    def latest(self, complete_only: bool = False) -> int | None:
        with self._lock:
            found = [v for v, e in self._versions.items() if e.complete or not complete_only]
        return max(found) if found else None

    def version_list(self) -> VersionList:
        with self._lock:
            infos = [
                VersionInfo(
                    version=v,
                    step=e.manifest.step,
                    complete=e.complete,
                    total_bytes=e.manifest.total_bytes,
                )
                for v, e in sorted(self._versions.items())
            ]
        return VersionList(latest=infos[-1].version if infos else None, versions=infos)

    # -- clients and counters --------------------------------------------------------------
    def report_client(self, client_id: str, held: int | None) -> None:
        """Remember what ``client_id`` holds; past ``max_clients`` the longest silent goes."""
        with self._lock:
            self.clients.pop(client_id, None)
            self.clients[client_id] = ClientReport(held)
            while len(self.clients) > self.max_clients:
                self.clients.popitem(last=False)

    def clients_behind(self) -> int:
        latest = self.latest()
        with self._lock:
            return sum(
                1
                for c in self.clients.values()
                if latest is not None and (c.held is None or c.held < latest)
            )

    def count(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0.0) + amount
