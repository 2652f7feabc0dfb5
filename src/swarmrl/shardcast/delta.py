"""Delta blobs between two same-sized files: XOR of bit patterns, byte planes, zstd.

Encoding ``xor-planes2-zstd``, applied per chunk of ``CHUNK_BYTES`` (even) bytes::

    x      = new ^ old                          # bytes; 0 wherever a bit pattern is unchanged
    planes = x[0::2] ++ x[1::2]                 # low bytes, then high bytes of each 16-bit word
    blob   = zstd(planes_chunk_0 ++ planes_chunk_1 ++ …)      (one zstd frame)

and back: ``new = old ^ unplanes(unzstd(blob))``. For bf16 weights after a small-learning-rate
step most words are unchanged (x = 0), and of the changed ones mostly the low mantissa bits
flip, so the high-byte plane is almost all zeros and compresses to nearly nothing. A file's
safetensors header is identical between versions of one model, so it XORs to zeros too.

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


def encode_delta(old_path: Path, new_path: Path, out_path: Path, level: int = 3) -> int:
    """Write the delta blob rebuilding ``new_path`` from ``old_path``; return its size."""
    size = os.path.getsize(new_path)
    if os.path.getsize(old_path) != size:
        raise ValueError(f"delta needs same-sized files: {old_path} vs {new_path}")
    compressor = zstandard.ZstdCompressor(level=level, threads=-1)
    with (
        open(old_path, "rb") as old,
        open(new_path, "rb") as new,
        open(out_path, "wb") as out,
        compressor.stream_writer(out, size=size, closefd=False) as writer,
    ):
        while True:
            a = new.read(CHUNK_BYTES)
            if not a:
                break
            b = old.read(len(a))
            x = np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)
            writer.write(_to_planes(x))
    return os.path.getsize(out_path)


def apply_delta(old_path: Path, blob_path: Path, out_fd: int, size: int) -> None:
    """Write ``old ^ delta`` (``size`` bytes) into ``out_fd`` at offset 0.

    Raises ``ValueError`` when the blob is not valid zstd or decodes to the wrong length;
    the caller still verifies the result against the signed digests.
    """
    if os.path.getsize(old_path) != size:
        raise ValueError(f"parent file {old_path} has the wrong size for this delta")
    decompressor = zstandard.ZstdDecompressor()
    offset = 0
    try:
        with (
            open(old_path, "rb") as old,
            open(blob_path, "rb") as blob,
            decompressor.stream_reader(blob) as reader,
        ):
            while offset < size:
                want = min(CHUNK_BYTES, size - offset)
                planes = reader.read(want)
                while len(planes) < want:
                    more = reader.read(want - len(planes))
                    if not more:
                        raise ValueError(f"delta blob ends early at byte {offset + len(planes)}")
                    planes += more
                x = _from_planes(np.frombuffer(planes, np.uint8))
                base = np.frombuffer(old.read(want), np.uint8)
                os.pwrite(out_fd, (x ^ base).tobytes(), offset)
                offset += want
            if reader.read(1):
                raise ValueError("delta blob is longer than the file it rebuilds")
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta blob is not valid zstd: {exc}") from exc
