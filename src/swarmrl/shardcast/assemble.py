"""Assemble a verified version in a partial directory: reuse, delta, or download each file.

For every file of the manifest, cheapest first:

1. **reuse** — the parent version we hold has the same file with the same shard digests:
   copy it locally;
2. **delta** — the manifest carries a delta from the parent we hold: fetch its blobs (one per
   byte range of the file, in parallel, each checked against its signed digest and passed on
   through ``on_delta`` at once), XOR each onto its range of the parent file;
3. **download** — fetch its shards from the sources in parallel.

Whatever path produced a file's bytes, each shard is checked against its signed digest before
it counts (reused and delta-built files are re-hashed from disk), and a failed reuse or delta
falls back to downloading. Bytes go straight into the final files (preallocated, written at
offsets by a ``writers.FileWriter``: through the page cache, or around it with ``O_DIRECT``). Marking the version ready is the caller's job, and only after this returns.

Knows nothing about where the version goes afterwards (client dir or relay store).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.errors import InfraError, PeerError, WaitTimeout
from swarmrl.protocol.shardcast import DeltaEntry, FileEntry, Manifest, ShardEntry
from swarmrl.shardcast import delta as delta_codec
from swarmrl.shardcast import store
from swarmrl.shardcast.manifest import digest_bytes
from swarmrl.shardcast.transport import (
    Connections,
    DiskWriteError,
    FetchAborted,
    SourcePool,
    download_object,
)
from swarmrl.shardcast.writers import FileWriter

__all__ = ["Assembly", "AssemblyReport", "FileWriter"]

log = logging.getLogger(__name__)


@dataclass
class AssemblyReport:
    """How each file of a version was obtained, and how many bytes crossed the network."""

    reused: list[str] = field(default_factory=list)
    from_delta: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    delta_failures: list[str] = field(default_factory=list)
    network_bytes: int = 0


def _preallocate(fd: int, size: int) -> None:
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)  # fails now, not mid-transfer, when the disk is full
    except OSError as exc:
        if exc.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: filesystem cannot preallocate
            raise
        os.ftruncate(fd, size)


def _verify_file_on_disk(fd: int, entry: FileEntry, algorithm: str) -> None:
    for shard in entry.shards:
        data = os.pread(fd, shard.size, shard.offset)
        if digest_bytes(algorithm, data) != shard.digest:
            raise ValueError(f"{entry.path}: shard {shard.index} does not match after rebuild")


class Assembly:
    """One version being assembled into ``partial`` (see module docstring)."""

    def __init__(
        self,
        manifest: Manifest,
        partial: Path,
        pool: SourcePool,
        conns: Connections,
        *,
        parent_dir: Path | None,
        parent: Manifest | None,
        writer: FileWriter,
        parallel: int,
        deadline: float,
        answer_s: float | None = None,
        on_shard: Callable[[int], None] = lambda index: None,
        on_delta: Callable[[int], None] = lambda index: None,
    ) -> None:
        self.m, self.partial, self.pool, self.conns = manifest, partial, pool, conns
        self.answer_s = answer_s  # how long a source may take to answer a shard or delta GET
        self.parent_dir, self.parent = parent_dir, parent
        self.writer, self.parallel, self.deadline = writer, parallel, deadline
        self.on_shard, self.on_delta = on_shard, on_delta
        self.abort = threading.Event()
        self.report = AssemblyReport()
        self._fds: dict[str, int] = {}
        self._bytes_lock = threading.Lock()

    def _max_attempts(self) -> int:
        return 2 * len(self.pool.urls) + 3

    def _count(self, n: int) -> None:
        with self._bytes_lock:
            self.report.network_bytes += n

    def _download(self, path: str, size: int, digest: str, what: str, fd: int, base: int) -> None:
        """Fetch one object into ``fd`` at ``base``; every byte is in the file on return."""
        out = self.writer.sink(fd, base)

        def sink(offset: int, data: memoryview) -> None:
            out.write(offset, data)
            self._count(len(data))

        try:
            download_object(
                self.pool,
                self.conns,
                path,
                size,
                digest,
                self.m.digest_algorithm,
                sink,
                version=self.m.version,
                what=what,
                deadline=self.deadline,
                abort=self.abort,
                max_attempts=self._max_attempts(),
                answer_s=self.answer_s,
            )
            try:
                out.finish()
            except OSError as exc:
                raise DiskWriteError(
                    f"v{self.m.version} {what}: writing to disk failed: {exc}"
                ) from exc
        finally:
            out.close()

    def run(self) -> AssemblyReport:
        try:
            for entry in self.m.files:
                target = self.partial / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds[entry.path] = fd
                try:
                    _preallocate(fd, entry.size)
                except OSError as exc:
                    raise DiskWriteError(
                        f"v{self.m.version}: cannot allocate {entry.path}: {exc}"
                    ) from exc
            pending = [e for e in self.m.files if not self._local_copy(e)]
            self.report.downloaded = [e.path for e in pending]
            self._download_shards([s for e in pending for s in e.shards])
        finally:
            for fd in self._fds.values():
                os.close(fd)
        return self.report

    def _local_copy(self, entry: FileEntry) -> bool:
        """Try reuse, then delta; True when the file is complete and verified."""
        if self.parent is None or self.parent_dir is None:
            return False
        fd = self._fds[entry.path]
        old = next((f for f in self.parent.files if f.path == entry.path), None)
        if old is not None and [s.digest for s in old.shards] == [s.digest for s in entry.shards]:
            try:
                with (
                    open(self.parent_dir / entry.path, "rb") as src,
                    open(fd, "wb", closefd=False) as dst,
                ):
                    shutil.copyfileobj(src, dst, 8 << 20)
                _verify_file_on_disk(fd, entry, self.m.digest_algorithm)
                self._mark_file(entry)
                self.report.reused.append(entry.path)
                return True
            except (OSError, ValueError) as exc:
                log.warning(
                    "v%d: reusing %s from the parent failed: %s", self.m.version, entry.path, exc
                )
        parts = [
            d
            for d in self.m.deltas
            if d.path == entry.path and d.parent_version == self.parent.version
        ]
        return bool(parts) and self._apply_deltas(entry, parts)

    def _apply_deltas(self, entry: FileEntry, parts: list[DeltaEntry]) -> bool:
        """Rebuild ``entry`` from the parent's copy and its delta ``parts`` (each a byte range,
        fetched in parallel, each served on through ``on_delta`` once its blob is verified);
        True when the file verifies, else False and it is downloaded in full."""
        fd = self._fds[entry.path]
        fetched: list[int] = []

        def one(part: DeltaEntry) -> None:
            blob = store.delta_path(self.partial, part.index)
            blob_fd = os.open(blob, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self._download(
                    f"/v/{self.m.version}/delta/{part.index}",
                    part.size,
                    part.digest,
                    f"delta {part.index}",
                    blob_fd,
                    0,
                )
            finally:
                os.close(blob_fd)
            fetched.append(part.index)
            self.on_delta(part.index)  # verified bytes: a relay may pass them on now
            delta_codec.apply_delta(
                self.parent_dir / entry.path,  # type: ignore[operator]
                blob,
                fd,
                entry.size,
                offset=part.offset,
                length=part.length,
            )

        try:
            with ThreadPoolExecutor(max_workers=min(self.parallel, len(parts))) as executor:
                outcomes = [executor.submit(one, part) for part in parts]
            errors = [f.exception() for f in outcomes if f.exception() is not None]
            disk = [e for e in errors if isinstance(e, DiskWriteError)]
            if disk:
                raise disk[0]
            if errors:
                raise errors[0]  # type: ignore[misc]
            _verify_file_on_disk(fd, entry, self.m.digest_algorithm)
        except (PeerError, InfraError, ValueError, OSError) as exc:
            if isinstance(exc, DiskWriteError):
                raise
            # a source out of reach is not a bad delta: the full download that follows meets
            # the same sources and tells their absence its own way
            log.log(
                logging.DEBUG if isinstance(exc, InfraError) else logging.WARNING,
                "v%d: delta for %s unusable, downloading it in full: %s",
                self.m.version,
                entry.path,
                exc,
            )
            self.report.delta_failures.append(f"{entry.path}: {exc}")
            for part in parts:
                if part.index not in fetched:  # a verified blob may already be passed on
                    store.delta_path(self.partial, part.index).unlink(missing_ok=True)
            return False
        self._mark_file(entry)
        self.report.from_delta.append(entry.path)
        return True

    def _mark_file(self, entry: FileEntry) -> None:
        for shard in entry.shards:
            self.on_shard(shard.index)

    def _download_shards(self, shards: list[ShardEntry]) -> None:
        if not shards:
            return
        owner = {s.index: f for f in self.m.files for s in f.shards}

        def one(shard: ShardEntry) -> None:
            entry = owner[shard.index]
            self._download(
                f"/v/{self.m.version}/shard/{shard.index}",
                shard.size,
                shard.digest,
                f"shard {shard.index} ({entry.path})",
                self._fds[entry.path],
                shard.offset,
            )
            self.on_shard(shard.index)

        with ThreadPoolExecutor(max_workers=min(self.parallel, len(shards))) as executor:
            futures = [executor.submit(one, s) for s in shards]
            budget = max(0.0, self.deadline - time.monotonic()) + 5.0
            _, not_done = wait(futures, timeout=budget, return_when=FIRST_EXCEPTION)
            self.abort.set()  # stragglers (if any) stop at their next chunk
        errors = [f.exception() for f in futures if f.exception() is not None]
        real = [e for e in errors if not isinstance(e, FetchAborted)]
        if real:
            raise real[0]
        if errors or not_done:
            raise WaitTimeout(
                f"v{self.m.version}: shard downloads did not finish before the deadline"
            )
