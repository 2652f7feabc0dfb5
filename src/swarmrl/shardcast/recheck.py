"""Re-verify the versions a store already holds, before anything serves or loads them.

A version was verified when it arrived, but disks rot, files get edited and a crash can
leave a file short: at start-up every ready version is read back and checked against its
manifest (the manifest's signature by a trusted publisher when keys are given, every
shard's size and digest, every delta blob's digest). A version that fails is removed (renamed
aside, then deleted) so it is fetched again from a peer instead of being served or loaded.

Knows nothing about HTTP or where a version came from.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from swarmrl.errors import PeerError
from swarmrl.protocol.shardcast import Manifest
from swarmrl.shardcast import store
from swarmrl.shardcast.manifest import digest_bytes, new_hasher, verify_manifest

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20


def _file_digest(path: Path, algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    with open(path, "rb") as handle:
        while block := handle.read(READ_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _problem_in_files(directory: Path, manifest: Manifest) -> str | None:
    algorithm = manifest.digest_algorithm
    for entry in manifest.files:
        path = directory / entry.path
        if not path.is_file() or path.stat().st_size != entry.size:
            return f"{entry.path} is missing or not {entry.size} bytes"
        with open(path, "rb") as handle:
            for shard in entry.shards:
                data = os.pread(handle.fileno(), shard.size, shard.offset)
                if digest_bytes(algorithm, data) != shard.digest:
                    return f"{entry.path}: shard {shard.index} does not match its signed digest"
    for delta in manifest.deltas:  # kept only when the version arrived as a delta
        blob = store.delta_path(directory, delta.index)
        if blob.is_file() and _file_digest(blob, algorithm) != delta.digest:
            return f"delta {delta.index} does not match its signed digest"
    return None


def recheck_version(directory: Path, version: int, trusted: Sequence[str] | None) -> str | None:
    """Why the stored ``version`` in ``directory`` cannot be trusted, or None when it is sound."""
    try:
        manifest = store.load_manifest(directory)
    except (OSError, ValueError, ValidationError) as exc:
        return (
            f"unreadable manifest: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        )
    if manifest.version != version:
        return f"the manifest in {directory.name} is for v{manifest.version}"
    if trusted is not None:
        try:
            verify_manifest(manifest, trusted, expected_version=version)
        except PeerError as exc:
            return f"manifest: {type(exc).__name__}: {exc}"
    try:
        return _problem_in_files(directory, manifest)
    except OSError as exc:
        return f"cannot read it back: {exc}"


def recheck_store(root: Path, trusted: Sequence[str] | None = None) -> list[tuple[int, str]]:
    """Recheck every ready version under ``root``; remove the bad ones. Returns (version, why)."""
    removed = []
    for version in store.ready_versions(root):
        directory = store.ready_dir(root, version)
        problem = recheck_version(directory, version, trusted)
        if problem is None:
            continue
        log.warning("stored v%d in %s is damaged (%s); removing it", version, root, problem)
        victim = root / f".deleting-{directory.name}-{secrets.token_hex(3)}"
        try:
            os.rename(directory, victim)
        except FileNotFoundError:
            continue  # removed meanwhile
        shutil.rmtree(victim, ignore_errors=True)
        removed.append((version, problem))
    return removed
