"""Fetch signed weight versions from origins and relays into a local directory.

``WeightClient(sources, publisher_key_hex, out_root).fetch("latest")`` returns the path of a
ready checkpoint directory (``out_root/vNNNNNNNN``); ``wait_for_newer(timeout_s)`` blocks on
the sources' long-poll until a newer version is announced (each source sends the version's
signed manifest with its notice, and the next ``fetch("latest")``, within ``NOTICE_FRESH_S``,
takes that version and those manifests without listing every source or asking for the
manifest again: two round trips less per version across a far link). A fetch resolves the
version, takes its manifest from the best source that serves a valid one (signed by a trusted
publisher, the version asked for, not older than what is held), assembles the files in a
partial directory (see ``assemble``), and renames it into place only once every shard is
verified. Any failure removes the partial directory and raises: a ``PeerError`` when peers
sent bad data, an ``InfraError`` when the network or the disk failed.

A source that announces a version nobody can back with a validly signed manifest (a lying or
broken relay) is distrusted: ``wait_for_newer`` ignores its announcements for a pause that
doubles with each such announcement (``UNBACKED_PAUSE_S``), so a worker following it does not
spin through fetch-and-wait loops; the pause ends as soon as it announces something real.

Knows nothing about torch or how the worker loads the weights.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import (
    CorruptData,
    PeerError,
    PeerUnavailable,
    ReplayedRequest,
    VersionGone,
    WaitTimeout,
)
from swarmrl.protocol.shardcast import Manifest, VersionList
from swarmrl.shardcast import store
from swarmrl.shardcast.assemble import Assembly, AssemblyReport
from swarmrl.shardcast.manifest import parse_manifest, verify_manifest
from swarmrl.shardcast.recheck import recheck_store
from swarmrl.shardcast.transport import Connections, CorruptReport, SourcePool
from swarmrl.shardcast.writers import DirectFileWriter, FileWriter

log = logging.getLogger(__name__)

MANIFEST_LIMIT = 64 << 20
# a long-poll's notice stands in for listing the sources this long (seconds) after it came
NOTICE_FRESH_S = 5.0
UNBACKED_PAUSE_S = (0.5, 30.0)  # first and longest pause on a source after an unbacked notice
HELD_HEADER = "X-Shardcast-Held-Version"
CLIENT_HEADER = "X-Shardcast-Client"
# sources unreachable for less than this are told at debug, not as a fault: at a run's end the
# trainer's origin goes away while relays, workers and validators may still be fetching its
# last version
SOURCES_AWAY_QUIET_S = 10.0


def connections(config: ShardcastConfig, headers: dict[str, str]) -> Connections:
    """Pooled connections with the config's timeouts, reused only well inside keep-alive."""
    return Connections(
        config.request_timeout_s,
        headers,
        max_idle_s=0.8 * config.keep_alive_s,
        connect_timeout_s=config.connect_timeout_s,
        stall_timeout_s=config.stall_timeout_s,
    )


def parse_version_list(body: bytes) -> VersionList:
    try:
        return VersionList.model_validate_json(body)
    except ValueError as exc:
        raise CorruptData(f"malformed version list: {str(exc).splitlines()[0]}") from exc


def fetch_manifest(
    pool: SourcePool,
    conns: Connections,
    version: int,
    trusted: Sequence[str],
    *,
    held: int | None,
    allow_rollback: bool,
    timeout_s: float | None = None,
    offered: Mapping[str, dict[str, Any]] | None = None,
) -> Manifest:
    """The first valid manifest of ``version`` among the sources (bad ones are reported).
    ``offered``: manifests of ``version`` sources sent inline with a long-poll's answer (by
    source url), each taken and judged as that source's answer, with no request of its own."""
    problems: list[str] = []
    statuses: list[int] = []  # HTTP answers other than 200 (410: pruned, it will not return)
    last_peer_error: PeerError | None = None
    for url in pool.ordered():
        body: bytes | dict[str, Any]
        try:
            if offered and url in offered:
                status, body = 200, offered[url]
            else:
                status, body = conns.get_bytes(
                    url, f"/v/{version}/manifest", MANIFEST_LIMIT, timeout_s
                )
        except (OSError, http.client.HTTPException) as exc:
            pool.failure(url, exc)
            problems.append(f"{url}: {exc}")
            continue
        if status != 200:
            problems.append(f"{url}: HTTP {status}")
            statuses.append(status)
            continue
        try:
            manifest = verify_manifest(
                parse_manifest(body),
                trusted,
                expected_version=version,
                held_version=held,
                allow_rollback=allow_rollback,
            )
        except PeerError as exc:
            pool.corrupt(url, version, "manifest", str(exc))
            problems.append(f"{url}: {type(exc).__name__}: {exc}")
            last_peer_error = exc
            continue
        return manifest
    if last_peer_error is not None:
        raise type(last_peer_error)(f"no valid manifest for v{version}: {'; '.join(problems)}")
    if statuses and all(status == 410 for status in statuses):
        raise VersionGone(f"v{version} has been pruned by every source that answered")
    raise PeerUnavailable(f"no source served the manifest of v{version}: {'; '.join(problems)}")


