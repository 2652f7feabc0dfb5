"""HTTP transport of the fetch side: source scoring, pooled connections, verified downloads.

``download_object`` fetches one byte object (a shard or a delta blob) whose size and digest
come from a signed manifest: it picks a source by weight, streams the body through the
digest into a sink (``pwrite`` at offsets), resumes with ``Range`` from another source after
a broken or truncated response (a source that broke a transfer of this object is not asked
for it again while another source remains), and on a digest mismatch penalises every source that
contributed bytes, reports it, and starts over from a different source. Where no other source is
left, one that served corrupt bytes is asked again, within the object's attempt bound: a damaged
link delivers the signed bytes on a later try, a lying source never does and costs at most the
bound.

A source that goes silent is given up quickly, not after a whole request's timeout: opening a
connection may take ``connect_timeout_s``, and once an answer has begun (or for requests
answered at once) ``stall_timeout_s`` without a byte ends the attempt. Such a source (or one
that cannot be reached at all) *rests*: the other transfers from it are ended at once (they
resume elsewhere), and for ``REST_S`` seconds every other source is chosen first, so the fetch
goes on from the next source instead of finding the silence again shard by shard; a resting
source is still used where nothing else is left.

Source weight (higher is chosen more often, chosen at random in proportion)::

    weight = throughput_ewma_bytes_per_s × (successes + 1) / (successes + failures + 1)
             × 0.05 ** corrupt_count

Uses the standard library's ``http.client`` (its ``readinto`` moves bytes at socket speed).
Knows nothing about manifests beyond a path, a size and a digest.
"""

from __future__ import annotations

import errno
import http.client
import logging
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from swarmrl.errors import (
    CorruptData,
    DiskWriteError,
    FetchAborted,
    ObjectMissing,
    PeerUnavailable,
    WaitTimeout,
)
from swarmrl.shardcast.manifest import new_hasher

log = logging.getLogger(__name__)

CHUNK = 1 << 20
REST_S = 30.0  # how long a silent or unreachable source comes after every other one
UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)
PRIOR_BPS = 100e6  # assumed throughput of a source never measured
EWMA = 0.3


# what a GET on a connection the server has closed meanwhile fails with, before any answer
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


@dataclass
class CorruptReport:
    """A source that served bytes not matching the signed digest (or a bad manifest)."""

    source: str
    version: int
    what: str
    reason: str
    at: float = field(default_factory=time.time)


@dataclass
class SourceStats:
    url: str
    ewma_bps: float | None = None
    successes: int = 0
    failures: int = 0
    corrupt: int = 0
    bytes_ok: int = 0
    silences: int = 0  # attempts it ended by sending nothing in time (or being unreachable)
    rest_until: float = 0.0  # monotonic time until which other sources are chosen first

    def weight(self) -> float:
        bps = self.ewma_bps if self.ewma_bps is not None else PRIOR_BPS
        score = (self.successes + 1) / (self.successes + self.failures + 1)
        return max(bps, 1.0) * score * (0.05**self.corrupt)


