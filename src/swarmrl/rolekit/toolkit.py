"""What every long-running role shares: its command-line basics, logging, status reports, and
patient retries against peers that come and go.

A role is started the same way on a laptop and across machines: a config file (the same one
everywhere, so every role agrees on task, model and sampling), ``--set`` overrides, a key file,
and peer URLs. :func:`retry` turns "the orchestrator went away" into log lines and a bounded
wait instead of a crash or a silent hang.

Knows nothing about what a role computes; each role module builds on these pieces.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import httpx
import tenacity

from swarmrl.config import SwarmConfig
from swarmrl.config.args import add_config_args, config_from_args, config_line
from swarmrl.errors import InfraError, RateLimited, WaitTimeout
from swarmrl.logs import configure_logging
from swarmrl.protocol.swarm import RoleName, RoleStatus

T = TypeVar("T")

# What a lost or restarting peer looks like from here: connection refused, reset, timeouts,
# 5xx replies turned into PeerUnavailable by the clients; and a pool asking to come back later.
TRANSIENT: tuple[type[BaseException], ...] = (httpx.TransportError, InfraError, RateLimited)


def add_tls_args(parser: argparse.ArgumentParser, what: str = "serve HTTPS with") -> None:
    """``--tls-cert``/``--tls-key`` (``swarmrl.serving.Tls.from_flags`` checks them)."""
    parser.add_argument(
        "--tls-cert", default=None, help=f"PEM certificate (chain) to {what} (with --tls-key)"
    )
    parser.add_argument("--tls-key", default=None, help="the certificate's PEM private key")


def add_role_args(parser: argparse.ArgumentParser, *, needs_key: bool = True) -> None:
    """Options every role takes: config, overrides, identity, name, status directory."""
    add_config_args(parser)
    if needs_key:
        parser.add_argument("--key", required=True, help="ed25519 key file of this role")
    parser.add_argument("--name", default=None, help="name shown in logs and the display")
    parser.add_argument(
        "--status-dir", default=None, help="write <name>.json status reports into this directory"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0 = any free port; default: off)",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics")


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    """Options of the roles that lease from a pool and fetch weights (worker, validator)."""
    parser.add_argument("--orchestrator", required=True, help="orchestrator URL")
    parser.add_argument("--pool", default="swarm", help="pool id")
    parser.add_argument("--weights", action="append", required=True, help="relay or origin URL")
    parser.add_argument(
        "--publisher-key", required=True, help="trainer's public key (hex) or key file"
    )


def load_role_config(args: argparse.Namespace) -> SwarmConfig:
    """``CONFIG`` (default: the embedded one), then each ``--set section.key=value``."""
    return config_from_args(args)


def log_config(log: logging.Logger, config: SwarmConfig) -> None:
    """One short log line with the keys of the resolved config that differ from the defaults
    (credentials masked)."""
    log.info("resolved config %s", config_line(config))


def setup_logging(name: str, level: str = "INFO") -> logging.Logger:
    """Log lines ``HH:MM:SS name: message`` on stderr (the supervisor captures them), the same
    format in every role (:mod:`swarmrl.logs`), without library progress bars."""
    return configure_logging(name, level)


class _Stopped(Exception):
    """Raised out of a pause when the role's stop event is set."""


def end_process(code: int) -> NoReturn:
    """End this role's process with ``code`` at once, its logs and standard streams flushed,
    without the interpreter's finalisation. A role that has finished cleanly can still have
    native threads running (torch's, a download's); destroying them while the interpreter
    tears down has aborted a finished worker ("terminate called without an active exception",
    status −6), which its supervisor then counts as a crash. For a role's own process only:
    nothing registered to run at exit runs."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: nothing more can reach it
    os._exit(code)


def _pause(stop: threading.Event | None) -> Callable[[float], None]:
    """tenacity's sleep: a plain sleep, or a wait on ``stop`` that ends the loop when set."""

    def pause(seconds: float) -> None:
        if stop is None:
            time.sleep(seconds)
        elif stop.wait(seconds):
            raise _Stopped

    return pause


def retry(
    call: Callable[[], T],
    what: str,
    log: logging.Logger,
    *,
    give_up_s: float,
    pause_s: float = 1.0,
    stop: threading.Event | None = None,
    max_pause_s: float | None = None,
    quiet_s: float = 0.0,
) -> T:
    """Run ``call`` until it succeeds, retrying transient failures for up to ``give_up_s``.

    Pauses ``pause_s`` between attempts; with ``max_pause_s`` the pause doubles after each
    failure up to that bound, with up to ``pause_s`` of random jitter (many nodes coming back at
    once then spread out instead of knocking together).

    Each failure streak is logged once with what was being attempted; recovery is logged too.
    With ``quiet_s`` a streak is told as a warning only once it has lasted that long (and
    ``stop`` is not set): a peer away for a moment, or going away as the run ends, is logged
    at debug (the streak and its recovery alike).
    Raises :class:`WaitTimeout` naming ``what`` when the peer stays away (or ``stop`` is set),
    and lets every other error (a rejection, a bug) through at once.
    """
    failures = 0
    warned = False

    def failed(state: tenacity.RetryCallState) -> None:
        nonlocal failures, warned
        failures += 1
        stopping = quiet_s > 0 and stop is not None and stop.is_set()
        loud = not stopping and state.seconds_since_start >= quiet_s
        if warned or (failures > 1 and not loud):
            return
        exc = state.outcome.exception() if state.outcome else None
        warned = loud
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "%s failed (%s: %s); retrying for up to %.0f s",
            what,
            type(exc).__name__,
            exc,
            give_up_s,
        )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TRANSIENT),
        stop=tenacity.stop_after_delay(give_up_s),
        wait=tenacity.wait_fixed(pause_s)
        if max_pause_s is None
        else tenacity.wait_exponential(multiplier=pause_s, max=max_pause_s)
        + tenacity.wait_random(0, pause_s),
        sleep=_pause(stop),
        after=failed,
    )
    try:
        result = retrying(call)
    except tenacity.RetryError as err:
        exc = err.last_attempt.exception()
        raise WaitTimeout(f"{what}: peer unreachable for {give_up_s:.0f} s ({exc})") from exc
    except _Stopped:
        raise WaitTimeout(f"{what}: stopped while retrying") from None
    if failures:
        log.log(
            logging.INFO if warned else logging.DEBUG,
            "%s succeeded again after %d failed attempts",
            what,
            failures,
        )
    return result


