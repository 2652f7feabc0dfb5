"""Append-only segment files: many small keyed records in a few large files of one folder.

The rollout store keeps each submission's signed body as one record here instead of one file
per submission: creating, writing and renaming a small file cost a submission ~0.5 ms of CPU,
most of it in the kernel, where appending a record to an open file costs a few microseconds.

A record, big-endian::

    b"SWSG" | key length: u16 | data length: u32 | key (UTF-8) | data

A data length of ``0xFFFFFFFF`` (no data follows) is a tombstone: the key was deleted. Each
writing process appends to a segment of its own, named ``<ns since epoch>-<pid>-<random>.seg``
(so names sort by creation), opened with ``O_EXCL`` and never reopened for writing; a new one is
started past ``segment_bytes``, after a failed write, and in a forked child. A write is one
``write`` call; a failed or short one is cut off again (``ftruncate``) before the error is
raised, so a segment holds whole records followed at most by the torn tail of a crash.

A record is read back at its :class:`Location` (what the writer was told), or found by key
(:meth:`SegmentLog.find`, reading what was appended to the folder's segments since its last
look, segments in name order, i.e. by creation; of a key's records the one read last wins, and
a tombstone hides the key). A scan stops at a segment's first record that is not whole. Knows
nothing about what the records hold.
"""

from __future__ import annotations

import errno
import os
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"SWSG"
HEADER = struct.Struct(">4sHI")  # magic, key length, data length
TOMBSTONE = 0xFFFFFFFF
MAX_KEY_BYTES = 0xFFFF
MAX_DATA_BYTES = TOMBSTONE - 1
SEGMENT_BYTES = 256 * 1024**2
SEGMENT_NAME = re.compile(r"^\d{20}-\d+-[0-9a-f]{8}\.seg$")
_LOCATION = re.compile(r"^(?P<segment>[^/@+]+\.seg)@(?P<offset>\d+)\+(?P<length>\d+)$")


@dataclass(frozen=True)
class Location:
    """Where a record's data lies: ``length`` bytes at byte ``offset`` of ``segment`` (a file
    name in the log's folder); ``str()`` gives ``<segment>@<offset>+<length>``."""

    segment: str
    offset: int
    length: int

    def __str__(self) -> str:
        return f"{self.segment}@{self.offset}+{self.length}"

    @classmethod
    def parse(cls, text: str) -> Location:
        """The location written by ``str()``; :class:`ValueError` for anything else."""
        match = _LOCATION.match(text)
        if match is None or not SEGMENT_NAME.match(match["segment"]):
            raise ValueError(f"{text!r} is not a segment location")
        return cls(match["segment"], int(match["offset"]), int(match["length"]))


