"""The policy versions a worker node has downloaded, followed from the weight sources.

:meth:`VersionFollower.run` (the node's weights thread) long-polls the weight sources (relays,
then the origin as a fallback) and downloads each new version as soon as it is announced, while
generation goes on with the version already loaded. The node's work thread asks for the newest
downloaded version between units and waits on a download, woken by it rather than by a poll,
when a lease needs a newer policy than it holds. Knows nothing about engines or the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from swarmrl.config.swarm import SwarmSection
from swarmrl.errors import PeerError, PeerUnavailable, WaitTimeout
from swarmrl.rolekit.toolkit import StatusReporter, retry
from swarmrl.shardcast import WeightClient
from swarmrl.shardcast.client import SOURCES_AWAY_QUIET_S

Ready = tuple[int, Path]  # a downloaded version and its directory
FIRST_VERSION_POLL_S = 30.0  # one long-poll for the first version, at most (sources down: less)


class VersionFollower:
    """The newest version downloaded by ``weights``, kept up to date by :meth:`run`."""

    def __init__(
        self,
        weights: WeightClient,
        swarm: SwarmSection,
        status: StatusReporter,
        log: logging.Logger,
        stop: threading.Event,
    ) -> None:
        self.weights = weights
        self.swarm = swarm
        self.status = status
        self.log = log
        self.stop = stop
        self._ready: Ready | None = None
        self._downloaded = threading.Condition()  # notified on each newer ``_ready``

    def newest(self) -> Ready | None:
        with self._downloaded:
            return self._ready

    def newer_than(self, version: int) -> bool:
        ready = self.newest()
        return ready is not None and ready[0] > version

    def wait(self, version: int, timeout_s: float) -> bool:
        """Whether ``version`` or a newer one is downloaded, waiting at most ``timeout_s``."""
        with self._downloaded:
            return self._downloaded.wait_for(
                lambda: self._ready is not None and self._ready[0] >= version, timeout=timeout_s
            )

    def offer(self, version: int, path: Path) -> None:
        """Record a downloaded version; an older one than the newest is ignored."""
        with self._downloaded:
            if self._ready is None or version > self._ready[0]:
                self._ready = (version, path)
                self._downloaded.notify_all()

    def run(self) -> None:
        """Follow the weight sources until ``stop``."""
        self._first_version()
        while not self.stop.is_set():
            try:
                retry(
                    self._fetch_latest,
                    "fetch the latest policy version",
                    self.log,
                    give_up_s=self.swarm.give_up_s,
                    pause_s=self.swarm.retry_s,
                    stop=self.stop,
                    quiet_s=SOURCES_AWAY_QUIET_S,
                )
                self.weights.wait_for_newer(timeout_s=30.0)
            except WaitTimeout:
                continue  # no newer version yet (or sources away): ask again
            except PeerError as exc:
                self.log.warning("weight source sent bad data (%s); refetching", exc)
                self.stop.wait(self.swarm.retry_s)

    def _first_version(self) -> None:
        """Wait for the first version: sources that list none yet, or are not up yet, are how a
        run begins (the trainer is still warming up), so this is told once as a wait, not as a
        failure; still none after ``give_up_s`` warns once with the sources' answer (a wrong
        address looks the same at first). The wait is the sources' long-poll, answered the
        moment a version is announced (with its manifest: the fetch then neither lists the
        sources nor asks for it), not a poll every ``retry_s``: across a far link that is the
        first step's time. A version announced but not fetched is asked for every ``retry_s``.
        Returns once a version is held (or on ``stop``); :meth:`run` follows on."""
        started, told, warned, announced = time.monotonic(), False, False, False
        while not self.stop.is_set() and self.weights.held_version() is None:
            try:
                self._fetch_latest()
                return
            except PeerUnavailable as exc:
                if not told:
                    self.log.info("waiting for the first policy version to be published")
                    told = True
                waited = time.monotonic() - started
                if not warned and waited > self.swarm.give_up_s:
                    self.log.warning("no policy version after %.0f s: %s", waited, exc)
                    warned = True
                self.log.debug("no first version yet: %s", exc)
            if announced and self.stop.wait(self.swarm.retry_s):  # out there, but not fetched
                return
            try:
                self.weights.wait_for_newer(timeout_s=FIRST_VERSION_POLL_S)
                announced = True
            except WaitTimeout:
                announced = False

    def _fetch_latest(self) -> None:
        held = self.weights.held_version()
        path = self.weights.fetch("latest")
        version = store_version(path)
        self.offer(version, path)
        if version == held:
            return
        self.status.event(f"downloaded v{version}")
        report = self.weights.last_report
        if report is not None:
            self.status.add(weight_bytes=report.network_bytes)


def store_version(path: Path) -> int:
    """The version number of a ready shardcast version directory."""
    from swarmrl.shardcast import store

    return store.load_manifest(path).version