class WeightClient:
    """Fetches policy versions into ``out_root`` (see module docstring)."""

    def __init__(
        self,
        sources: Sequence[str],
        publisher_public_key_hex: str | Sequence[str],
        out_root: str | Path,
        config: ShardcastConfig | None = None,
        *,
        writer: FileWriter | None = None,
        client_id: str | None = None,
    ) -> None:
        self.config = config or ShardcastConfig()
        keys = (
            [publisher_public_key_hex]
            if isinstance(publisher_public_key_hex, str)
            else list(publisher_public_key_hex)
        )
        self.trusted = [k.lower() for k in keys]
        self.out_root = Path(out_root)
        self.out_root.mkdir(parents=True, exist_ok=True)
        self.pool = SourcePool(list(sources))
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.conns = self._connections()
        if writer is None:  # a fetched checkpoint is read once, by the loader: skip the cache
            writer = DirectFileWriter() if self.config.direct_writes else FileWriter()
        self.writer = writer
        self.last_report: AssemblyReport | None = None
        self._advertised: dict[str, int] = {}  # the latest each source listed last time
        # what the last long-poll announced: (version, monotonic time), taken by the next
        # fetch("latest") while fresh, and the manifests sources sent with their notices
        self._notice: tuple[int, float] | None = None
        # source → (version, manifest, monotonic time): taken once, while fresh
        self._offers: dict[str, tuple[int, dict[str, Any], float]] = {}
        self._strikes: dict[str, int] = {}  # unbacked announcements in a row, per source
        self._lock = threading.Lock()
        if self.config.recheck_on_start:  # a damaged held version is fetched again, not loaded
            recheck_store(self.out_root, self.trusted)

    def _connections(self) -> Connections:
        # reuse a kept-alive connection only well inside the servers' keep-alive
        return connections(self.config, {CLIENT_HEADER: self.client_id})

    def _judge_sources(self, version: int, backed: bool) -> None:
        """Record whether the sources that announced ``version`` could back it."""
        with self._lock:
            for url, latest in self._advertised.items():
                if latest == version:
                    self._strikes[url] = 0 if backed else self._strikes.get(url, 0) + 1

    def _pause_for(self, url: str) -> float:
        """How long ``wait_for_newer`` ignores ``url`` (0 unless its notices went unbacked)."""
        with self._lock:
            strikes = self._strikes.get(url, 0)
        first, longest = UNBACKED_PAUSE_S
        return 0.0 if strikes == 0 else min(longest, first * 2 ** (strikes - 1))

    @property
    def reports(self) -> list[CorruptReport]:
        """Corrupt-data reports against sources (who served what, and why it was refused)."""
        return list(self.pool.reports)

    def held_version(self) -> int | None:
        versions = store.ready_versions(self.out_root)
        return versions[-1] if versions else None

    def _headers(self) -> dict[str, str]:
        held = self.held_version()
        return {} if held is None else {HELD_HEADER: str(held)}

    def advertised_versions(self) -> list[int]:
        """The ``latest`` each reachable source lists, highest first, without repeats."""
        found: set[int] = set()
        problems = []
        for url in sorted(self.pool.urls, key=self.pool.resting):  # resting sources last
            if found and self.pool.resting(url):
                continue  # asked only when no other source lists a version
            try:
                resp = self.conns.get(url, "/versions", self._headers())
                body = resp.read(MANIFEST_LIMIT)
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                latest = parse_version_list(body).latest
            except (OSError, http.client.HTTPException, PeerError) as exc:
                problems.append(f"{url}: {exc}")
                self.conns.drop(url)
                if isinstance(exc, OSError):
                    self.pool.failure(url, exc)
                continue
            if latest is not None:
                found.add(latest)
                with self._lock:
                    self._advertised[url] = latest
        if not found:
            raise PeerUnavailable(
                f"no source lists any version ({'; '.join(problems) or 'all empty'})"
            )
        return sorted(found, reverse=True)

    def latest_version(self) -> int:
        """The highest version any reachable source lists."""
        return self.advertised_versions()[0]

    def fetch(
        self,
        version: int | str = "latest",
        *,
        allow_rollback: bool = False,
        timeout_s: float | None = None,
    ) -> Path:
        """Make ``version`` ready under ``out_root`` and return its directory.

        With ``"latest"``, a version some source advertises but none can back with a valid
        manifest (a lying relay) is skipped for the next highest advertised one; the version a
        long-poll just announced is tried first, and the sources are listed only if it fails.
        """
        held = self.held_version()
        candidates = self._candidates(version, held)
        first = next(candidates)
        if held is not None and first < held and not allow_rollback:
            raise ReplayedRequest(
                f"refusing rollback to v{first}: v{held} is already held "
                "(allow_rollback=True to go back)"
            )
        first_error: PeerError | PeerUnavailable | None = None
        for target in itertools.chain([first], candidates):
            ready = store.ready_dir(self.out_root, target)
            if store.manifest_path(ready).is_file():
                return ready
            if held is not None and target < held and not allow_rollback:
                break  # every remaining candidate is older than what is held
            try:
                manifest = fetch_manifest(
                    self.pool,
                    self.conns,
                    target,
                    self.trusted,
                    held=held,
                    allow_rollback=allow_rollback,
                    offered=self._offers_for(target),
                )
            except (PeerError, PeerUnavailable) as exc:  # advertised, but nobody backs it
                self._judge_sources(target, backed=False)
                first_error = first_error or exc
                continue
            self._judge_sources(target, backed=True)
            deadline = time.monotonic() + (timeout_s or self.config.fetch_timeout_s)
            path, self.last_report = install_version(
                manifest, self.out_root, self.pool, self.conns, self.writer, self.config, deadline
            )
            store.prune(self.out_root, self.config.keep_versions, protect=frozenset({target}))
            return path
        if first_error is None:
            first_error = ReplayedRequest(f"no advertised version is newer than the held v{held}")
        raise first_error

    def _candidates(self, version: int | str, held: int | None) -> Iterator[int]:
        """The versions :meth:`fetch` tries, in order: ``version`` itself; for "latest", the
        one the last long-poll announced while its notice is fresh (no listing round trip to
        every source), then what the sources list, highest first."""
        if version != "latest":
            yield int(version)
            return
        noticed = self._take_notice()
        if noticed is not None and (held is None or noticed > held):
            yield noticed
        yield from (v for v in self.advertised_versions() if v != noticed)

    def _take_notice(self) -> int | None:
        """The version the last long-poll announced, once, while fresh (a later fetch lists
        the sources again)."""
        with self._lock:
            notice, self._notice = self._notice, None
        if notice is None or time.monotonic() - notice[1] > NOTICE_FRESH_S:
            return None
        return notice[0]

    def _offers_for(self, version: int) -> dict[str, dict[str, Any]]:
        """The manifests of ``version`` sources sent with their notices within
        ``NOTICE_FRESH_S``, by source; each is taken once. A later request for that version
        asks the source: a manifest kept from an old notice would stand in for a source that
        has pruned the version since, and a download that failed on it would be tried on it
        again, never learning the version is gone (``VersionGone``)."""
        now = time.monotonic()
        with self._lock:
            taken = {
                url: manifest
                for url, (v, manifest, at) in self._offers.items()
                if v == version and now - at <= NOTICE_FRESH_S
            }
            for url in list(self._offers):
                if url in taken or now - self._offers[url][2] > NOTICE_FRESH_S:
                    del self._offers[url]
        return taken

    def wait_for_newer(self, than: int | None = None, timeout_s: float = 60.0) -> int:
        """Block until some source announces a version newer than ``than`` (default: held).

        Raises :class:`WaitTimeout` after ``timeout_s`` seconds.
        """
        floor = self.held_version() if than is None else than
        after = -1 if floor is None else floor
        found: queue.Queue[int] = queue.Queue()
        stop = threading.Event()
        deadline = time.monotonic() + timeout_s

        conns = self._connections()

        def watch(url: str) -> None:
            # a source whose last notices nobody could back is heard again only after a pause
            pause = min(self._pause_for(url), max(0.0, deadline - time.monotonic()))
            if pause and stop.wait(pause):
                return
            while not stop.is_set() and time.monotonic() < deadline:
                hold = max(0.1, min(self.config.long_poll_timeout_s, deadline - time.monotonic()))
                try:
                    resp = conns.get(
                        url,
                        f"/versions/wait?after={after}&timeout={hold:.2f}&manifest=1",
                        self._headers(),
                        timeout_s=hold + 10,
                    )
                    body = resp.read(MANIFEST_LIMIT)
                    listing = parse_version_list(body) if resp.status == 200 else None
                except (OSError, http.client.HTTPException, PeerError):
                    conns.close_all()
                    stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
                if listing is not None and listing.latest is not None and listing.latest > after:
                    with self._lock:
                        self._advertised[url] = listing.latest
                        if listing.manifest is not None:
                            offer = (listing.latest, listing.manifest, time.monotonic())
                            self._offers[url] = offer
                    found.put(listing.latest)
                    return
            conns.close_all()

        threads = [threading.Thread(target=watch, args=(u,), daemon=True) for u in self.pool.urls]
        for thread in threads:
            thread.start()
        try:
            latest = found.get(timeout=timeout_s)
            with self._lock:
                self._notice = (latest, time.monotonic())
            return latest
        except queue.Empty:
            raise WaitTimeout(
                f"no version newer than v{after} announced by {self.pool.urls} within {timeout_s:.1f}s"
            ) from None
        finally:
            stop.set()
            conns.abort()

    def fetch_newer(self, timeout_s: float = 60.0) -> Path:
        """Wait for a newer version than the one held, then fetch the latest."""
        self.wait_for_newer(timeout_s=timeout_s)
        return self.fetch("latest")

    def close(self) -> None:
        self.conns.close_all()


