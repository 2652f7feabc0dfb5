"""Delta blobs between two same-sized files: XOR of bit patterns, byte planes, zstd.

Encoding ``xor-planes2-zstd``, applied per chunk of ``CHUNK_BYTES`` (even) bytes::

    x      = new ^ old                          # bytes; 0 wherever a bit pattern is unchanged
    planes = x[0::2] ++ x[1::2]                 # low bytes, then high bytes of each 16-bit word
    blob   = zstd(planes_chunk_0 ++ planes_chunk_1 ++ …)      (one zstd frame)

and back: ``new = old ^ unplanes(unzstd(blob))``. For bf16 weights after a small-learning-rate
step most words are unchanged (x = 0), and of the changed ones mostly the low mantissa bits
flip, so the high-byte plane is almost all zeros and compresses to nearly nothing. A file's
safetensors header is identical between versions of one model, so it XORs to zeros too.

A blob may cover one byte range of the file (``offset``, ``length``; the chunks then start at
``offset``): the publisher encodes one blob per shard of a changed file, so a relay can pass on
the first parts of a file's delta while later ones still arrive, as it does with shards.

Works on files in streaming chunks, so memory stays at a few chunks whatever the file size.
Knows nothing about manifests, digests or HTTP.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zstandard

ENCODING = "xor-planes2-zstd"
CHUNK_BYTES = 8 * 1024 * 1024  # even, so 16-bit words never straddle chunks


def _to_planes(x: np.ndarray) -> bytes:
    """[n] uint8 -> low bytes ++ high bytes (++ a trailing odd byte)."""
    even = x.size - (x.size % 2)
    words = x[:even].reshape(-1, 2)  # [n/2, 2]
    return words.T.tobytes() + x[even:].tobytes()


def _from_planes(p: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_to_planes` for one chunk."""
    even = p.size - (p.size % 2)
    out = np.empty(p.size, dtype=np.uint8)
    out[:even] = p[:even].reshape(2, -1).T.reshape(-1)
    out[even:] = p[even:]
    return out


def encode_delta(
    old_path: Path,
    new_path: Path,
    out_path: Path,
    level: int = 3,
    offset: int = 0,
    length: int | None = None,
) -> int:
    """Write the delta blob rebuilding bytes [offset, offset + length) of ``new_path`` from the
    same bytes of ``old_path`` (``length`` None: to the end); return the blob's size."""
    size = os.path.getsize(new_path)
    if os.path.getsize(old_path) != size:
        raise ValueError(f"delta needs same-sized files: {old_path} vs {new_path}")
    span = _span(size, offset, length)
    compressor = zstandard.ZstdCompressor(level=level, threads=-1)
    with (
        open(old_path, "rb") as old,
        open(new_path, "rb") as new,
        open(out_path, "wb") as out,
        compressor.stream_writer(out, size=span, closefd=False) as writer,
    ):
        old.seek(offset)
        new.seek(offset)
        left = span
        while left:
            a = new.read(min(CHUNK_BYTES, left))
            if not a:
                raise ValueError(f"{new_path} ended early")
            b = old.read(len(a))
            x = np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)
            writer.write(_to_planes(x))
            left -= len(a)
    return os.path.getsize(out_path)


def _span(size: int, offset: int, length: int | None) -> int:
    """Bytes from ``offset`` a delta covers in a file of ``size`` bytes (``length`` None: to
    the end); a range outside the file is a ``ValueError``."""
    span = size - offset if length is None else length
    if offset < 0 or span < 0 or offset + span > size:
        raise ValueError(f"delta range {offset}+{length} is outside a file of {size} bytes")
    return span


def apply_delta(
    old_path: Path,
    blob_path: Path,
    out_fd: int,
    size: int,
    offset: int = 0,
    length: int | None = None,
) -> None:
    """Write ``old ^ delta`` into ``out_fd`` over bytes [offset, offset + length) of the file
    (``size`` bytes; ``length`` None: to the end).

    Raises ``ValueError`` when the blob is not valid zstd or decodes to the wrong length;
    the caller still verifies the result against the signed digests.
    """
    if os.path.getsize(old_path) != size:
        raise ValueError(f"parent file {old_path} has the wrong size for this delta")
    end = offset + _span(size, offset, length)
    decompressor = zstandard.ZstdDecompressor()
    at = offset
    try:
        with (
            open(old_path, "rb") as old,
            open(blob_path, "rb") as blob,
            decompressor.stream_reader(blob) as reader,
        ):
            old.seek(offset)
            while at < end:
                want = min(CHUNK_BYTES, end - at)
                planes = reader.read(want)
                while len(planes) < want:
                    more = reader.read(want - len(planes))
                    if not more:
                        raise ValueError(f"delta blob ends early at byte {at + len(planes)}")
                    planes += more
                x = _from_planes(np.frombuffer(planes, np.uint8))
                base = np.frombuffer(old.read(want), np.uint8)
                os.pwrite(out_fd, (x ^ base).tobytes(), at)
                at += want
            if reader.read(1):
                raise ValueError("delta blob is longer than the bytes it rebuilds")
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta blob is not valid zstd: {exc}") from exc
