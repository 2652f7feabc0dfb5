"""Digests, the root digest, and signing/checking of version manifests.

Root digest (binds every byte of a version, given collision-resistant shard digests)::

    root = H(canonical_json([[file.path, file.size, [shard.digest for shard in file.shards]]
                             for file in manifest.files]))

The signature covers ``canonical_json`` of the manifest without its ``signature`` field, so
the version number, parent, file list, delta list and root digest are all signed.

Knows nothing about HTTP or the disk layout of a store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Protocol

import blake3
from pydantic import ValidationError

from swarmrl.errors import BadSignature, CorruptData, ReplayedRequest
from swarmrl.identity import KeyPair, canonical_json, verify_signature
from swarmrl.protocol.shardcast import FileEntry, Manifest


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """An incremental hasher for ``"blake3"`` or ``"sha256"``."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def digest_bytes(algorithm: str, data: bytes | memoryview) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def root_digest(algorithm: str, files: Iterable[FileEntry]) -> str:
    """The root digest of a file list (formula in the module docstring)."""
    body = [[f.path, f.size, [s.digest for s in f.shards]] for f in files]
    return digest_bytes(algorithm, canonical_json(body))


def signing_bytes(manifest: Manifest) -> bytes:
    """The exact bytes the publisher signs."""
    return canonical_json(manifest.model_dump(mode="json", exclude={"signature"}))


def sign_manifest(manifest: Manifest, keypair: KeyPair) -> Manifest:
    """A copy of ``manifest`` with ``publisher`` set to the key and a fresh signature."""
    unsigned = manifest.model_copy(update={"publisher": keypair.public_key_hex, "signature": ""})
    return unsigned.model_copy(update={"signature": keypair.sign(signing_bytes(unsigned))})


def _check_layout(manifest: Manifest) -> None:
    """Structural invariants a correct publisher always meets."""
    expected_index = 0
    seen: set[str] = set()
    for entry in manifest.files:
        parts = entry.path.split("/")
        if entry.path.startswith("/") or ".." in parts or "" in parts or entry.path in seen:
            raise CorruptData(f"manifest v{manifest.version}: bad file path {entry.path!r}")
        seen.add(entry.path)
        offset = 0
        for shard in entry.shards:
            if shard.index != expected_index or shard.offset != offset:
                raise CorruptData(
                    f"manifest v{manifest.version}: shard {shard.index} of {entry.path} is out "
                    f"of order (want index {expected_index} at offset {offset})"
                )
            if shard.size > manifest.shard_size or (shard.size == 0 and entry.size > 0):
                raise CorruptData(f"manifest v{manifest.version}: shard {shard.index} bad size")
            offset += shard.size
            expected_index += 1
        if offset != entry.size:
            raise CorruptData(f"manifest v{manifest.version}: shards of {entry.path} do not sum")
    sizes = {f.path: f.size for f in manifest.files}
    ends: dict[tuple[str, int], int] = {}  # (file, parent) -> where its next delta must start
    for i, delta in enumerate(manifest.deltas):
        if delta.index != i or delta.path not in seen:
            raise CorruptData(f"manifest v{manifest.version}: bad delta entry {i}")
        key = (delta.path, delta.parent_version)
        end = delta.offset + (
            sizes[delta.path] - delta.offset if delta.length is None else delta.length
        )
        if delta.offset != ends.get(key, 0) or end > sizes[delta.path]:
            raise CorruptData(
                f"manifest v{manifest.version}: delta {i} of {delta.path} covers bytes "
                f"{delta.offset}-{end}, not the next ones of the file"
            )
        ends[key] = end
    for (path, _), end in ends.items():
        if end != sizes[path]:
            raise CorruptData(f"manifest v{manifest.version}: the deltas of {path} stop short")
    if manifest.root_digest != root_digest(manifest.digest_algorithm, manifest.files):
        raise CorruptData(f"manifest v{manifest.version}: root digest does not match its shards")


def parse_manifest(raw: bytes | str | dict[str, Any]) -> Manifest:
    """Parse manifest JSON from a peer; malformed input is :class:`CorruptData`."""
    try:
        data = json.loads(raw) if isinstance(raw, bytes | str) else raw
        return Manifest.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise CorruptData(f"malformed manifest: {str(exc).splitlines()[0]}") from exc


def verify_manifest(
    manifest: Manifest,
    trusted_publishers: Iterable[str],
    *,
    expected_version: int | None = None,
    held_version: int | None = None,
    allow_rollback: bool = False,
) -> Manifest:
    """Return ``manifest`` if it is signed by a trusted publisher and consistent.

    Raises :class:`BadSignature` (unsigned, forged, unknown publisher), :class:`CorruptData`
    (inconsistent layout or root digest), :class:`ReplayedRequest` (a different version than
    asked for, or older than ``held_version`` unless ``allow_rollback``).
    """
    trusted = {k.lower() for k in trusted_publishers}
    if not manifest.signature:
        raise BadSignature(f"manifest v{manifest.version} is unsigned")
    if manifest.publisher.lower() not in trusted:
        raise BadSignature(
            f"manifest v{manifest.version} is signed by unknown publisher "
            f"{manifest.publisher[:16]}…; trusted: {sorted(k[:16] for k in trusted)}"
        )
    verify_signature(manifest.publisher, signing_bytes(manifest), manifest.signature)
    if expected_version is not None and manifest.version != expected_version:
        raise ReplayedRequest(
            f"asked for manifest v{expected_version}, got a validly signed v{manifest.version}"
        )
    if held_version is not None and manifest.version < held_version and not allow_rollback:
        raise ReplayedRequest(
            f"refusing rollback: manifest is v{manifest.version}, v{held_version} is already "
            "held (pass allow_rollback to go back on purpose)"
        )
    _check_layout(manifest)
    return manifest