def install_version(
    manifest: Manifest,
    root: Path,
    pool: SourcePool,
    conns: Connections,
    writer: FileWriter,
    config: ShardcastConfig,
    deadline: float,
    *,
    on_partial: Callable[[Path], None] | None = None,
    on_shard: Callable[[int], None] = lambda index: None,
    on_delta: Callable[[int], None] = lambda index: None,
    parallel: int | None = None,
) -> tuple[Path, AssemblyReport]:
    """Assemble ``manifest`` under ``root`` and rename it ready; the partial dir never survives a
    failure. ``parallel``: downloads at once (None: ``config.parallel_downloads``)."""
    parent_dir, parent = None, None
    if manifest.parent_version is not None:
        candidate = store.ready_dir(root, manifest.parent_version)
        if store.manifest_path(candidate).is_file():
            parent_dir, parent = candidate, store.load_manifest(candidate)
    partial = store.new_partial(root, manifest.version)
    try:
        if on_partial is not None:
            on_partial(partial)
        started = time.perf_counter()
        report = Assembly(
            manifest,
            partial,
            pool,
            conns,
            parent_dir=parent_dir,
            parent=parent,
            writer=writer,
            parallel=parallel or config.parallel_downloads,
            deadline=deadline,
            # a relay holds a request for a shard still arriving for up to shard_wait_s
            answer_s=min(config.request_timeout_s, config.shard_wait_s + config.stall_timeout_s),
            on_shard=on_shard,
            on_delta=on_delta,
        ).run()
        store.write_manifest(partial, manifest)
        try:
            path = store.promote(partial, root, manifest.version)
        except FileExistsError:  # a concurrent fetch of the same version won the rename
            store.discard(partial)
            return store.ready_dir(root, manifest.version), report
    except BaseException:
        store.discard(partial)
        raise
    log.info(
        "v%d ready in %.2fs: %s",
        manifest.version,
        time.perf_counter() - started,
        json.dumps(
            {
                "reused": report.reused,
                "delta": report.from_delta,
                "downloaded": len(report.downloaded),
                "network_bytes": report.network_bytes,
            }
        ),
    )
    return path, report