class SegmentLog:
    """The segments of one folder: this process appends to one of its own, and reads any."""

    def __init__(self, folder: str, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = folder
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._name = ""
        self._size = 0
        self._pid = 0
        # the scan behind find(): where each key's last record is (None: deleted), and how far
        # into each segment the scan has read
        self._index: dict[str, Location | None] = {}
        self._scanned: dict[str, int] = {}

    def append(self, key: str, data: bytes) -> Location:
        """Append ``data`` under ``key``; where it went. :class:`OSError` if it could not be
        written whole (nothing of it is left in the segment then)."""
        if len(data) > MAX_DATA_BYTES:
            raise ValueError(f"a record holds at most {MAX_DATA_BYTES} bytes, not {len(data)}")
        segment, offset = self._write(key, data, len(data))
        return Location(segment, offset, len(data))

    def delete(self, key: str) -> None:
        """Append a tombstone: :meth:`find` no longer finds ``key`` (records already written
        stay readable at their locations)."""
        self._write(key, b"", TOMBSTONE)

    def _write(self, key: str, data: bytes, length: int) -> tuple[str, int]:
        """Append one record; the segment it went to and the offset of its data."""
        name = key.encode()
        if not name or len(name) > MAX_KEY_BYTES:
            raise ValueError(f"a record's key is 1 to {MAX_KEY_BYTES} bytes, not {len(name)}")
        record = HEADER.pack(MAGIC, len(name), length) + name + data
        with self._lock:
            fd = self._writable()
            start = self._size
            try:
                written = os.write(fd, record)
                if written != len(record):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(record)} bytes")
            except OSError:
                self._abandon(start)
                raise
            self._size = start + written
            return self._name, start + HEADER.size + len(name)

    def _writable(self) -> int:
        if self._fd is not None and (self._pid != os.getpid() or self._size >= self.segment_bytes):
            if self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None  # a forked child's copy of the parent's segment is not its own
        if self._fd is None:
            os.makedirs(self.folder, exist_ok=True)
            self._pid = os.getpid()
            self._name = f"{time.time_ns():020d}-{self._pid}-{uuid.uuid4().hex[:8]}.seg"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(os.path.join(self.folder, self._name), flags, 0o644)
            self._size = 0
        return self._fd

    def _abandon(self, size: int) -> None:
        """Cut a failed write off the segment and start the next write in a new one; a segment
        left with nothing in it is removed (on a full disk every write would leave one)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass  # a torn tail, which a scan stops at; the records before it stay readable
        finally:
            os.close(fd)
        if size == 0:
            try:
                os.unlink(os.path.join(self.folder, self._name))
            except OSError:
                pass  # an empty segment is read as one without records

    def read(self, location: Location, key: str) -> bytes:
        """The data of ``key``'s record at ``location``; :class:`ValueError` if the bytes
        there are not that record, :class:`OSError` if the segment cannot be read."""
        name = key.encode()
        start = location.offset - HEADER.size - len(name)
        if start < 0:
            raise ValueError(f"{location} cannot hold a record of {key!r}")
        fd = os.open(os.path.join(self.folder, location.segment), os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, HEADER.size + len(name) + location.length, start)
        finally:
            os.close(fd)
        head = raw[: HEADER.size]
        if len(head) < HEADER.size or HEADER.unpack(head) != (MAGIC, len(name), location.length):
            raise ValueError(f"no record of {key!r} at {location}")
        if raw[HEADER.size : HEADER.size + len(name)] != name:
            raise ValueError(f"the record at {location} is not {key!r}'s")
        data = raw[HEADER.size + len(name) :]
        if len(data) != location.length:
            raise ValueError(f"the record at {location} is cut short")
        return data

    def find(self, key: str) -> Location | None:
        """Where ``key``'s last record is, or None where it has none or was deleted."""
        with self._lock:
            self._scan()
            return self._index.get(key)

    def _scan(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.folder) if SEGMENT_NAME.match(n))
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(self.folder, name)
            try:
                size = os.stat(path).st_size  # what is appended later: the next scan's
            except FileNotFoundError:
                continue  # an empty segment its writer removed (``_abandon``)
            if size <= self._scanned.get(name, 0):
                continue
            with open(path, "rb") as handle:
                handle.seek(self._scanned.get(name, 0))
                self._scanned[name] = self._scan_from(handle, name, size)

    def _scan_from(self, handle: BinaryIO, name: str, size: int) -> int:
        """Index the whole records from the handle's position up to ``size``; the offset
        after the last of them."""
        position = handle.tell()
        while True:
            head = handle.read(HEADER.size)
            if len(head) < HEADER.size or position + HEADER.size > size:
                return position
            magic, key_length, length = HEADER.unpack(head)
            raw_key = handle.read(key_length)
            if magic != MAGIC or len(raw_key) < key_length:
                return position
            try:
                key = raw_key.decode()
            except UnicodeDecodeError:
                return position
            data_at = position + HEADER.size + key_length
            if data_at > size:
                return position
            if length == TOMBSTONE:
                self._index[key] = None
                position = data_at
                continue
            end = data_at + length
            if end > size:
                return position  # a torn tail, or a record still being written
            handle.seek(end)
            self._index[key] = Location(name, data_at, length)
            position = end
