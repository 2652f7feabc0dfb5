"""A relay: follow upstreams (origin or relays) and re-serve what they publish, verified.

One watcher thread per upstream holds a long-poll (``/versions/wait``) open, so a new version
is known the moment its upstream knows it, its signed manifest sent with the notice (one round
trip less across a far link; judged like a fetched one, a bad one counting against the upstream
that sent it); each upstream's announcement is kept apart, so one
that announces a version it cannot back (a lying or broken relay) delays nobody else. A
replication thread then takes the newest announced version that no upstream has yet failed to
back with a validly signed manifest (such a version is set aside, with a growing cool-down,
and the next newest is tried at once; the upstreams that announced it are polled after a pause
that doubles with each such announcement), and fetches it from all upstreams (weighted,
resumable, every shard checked against the signed manifest, delta from the parent when held)
into a partial directory that the catalog already serves shard by shard as they are verified;
once complete it is renamed ready and versions beyond ``keep_versions`` are pruned.

Knows nothing about HTTP routing (see ``server``) or about clients.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import DiskWriteError, InfraError, PeerError
from swarmrl.protocol.shardcast import Manifest
from swarmrl.shardcast import store
from swarmrl.shardcast.assemble import FileWriter
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.client import (
    CLIENT_HEADER,
    HELD_HEADER,
    MANIFEST_LIMIT,
    SOURCES_AWAY_QUIET_S,
    connections,
    fetch_manifest,
    install_version,
    parse_version_list,
)
from swarmrl.shardcast.recheck import recheck_store
from swarmrl.shardcast.transport import SourcePool

log = logging.getLogger(__name__)

UNBACKED_COOLDOWN_S = (1.0, 60.0)  # first and longest wait before an unbacked version is retried
UNBACKED_QUIET = 2  # failures on one version told at info before they warn
ERRORS_KEPT = 100  # also the most unbacked versions remembered
# an upstream that cannot be reached is asked again at most this far apart: a relay started
# before its upstream (the order docs/deploy.md gives) follows it within this once it is up
WATCH_BACKOFF_MAX_S = 2.0


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
        self.conns = connections(self.config, {CLIENT_HEADER: self.node_id})
        self.writer = writer or FileWriter()
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)  # newest replication failures
        self._reported = 0
        self._announced = {url: -1 for url in self.pool.urls}  # newest version each announced
        # the manifest each upstream sent with its newest notice: (version, manifest as sent),
        # judged when that version is replicated as if fetched from that upstream
        self._offered: dict[str, tuple[int, dict[str, Any]]] = {}
        # version -> (monotonic time it may be tried again, failures so far)
        self._unbacked: dict[int, tuple[float, int]] = {}
        self._strikes = {url: 0 for url in self.pool.urls}  # its unbacked notices in a row
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_conns = connections(self.config, {CLIENT_HEADER: self.node_id})

    def start(self) -> None:
        for name in store.discard_stale_partials(self.catalog.root):
            log.info("removed leftover %s", name)
        if self.config.recheck_on_start:  # damaged versions are fetched again, never served
            damaged = recheck_store(self.catalog.root, self.trusted)
            self.catalog.count("stored_versions_damaged_total", len(damaged))
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
            with self._cv:  # an upstream whose notices went unbacked is heard less often
                strikes = self._strikes[url]
            if strikes and self._stop.wait(min(UNBACKED_COOLDOWN_S[1], 2 ** (strikes - 1))):
                break
            held = self._held()
            headers = {} if held is None else {HELD_HEADER: str(held)}
            try:
                resp = conns.get(
                    url,
                    f"/versions/wait?after={self._announced[url]}&timeout={hold}&manifest=1",
                    headers,
                    timeout_s=hold + 10,
                )
                body = resp.read(MANIFEST_LIMIT)
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                listing = parse_version_list(body)
                latest = listing.latest
                backoff = 0.2
            except (OSError, http.client.HTTPException, PeerError) as exc:
                conns.close_all()
                log.debug("upstream %s: %s (retrying in %.1fs)", url, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
                continue
            if latest is not None:
                with self._cv:
                    if latest > self._announced[url]:
                        self._announced[url] = latest
                        if listing.manifest is not None:
                            self._offered[url] = (latest, listing.manifest)
                        self._cv.notify_all()
                    # poll again once this notice is dealt with (replicating, held or set
                    # aside), so an upstream answering at once with ever newer versions cannot
                    # make this loop spin while the replication thread is busy
                    self._cv.wait_for(lambda v=latest: self._dealt_with(v), hold)
        conns.close_all()

    def _dealt_with(self, version: int) -> bool:
        return self._stop.is_set() or version <= self._held_or_none() or version in self._unbacked

    def _held_or_none(self) -> int:
        """Newest version in the catalog, -1 when empty (version 0 is a real version)."""
        latest = self.catalog.latest()
        return -1 if latest is None else latest

    def _candidates(self) -> list[int]:
        """Announced versions newer than what is held and not cooling down, newest first."""
        floor, now = self._held_or_none(), time.monotonic()
        with self._cv:
            announced = set(self._announced.values())
            cooling = {v for v, (until, _) in self._unbacked.items() if until > now}
        return sorted((v for v in announced if v > floor and v not in cooling), reverse=True)

    def _set_aside(self, version: int, exc: Exception) -> None:
        """No upstream backs ``version``: leave it for a while, longer after each failure."""
        first, longest = UNBACKED_COOLDOWN_S
        floor = self._held_or_none()
        with self._cv:
            _, failures = self._unbacked.get(version, (0.0, 0))
            wait = min(longest, first * 2**failures)
            self._unbacked[version] = (time.monotonic() + wait, failures + 1)
            for old in [v for v in self._unbacked if v <= floor]:
                del self._unbacked[old]  # bounded: only versions above what is held matter
            while len(self._unbacked) > ERRORS_KEPT:
                del self._unbacked[min(self._unbacked)]
            for url, announced in self._announced.items():
                if announced >= version:  # it announced this one (or has moved past it since)
                    self._strikes[url] += 1
            self._cv.notify_all()
        self.errors.append(f"v{version}: {type(exc).__name__}: {exc}")
        # the first misses are routine (an upstream still writing the version, or the origin
        # gone at the end of a run): told as what they are; a version that stays unbacked warns
        log.log(
            logging.WARNING if failures >= UNBACKED_QUIET else logging.INFO,
            "v%d not fetched from any upstream (%s); older versions meanwhile, v%d again in %.0fs",
            version,
            exc if failures >= UNBACKED_QUIET else "not served there yet",
            version,
            wait,
        )
        log.debug("v%d unbacked: %s", version, exc)
        self.catalog.count("versions_unbacked_total")

    def _replicate_loop(self) -> None:
        backoff = 1.0
        away_since: float | None = None  # monotonic start of the upstreams' current absence
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(lambda: self._stop.is_set() or bool(self._candidates()), 1.0)
            candidates = self._candidates()
            if self._stop.is_set() or not candidates:
                continue
            target = candidates[0]
            try:
                manifest = self._manifest(target)
            except (PeerError, InfraError, OSError) as exc:  # announced, but nobody backs it
                self._set_aside(target, exc)
                self._log_corrupt()
                continue
            try:
                self._install(manifest)
                backoff, away_since = 1.0, None
            except (PeerError, InfraError, OSError) as exc:  # report, keep following
                self.errors.append(f"v{target}: {type(exc).__name__}: {exc}")
                now = time.monotonic()
                if isinstance(exc, InfraError) and not isinstance(exc, DiskWriteError):
                    away_since = now if away_since is None else away_since
                else:
                    away_since = None
                # upstreams out of reach for a moment (or gone as the run ends) are no fault
                quiet = away_since is not None and now - away_since < SOURCES_AWAY_QUIET_S
                log.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "relay could not replicate v%d: %s",
                    target,
                    exc,
                )
                self.catalog.count("replication_failures_total")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _manifest(self, version: int) -> Manifest:
        """The signed manifest of ``version`` from the first upstream that backs it (one sent
        with an upstream's notice is judged first, in that upstream's place, with no request)."""
        with self._cv:
            offered = {url: m for url, (v, m) in self._offered.items() if v == version}
        return fetch_manifest(
            self.pool,
            self.conns,
            version,
            self.trusted,
            held=self._held(),
            allow_rollback=False,
            offered=offered,
        )

    def replicate(self, version: int) -> None:
        """Fetch ``version`` from the upstreams into the catalog's store, serving it as it arrives."""
        self._install(self._manifest(version))

    def _install(self, manifest: Manifest) -> None:
        version, catalog = manifest.version, self.catalog

        def on_partial(partial: Path) -> None:
            catalog.add_in_progress(manifest, partial)
            with self._cv:
                self._cv.notify_all()  # watchers waiting for this version to be dealt with

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
                parallel=self.config.relay_parallel_downloads,
            )
        except BaseException:
            catalog.drop(version)
            self._log_corrupt()
            raise
        catalog.mark_complete(version, path)
        with self._cv:
            for url, announced in self._announced.items():
                if announced == version:
                    self._strikes[url] = 0  # it backed what it announced
            self._cv.notify_all()
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
