"""On-disk layout of versions, shared by the publisher, origins, relays and clients.

::

    ROOT/
      v00000012/                      a ready version: the checkpoint files, as published
        config.json, model.safetensors, tokenizer.json, …
        _shardcast/manifest.json      the signed manifest (written last)
        _shardcast/delta-0.bin        delta blobs from the parent (if any)
      .partial-v00000013-1a2b3c/      a version still being written; never read as ready

A version becomes ready only by renaming its complete, verified partial directory to
``vNNNNNNNN`` (one atomic ``rename``), so a reader sees all of it or none of it. Every file
and directory of the partial is fsynced before that rename, and the store directory after
it, so a power cut never leaves a ready name over unwritten data.

Knows nothing about HTTP, signatures or how the bytes arrived.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

from swarmrl.protocol.shardcast import Manifest

META_DIR = "_shardcast"
MANIFEST_NAME = "manifest.json"
_READY = re.compile(r"^v(\d{8})$")


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def manifest_path(version_dir: Path) -> Path:
    return version_dir / META_DIR / MANIFEST_NAME


def delta_path(version_dir: Path, index: int) -> Path:
    return version_dir / META_DIR / f"delta-{index}.bin"


def ready_versions(root: Path) -> list[int]:
    """Ready versions under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _READY.match(child.name)
        if match and manifest_path(child).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def ready_dir(root: Path, version: int) -> Path:
    return root / version_dir_name(version)


def load_manifest(version_dir: Path) -> Manifest:
    """The manifest stored with a version we wrote ourselves (trusted local disk)."""
    return Manifest.model_validate_json(manifest_path(version_dir).read_bytes())


def write_manifest(version_dir: Path, manifest: Manifest) -> None:
    """Write the manifest via a temporary file and ``rename`` (never half a manifest, and no
    temporary file left behind when the write fails)."""
    target = manifest_path(version_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(manifest.model_dump_json().encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def sync_dir(path: Path) -> None:
    """fsync a directory, so the names in it (creations, renames) survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """fsync every regular file under ``path``, then every directory, deepest first."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(Path(dirpath))


def new_partial(root: Path, version: int) -> Path:
    """A fresh, empty directory to assemble ``version`` in."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".partial-{version_dir_name(version)}-{secrets.token_hex(3)}"
    path.mkdir()
    (path / META_DIR).mkdir()
    return path


def promote(partial: Path, root: Path, version: int) -> Path:
    """Atomically make a complete partial directory the ready version; return its path."""
    target = ready_dir(root, version)
    if target.exists():
        raise FileExistsError(f"version {version} is already ready at {target}")
    sync_tree(partial)  # data before name: the rename must never outlive unwritten bytes
    os.rename(partial, target)
    sync_dir(root)
    return target


def discard(path: Path) -> None:
    """Remove a partial directory (best effort: it is never read as ready anyway)."""
    shutil.rmtree(path, ignore_errors=True)


def discard_stale_partials(root: Path) -> list[str]:
    """Remove leftover partial/deleting directories (call only when this process owns ``root``)."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith((".partial-", ".deleting-"))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


def prune(root: Path, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
    """Delete all but the newest ``keep`` ready versions (never those in ``protect``)."""
    versions = ready_versions(root)
    doomed = [v for v in versions[:-keep] if v not in protect] if keep > 0 else []
    for version in doomed:
        # rename first so no reader ever sees a half-deleted ready version
        victim = root / f".deleting-{version_dir_name(version)}-{secrets.token_hex(3)}"
        os.rename(ready_dir(root, version), victim)
        shutil.rmtree(victim, ignore_errors=True)
    return doomed


def checkpoint_files(checkpoint_dir: Path) -> list[str]:
    """Relative POSIX paths of the regular files of a checkpoint dir, sorted, minus metadata."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(checkpoint_dir):
        dirnames[:] = sorted(d for d in dirnames if d != META_DIR)
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if full.is_file() and not full.is_symlink():
                paths.append(full.relative_to(checkpoint_dir).as_posix())
    return sorted(paths)