@dataclass(frozen=True)
class StatusSnapshot:
    """A consistent copy of a reporter's numbers: the status, which metric keys are counters
    (only ever added to), and the labelled counters ``(name, ((label, value), …)) → total``."""

    status: RoleStatus
    counters: frozenset[str]
    labelled: dict[tuple[str, tuple[tuple[str, str], ...]], float]


# at most this share of the wall clock goes to ``refresh`` (a refresh that counts rows of a
# growing table is run less often as it grows, instead of taking ever more of a busy server)
REFRESH_SHARE = 0.01


class StatusReporter:
    """Keeps a :class:`RoleStatus` and writes it to ``status_dir`` every ``interval_s``.

    Without a status directory it only holds the numbers (roles on their own machines).
    """

    def __init__(
        self,
        role: RoleName,
        name: str,
        status_dir: str | Path | None,
        interval_s: float = 1.0,
        node_id: str | None = None,
        refresh: Callable[[StatusReporter], None] | None = None,
    ) -> None:
        """``refresh``, when given, runs before each periodic write to bring the numbers up to
        date (a role whose numbers live elsewhere, e.g. the orchestrator's database); one that
        took t seconds runs again no sooner than t / :data:`REFRESH_SHARE` later."""
        self.status = RoleStatus(role=role, name=name, node_id=node_id)
        self.refresh = refresh
        self.status_dir = Path(status_dir) if status_dir else None
        self.interval_s = interval_s
        self._events: deque[str] = deque(maxlen=8)
        self._counters: set[str] = set()
        self._labelled: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(
        self, *, state: str | None = None, version: int | None = None, **metrics: float
    ) -> None:
        with self._lock:
            if state is not None:
                self.status.state = state
            if version is not None:
                self.status.policy_version = version
            self.status.metrics.update({k: float(v) for k, v in metrics.items()})

    def add(self, **increments: float) -> None:
        with self._lock:
            for key, value in increments.items():
                self.status.metrics[key] = self.status.metrics.get(key, 0.0) + float(value)
                self._counters.add(key)

    def count(self, name: str, n: float = 1.0, **labels: str) -> None:
        """Add ``n`` to the counter ``name`` with these labels (Prometheus only, not the file)."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._labelled[key] = self._labelled.get(key, 0.0) + float(n)

    def set_metrics_url(self, url: str) -> None:
        with self._lock:
            self.status.metrics_url = url

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return StatusSnapshot(
                self.status.model_copy(deep=True), frozenset(self._counters), dict(self._labelled)
            )

    def event(self, text: str) -> None:
        with self._lock:
            self._events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def metric(self, key: str, default: float = 0.0) -> float:
        with self._lock:
            return self.status.metrics.get(key, default)

    def flush(self) -> None:
        if self.status_dir is None:
            return
        with self._lock:
            snapshot = self.status.model_copy(
                update={"updated_at": time.time(), "events": list(self._events)}, deep=True
            )
        with self._write_lock:  # the reporting thread and a final flush share one scratch file
            snapshot.write(self.status_dir)

    def _run(self) -> None:
        next_refresh = 0.0
        while not self._stop.wait(self.interval_s):
            if self.refresh is not None and time.monotonic() >= next_refresh:
                started = time.monotonic()
                try:
                    self.refresh(self)
                except Exception as exc:  # a failed refresh must not end the reports
                    self.set(state=f"status refresh failed: {type(exc).__name__}")
                took = time.monotonic() - started
                next_refresh = started + took / REFRESH_SHARE  # its cost stays bounded
            self.flush()

    def __enter__(self) -> StatusReporter:
        self.flush()
        self._thread = threading.Thread(target=self._run, name="status", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()


def wait_for(
    probe: Callable[[], T | None],
    what: str,
    log: logging.Logger,
    *,
    timeout_s: float,
    pause_s: float = 0.5,
    stop: threading.Event | None = None,
) -> T:
    """Poll ``probe`` until it returns something other than None; log what is awaited.

    Logs once after the first miss and again every 30 s; raises :class:`WaitTimeout` naming
    ``what`` when ``timeout_s`` passes (or ``stop`` is set).
    """
    next_note = 0.0

    def missed(state: tenacity.RetryCallState) -> None:
        nonlocal next_note
        waited = state.seconds_since_start or 0.0
        if waited >= next_note:
            log.info("waiting for %s (%.0f s so far, limit %.0f s)", what, waited, timeout_s)
            next_note = waited + 30.0

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda value: value is None),
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_fixed(pause_s),
        sleep=_pause(stop),
        after=missed,
    )
    try:
        return retrying(probe)
    except tenacity.RetryError:
        raise WaitTimeout(f"gave up after {timeout_s:.0f} s waiting for {what}") from None
    except _Stopped:
        raise WaitTimeout(f"stopped while waiting for {what}") from None