class SourcePool:
    """Thread-safe scores of the sources a fetch may use."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one source URL is needed")
        self._lock = threading.Lock()
        self.stats = {u.rstrip("/"): SourceStats(u.rstrip("/")) for u in urls}
        self.reports: list[CorruptReport] = []
        self._rng = random.Random()

    @property
    def urls(self) -> list[str]:
        return list(self.stats)

    def choose(self, exclude: set[str]) -> str | None:
        """A source not in ``exclude``, at random by weight; resting ones only if no other is left."""
        now = time.monotonic()
        with self._lock:
            options = [s for u, s in self.stats.items() if u not in exclude]
            if not options:
                return None
            awake = [s for s in options if s.rest_until <= now] or options
            return self._rng.choices(awake, weights=[s.weight() for s in awake])[0].url

    def ordered(self) -> list[str]:
        """Sources best first, resting ones last (for one-off requests such as manifests)."""
        now = time.monotonic()
        with self._lock:
            ranked = sorted(self.stats.values(), key=lambda s: (s.rest_until > now, -s.weight()))
            return [s.url for s in ranked]

    def resting(self, url: str) -> bool:
        with self._lock:
            return self.stats[url].rest_until > time.monotonic()

    def success(self, url: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            stats = self.stats[url]
            stats.successes += 1
            stats.bytes_ok += nbytes
            if nbytes >= 256 * 1024:  # small objects measure latency, not throughput
                bps = nbytes / max(seconds, 1e-6)
                stats.ewma_bps = (
                    bps if stats.ewma_bps is None else EWMA * bps + (1 - EWMA) * stats.ewma_bps
                )

    def failure(self, url: str, exc: BaseException | None = None) -> bool:
        """An attempt on ``url`` failed; a silence or an unreachable host also rests it. True
        when ``url`` was not resting before (the first sign of its silence)."""
        silent = isinstance(exc, TimeoutError) or (
            isinstance(exc, OSError) and exc.errno in UNREACHABLE
        )
        with self._lock:
            stats = self.stats[url]
            stats.failures += 1
            if not silent:
                return False
            stats.silences += 1
            told = stats.rest_until > time.monotonic()
            stats.rest_until = time.monotonic() + REST_S
        if not told and len(self.stats) > 1:
            log.warning(
                "weight source %s went silent (%s): the other sources first for %.0f s",
                url,
                exc,
                REST_S,
            )
        return not told

    def corrupt(self, url: str, version: int, what: str, reason: str) -> None:
        with self._lock:
            self.stats[url].corrupt += 1
            self.reports.append(CorruptReport(url, version, what, reason))


class Connections:
    """One keep-alive ``http.client`` connection per (thread, source).

    A connection idle for ``max_idle_s`` or more is closed rather than reused (servers drop
    idle connections after their keep-alive), and a GET that fails on a reused connection
    before any answer (the server closed it meanwhile) is sent once more on a fresh one: a GET
    is idempotent, and a stale socket is no fault of the source.

    Opening a connection may take ``connect_timeout_s``; a GET waits ``stall_timeout_s`` for its
    answer unless told otherwise (a long-poll), and once the answer has begun every read of its
    body waits ``stall_timeout_s`` at most; ``timeout_s`` caps the two. Either wait ending
    raises ``TimeoutError``, naming the source and what it did not do in time.
    """

    def __init__(
        self,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        max_idle_s: float = 4.0,
        *,
        connect_timeout_s: float | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s or timeout_s, timeout_s)
        self.stall_timeout_s = min(stall_timeout_s or timeout_s, timeout_s)
        self.headers = dict(headers or {})
        self.max_idle_s = max_idle_s
        self._local = threading.local()
        self._all: list[tuple[str, http.client.HTTPConnection]] = []
        self._all_lock = threading.Lock()
        self._aborted: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()

    def _cache(self) -> dict[str, tuple[http.client.HTTPConnection, float]]:
        return self._local.__dict__.setdefault("c", {})

    def _conn(self, url: str) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``url`` and whether it is an open one being reused."""
        cache = self._cache()
        cached = cache.get(url)
        if cached is not None and (
            time.monotonic() - cached[1] >= self.max_idle_s or cached[0] in self._aborted
        ):
            self.drop(url)  # the server may have closed it already: do not find out mid-request
            cached = None
        if cached is not None:
            return cached[0], cached[0].sock is not None
        parts = urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=self.connect_timeout_s)
        cache[url] = (conn, time.monotonic())
        with self._all_lock:
            self._all = [(u, c) for u, c in self._all if c.sock is not None] + [(url, conn)]
        return conn, False

    def drop(self, url: str) -> None:
        cached = self._cache().pop(url, None)
        if cached is not None:
            cached[0].close()

    def close_all(self) -> None:
        """Close this thread's connections."""
        for url in list(self._cache()):
            self.drop(url)

    def abort(self, url: str | None = None) -> None:
        """From any thread: shut down every open socket (to ``url`` only, if given), waking
        reads blocked on them."""
        with self._all_lock:
            conns = [c for u, c in self._all if url is None or u == url]
            self._all = [(u, c) for u, c in self._all if url is not None and u != url]
        for conn in conns:
            self._aborted.add(conn)
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its owner

    def get(
        self,
        url: str,
        path: str,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> http.client.HTTPResponse:
        """Send a GET and return the response (body unread), waiting ``timeout_s`` (default:
        ``stall_timeout_s``) for its answer. Network errors propagate."""
        conn, reused = self._conn(url)
        try:
            return self._send(conn, url, path, headers, timeout_s)
        except STALE_CONNECTION:
            if not reused or conn in self._aborted:  # ended on purpose: not a stale socket
                raise
        conn, _ = self._conn(url)  # closed by the server while idle: once more, on a new one
        return self._send(conn, url, path, headers, timeout_s)

    def _send(
        self,
        conn: http.client.HTTPConnection,
        url: str,
        path: str,
        headers: dict[str, str] | None,
        timeout_s: float | None,
    ) -> http.client.HTTPResponse:
        answer_s = timeout_s or self.stall_timeout_s
        base = urlsplit(url).path.rstrip("/")
        stage = "connect"
        try:
            if conn.sock is None:
                conn.timeout = self.connect_timeout_s
                conn.connect()  # TCP and TLS, within connect_timeout_s
            stage = "answer"
            conn.timeout = answer_s
            conn.sock.settimeout(answer_s)
            conn.request("GET", base + path, headers={**self.headers, **(headers or {})})
            response = conn.getresponse()
            conn.sock.settimeout(self.stall_timeout_s)  # the body's reads from here on
        except TimeoutError as exc:
            self.drop(url)
            waited = self.connect_timeout_s if stage == "connect" else answer_s
            what = "no connection" if stage == "connect" else "no answer"
            raise TimeoutError(f"{what} from {url} within {waited:.1f} s") from exc
        except (OSError, http.client.HTTPException):
            self.drop(url)
            raise
        self._cache()[url] = (conn, time.monotonic())
        return response

    def get_bytes(
        self, url: str, path: str, limit: int, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """Status and body (at most ``limit`` bytes) of a small GET."""
        resp = self.get(url, path, timeout_s=timeout_s)
        try:
            length = int(resp.getheader("content-length") or -1)
            if length > limit:
                raise http.client.HTTPException(
                    f"{url}{path}: body of {length} bytes exceeds {limit}"
                )
            body = resp.read(limit + 1)
            if len(body) > limit:
                raise http.client.HTTPException(f"{url}{path}: body exceeds {limit} bytes")
            return resp.status, body
        except (OSError, http.client.HTTPException):
            self.drop(url)
            raise


Sink = Callable[[int, memoryview], None]


def _expect_range(resp: http.client.HTTPResponse, start: int, size: int) -> None:
    """Check a 200/206 answer covers exactly bytes [start, size) of the object."""
    length = int(resp.getheader("content-length") or -1)
    if resp.status == 206:
        want = f"bytes {start}-{size - 1}/{size}"
        if resp.getheader("content-range") != want or length != size - start:
            raise http.client.HTTPException(f"bad range answer {resp.getheader('content-range')}")
    elif resp.status == 200:
        if start != 0 or length != size:
            raise http.client.HTTPException(f"full answer of {length} bytes, want {size - start}")
    else:
        raise http.client.HTTPException(f"unexpected status {resp.status}")


def download_object(
    pool: SourcePool,
    conns: Connections,
    path: str,
    size: int,
    digest: str,
    algorithm: str,
    sink: Sink,
    *,
    version: int,
    what: str,
    deadline: float,
    abort: threading.Event,
    max_attempts: int,
    answer_s: float | None = None,
) -> None:
    """Fetch ``path`` (``size`` bytes, signed ``digest``) into ``sink``; see module docstring.

    ``answer_s``: how long a source may take to answer (default: ``conns.stall_timeout_s``).
    """
    got, hasher = 0, new_hasher(algorithm)
    contributors: set[str] = set()
    excluded: set[str] = set()  # corrupt or missing for this object
    tainted: set[str] = set()  # of those, the ones that served corrupt bytes: a last resort
    broke: set[str] = set()  # cut a transfer of this object short: avoided while others remain
    attempts, last_error = 0, "no attempt made"
    last_was_corrupt = False  # the last failed attempt assembled bytes that missed the digest
    last_url: str | None = None  # the source of the last bytes received
    buf = memoryview(bytearray(min(CHUNK, max(size, 1))))
    while True:
        if abort.is_set():
            raise FetchAborted
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"v{version} {what}: deadline passed while downloading ({last_error})"
            )
        if got == size:
            if hasher.hexdigest() == digest:
                return
            for url in contributors:
                pool.corrupt(url, version, what, "digest mismatch")
            excluded |= contributors
            tainted |= contributors
            last_error, last_was_corrupt = f"digest mismatch from {sorted(contributors)}", True
            got, hasher, contributors = 0, new_hasher(algorithm), set()
            attempts += 1
        if attempts >= max_attempts:
            if last_was_corrupt:
                raise CorruptData(
                    f"v{version} {what}: no source served the signed bytes in {attempts} tries "
                    f"(corrupt bytes, {last_error})"
                )
            raise PeerUnavailable(
                f"v{version} {what}: gave up after {attempts} tries ({last_error})"
            )
        url = (
            pool.choose(excluded | broke)
            or pool.choose(excluded)
            or pool.choose(excluded - tainted)  # only corrupt ones left: try one again
        )
        if url is None:
            if any(pool.stats[u].corrupt for u in excluded):
                raise CorruptData(
                    f"v{version} {what}: every source served corrupt bytes ({last_error})"
                )
            raise ObjectMissing(f"v{version} {what}: no source has it ({last_error})")
        if got and url != last_url:
            log.info(
                "v%d %s: resuming at byte %d of %d from %s (%s)",
                version,
                what,
                got,
                size,
                url,
                last_error,
            )
        started, before = time.monotonic(), got
        try:
            resp = conns.get(
                url, path, {"Range": f"bytes={got}-{size - 1}"} if got else None, answer_s
            )
            if resp.status == 404:
                resp.read()
                excluded.add(url)
                last_error, last_was_corrupt = f"{url}: 404", False
                continue
            if resp.status == 503:  # still arriving at that relay: wait a little, no penalty
                resp.read()
                last_error, last_was_corrupt = f"{url}: 503 not yet available", False
                time.sleep(min(float(resp.getheader("retry-after") or 0.2), 1.0))
                continue
            _expect_range(resp, got, size)
            contributors.add(url)
            last_url = url
            while got < size:
                if abort.is_set():
                    conns.drop(url)
                    raise FetchAborted
                try:
                    n = resp.readinto(buf[: min(len(buf), size - got)])
                except TimeoutError as exc:
                    raise TimeoutError(
                        f"no byte from {url} for {conns.stall_timeout_s:.1f} s "
                        f"at byte {got} of {size}"
                    ) from exc
                if not n:
                    raise http.client.IncompleteRead(b"", size - got)
                chunk = buf[:n]
                hasher.update(chunk)
                try:
                    sink(got, chunk)
                except OSError as exc:
                    raise DiskWriteError(
                        f"v{version} {what}: writing to disk failed: {exc}"
                    ) from exc
                got += n
            pool.success(url, got - before, time.monotonic() - started)
        except (OSError, http.client.HTTPException) as exc:
            conns.drop(url)
            if pool.failure(url, exc):  # silent: the requests waiting on it go elsewhere now
                conns.abort(url)
            broke.add(url)
            attempts += 1
            last_error, last_was_corrupt = f"{url}: {type(exc).__name__}: {exc}", False
