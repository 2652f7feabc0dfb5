"""Where received bytes hit the disk: through the page cache, or straight to it (``O_DIRECT``).

A download hands its bytes to an :class:`ObjectSink` (one per shard or delta blob being
fetched), in order, each chunk after it was fed to the digest; the sink's ``finish`` runs
before the object counts as verified, so when a relay marks a shard servable or a client
renames a version ready, every byte of it is in the file.

- :class:`FileWriter` writes each chunk at once with ``pwrite`` into the page cache. Relays
  use it: they serve what they receive, and ``sendfile`` serves it from that cache.
- :class:`DirectFileWriter` gathers chunks in an aligned buffer and writes whole blocks with
  ``O_DIRECT``: the bytes go from that buffer to the disk without a page-cache copy. Clients
  use it (``shardcast.direct_writes``): a fetched checkpoint is read once, by the loader, and
  staging gigabytes in the page cache costs a copy per byte plus a fresh page per 4 KiB (on
  VMs that hand freed memory back to the host, a host fault each) and evicts what the machine
  had cached. Objects that do not start on a block boundary, a final partial block, and
  filesystems without ``O_DIRECT`` (tmpfs) go through the page cache.

Knows nothing about digests, HTTP or manifests.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

ALIGN = 4096  # O_DIRECT offsets, lengths and buffers: a multiple of the logical block size
STAGE = 1 << 20  # bytes gathered before one direct write; a multiple of ALIGN


class ObjectSink:
    """Takes the bytes of one object at ``base`` of an open file, through ``writer.write``."""

    def __init__(self, writer: FileWriter, fd: int, base: int) -> None:
        self.writer, self.fd, self.base = writer, fd, base

    def write(self, offset: int, data: memoryview) -> None:
        """Bytes ``[offset, offset + len(data))`` of the object (offset 0 again restarts it)."""
        self.writer.write(self.fd, self.base + offset, data)

    def finish(self) -> None:
        """Every byte written so far is in the file when this returns."""

    def close(self) -> None:
        """Release what the sink holds (after ``finish``, or instead of it on failure)."""


class FileWriter:
    """Writes received bytes at an offset of an open file, through the page cache.

    One write at a time per file: buffered writes into one file serialise on its inode lock
    in the kernel, where the waiting downloader threads spin and burn the CPU the sender
    needs; here they sleep on a lock of ours instead. Bytes go from the receive buffer
    straight into the page cache (no intermediate copy).
    """

    _guard = threading.Lock()

    def _lock_for(self, fd: int) -> threading.Lock:
        with FileWriter._guard:
            locks: dict[int, threading.Lock] = self.__dict__.setdefault("_locks", {})
            return locks.setdefault(fd, threading.Lock())

    def write(self, fd: int, offset: int, data: memoryview) -> None:
        with self._lock_for(fd):
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written

    def sink(self, fd: int, base: int) -> ObjectSink:
        """A sink for one object at ``base`` of ``fd``."""
        return ObjectSink(self, fd, base)


class _DirectSink(ObjectSink):
    """Gathers an object's bytes in an aligned buffer and writes full blocks with ``O_DIRECT``.

    Invariant: ``stage[:fill]`` holds object bytes ``[pos, pos + fill)``, not yet written;
    every byte before ``pos`` is in the file; ``pos`` is a multiple of ``STAGE``.
    """

    def __init__(self, writer: DirectFileWriter, fd: int, base: int, direct_fd: int) -> None:
        super().__init__(writer, fd, base)
        self.direct_fd: int | None = direct_fd
        self.stage = writer.stage()
        self.pos = self.fill = 0

    def write(self, offset: int, data: memoryview) -> None:
        if offset == 0 and self.pos + self.fill != 0:  # the download starts over
            self.pos = self.fill = 0
        if offset != self.pos + self.fill:
            raise ValueError(f"out-of-order write at {offset}, expected {self.pos + self.fill}")
        while data:
            n = min(len(data), STAGE - self.fill)
            self.stage[self.fill : self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]
            if self.fill == STAGE:
                self._flush(STAGE)
                self.pos, self.fill = self.pos + STAGE, 0

    def _flush(self, length: int) -> None:
        """Write ``stage[:length]`` (``length`` a multiple of ``ALIGN``) at ``pos``."""
        view = self.stage[:length]
        if self.direct_fd is not None:
            try:
                self.writer.write(self.direct_fd, self.base + self.pos, view)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)  # this filesystem takes no direct writes after all
                self.direct_fd = None
        self.writer.write(self.fd, self.base + self.pos, view)

    def finish(self) -> None:
        whole = self.fill - self.fill % ALIGN
        if whole:
            self._flush(whole)
        if self.fill > whole:  # the object's last partial block: through the page cache
            tail = self.stage[whole : self.fill]
            self.writer.write(self.fd, self.base + self.pos + whole, tail)
        self.pos, self.fill = self.pos + self.fill, 0

    def close(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None


class DirectFileWriter(FileWriter):
    """A :class:`FileWriter` whose downloads bypass the page cache (see module docstring)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def stage(self) -> memoryview:
        """This thread's aligned staging buffer (an anonymous mapping is page-aligned)."""
        buf = getattr(self._local, "stage", None)
        if buf is None:
            buf = self._local.stage = memoryview(mmap.mmap(-1, STAGE))
        return buf

    def sink(self, fd: int, base: int) -> ObjectSink:
        if base % ALIGN or not hasattr(os, "O_DIRECT"):
            return super().sink(fd, base)
        try:  # a second descriptor of the same file, opened for direct writes
            direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
        except OSError:  # no /proc, or a filesystem without O_DIRECT (tmpfs)
            return super().sink(fd, base)
        return _DirectSink(self, fd, base, direct_fd)
