"""A relay: follow upstreams (origin or relays) and re-serve what they publish, verified.

One watcher thread per upstream holds a long-poll (``/versions/wait``) open, so a new version
is known the moment its upstream knows it. A replication thread then fetches the newest
announced version from all upstreams at once (weighted, resumable, every shard checked against
the signed manifest, delta from the parent when held) into a partial directory that the
catalog already serves shard by shard as they are verified; once complete it is renamed ready
and versions beyond ``keep_versions`` are pruned.

Knows nothing about HTTP routing (see ``server``) or about clients.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import InfraError, PeerError
from swarmrl.shardcast import store
from swarmrl.shardcast.assemble import FileWriter
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.client import (
    CLIENT_HEADER,
    HELD_HEADER,
    MANIFEST_LIMIT,
    fetch_manifest,
    install_version,
    parse_version_list,
)
from swarmrl.shardcast.transport import Connections, SourcePool

log = logging.getLogger(__name__)


class Follower:
    """Keeps ``catalog`` in step with the upstreams (see module docstring)."""

    def __init__(
        self,
        upstreams: Sequence[str],
        trusted_publishers: Sequence[str],
        catalog: Catalog,
        config: ShardcastConfig | None = None,
        *,
        writer: FileWriter | None = None,
    ) -> None:
        self.config = config or ShardcastConfig()
        self.catalog = catalog
        self.trusted = [k.lower() for k in trusted_publishers]
        self.pool = SourcePool(list(upstreams))
        self.node_id = f"relay-{uuid.uuid4().hex[:8]}"
        self.conns = Connections(self.config.request_timeout_s, {CLIENT_HEADER: self.node_id})
        self.writer = writer or FileWriter()
        self.errors: list[str] = []
        self._reported = 0
        self._announced = -1
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_conns = Connections(
            self.config.request_timeout_s, {CLIENT_HEADER: self.node_id}
        )

    def start(self) -> None:
        for name in store.discard_stale_partials(self.catalog.root):
            log.info("removed leftover %s", name)
        self.catalog.refresh()
        for url in self.pool.urls:
            self._threads.append(
                threading.Thread(target=self._watch, args=(url,), daemon=True, name=f"watch {url}")
            )
        self._threads.append(
            threading.Thread(target=self._replicate_loop, daemon=True, name="replicate")
        )
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._watch_conns.abort()
        self.conns.abort()
        for thread in self._threads:
            thread.join(timeout_s)

    def _held(self) -> int | None:
        return self.catalog.latest(complete_only=True)

    def _watch(self, url: str) -> None:
        conns = self._watch_conns
        backoff = 0.2
        hold = self.config.long_poll_timeout_s
        while not self._stop.is_set():
            held = self._held()
            headers = {} if held is None else {HELD_HEADER: str(held)}
            try:
                resp = conns.get(
                    url,
                    f"/versions/wait?after={self._announced}&timeout={hold}",
                    headers,
                    timeout_s=hold + 10,
                )
                body = resp.read(MANIFEST_LIMIT)
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                latest = parse_version_list(body).latest
                backoff = 0.2
            except (OSError, http.client.HTTPException, PeerError) as exc:
                conns.close_all()
                log.debug("upstream %s: %s (retrying in %.1fs)", url, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if latest is not None:
                with self._cv:
                    if latest > self._announced:
                        self._announced = latest
                        self._cv.notify_all()
        conns.close_all()

    def _held_or_none(self) -> int:
        """Newest version in the catalog, -1 when empty (version 0 is a real version)."""
        latest = self.catalog.latest()
        return -1 if latest is None else latest

    def _replicate_loop(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(
                    lambda: self._stop.is_set() or self._announced > self._held_or_none(),
                    timeout=1.0,
                )
                target = self._announced
            if self._stop.is_set() or target <= self._held_or_none():
                continue
            try:
                self.replicate(target)
                backoff = 1.0
            except (PeerError, InfraError, OSError) as exc:  # report, keep following
                self.errors.append(f"v{target}: {type(exc).__name__}: {exc}")
                log.warning("relay could not replicate v%d: %s", target, exc)
                self.catalog.count("replication_failures_total")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def replicate(self, version: int) -> None:
        """Fetch ``version`` from the upstreams into the catalog's store, serving it as it arrives."""
        held = self._held()
        manifest = fetch_manifest(
            self.pool,
            self.conns,
            version,
            self.trusted,
            held=held,
            allow_rollback=False,
            timeout_s=self.config.request_timeout_s,
        )
        catalog = self.catalog

        def on_partial(partial: Path) -> None:
            catalog.add_in_progress(manifest, partial)

        try:
            path, report = install_version(
                manifest,
                catalog.root,
                self.pool,
                self.conns,
                self.writer,
                self.config,
                time.monotonic() + self.config.fetch_timeout_s,
                on_partial=on_partial,
                on_shard=lambda i: catalog.mark_shard(version, i),
                on_delta=lambda i: catalog.mark_delta(version, i),
            )
        except BaseException:
            catalog.drop(version)
            self._log_corrupt()
            raise
        catalog.mark_complete(version, path)
        catalog.count("upstream_bytes_total", report.network_bytes)
        catalog.count("versions_replicated_total")
        self._log_corrupt()
        catalog.prune()

    def _log_corrupt(self) -> None:
        fresh = self.pool.reports[self._reported :]
        self._reported += len(fresh)
        for bad in fresh:
            log.warning(
                "upstream %s served corrupt %s of v%d: %s",
                bad.source,
                bad.what,
                bad.version,
                bad.reason,
            )
        self.catalog.count("upstream_corrupt_total", len(fresh))
