"""Publish a checkpoint directory as a signed, sharded version (plus a delta from its parent).

``Publisher(store_dir, keypair).publish(checkpoint_dir, version, step)`` copies the files into
a partial directory while hashing them shard by shard, encodes delta blobs against the
parent version (the newest ready one in the store) unless this version is a keyframe, signs
the manifest, and renames the directory into place: the manifest and every shard appear at
once. Old versions beyond ``keep_versions`` are then pruned. A failed write (full disk) raises
``DiskWriteError`` and leaves neither the partial directory nor a temporary file behind.

Knows nothing about HTTP or who fetches the versions.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import DiskWriteError, MissingPathError, UserError
from swarmrl.identity import KeyPair
from swarmrl.protocol.shardcast import DeltaEntry, FileEntry, Manifest, ShardEntry
from swarmrl.shardcast import delta as delta_codec
from swarmrl.shardcast import store
from swarmrl.shardcast.manifest import digest_bytes, new_hasher, root_digest, sign_manifest

log = logging.getLogger(__name__)

# the disk cannot keep what is written: full, over quota, read-only, failing, file too large
WRITE_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def _copy_and_shard(
    src: Path, dst: Path, rel: str, first_index: int, shard_size: int, algorithm: str
) -> FileEntry:
    """Copy ``src`` to ``dst`` shard by shard, hashing each shard on the way."""
    shards: list[ShardEntry] = []
    offset = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while True:
            block = fin.read(shard_size)
            if not block and shards:
                break
            shards.append(
                ShardEntry(
                    index=first_index + len(shards),
                    offset=offset,
                    size=len(block),
                    digest=digest_bytes(algorithm, block),
                )
            )
            fout.write(block)
            offset += len(block)
            if len(block) < shard_size:
                break
        fout.flush()
        os.fsync(fout.fileno())
    return FileEntry(path=rel, size=offset, shards=shards)


def _file_digest(path: Path, algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            hasher.update(block)
    return hasher.hexdigest()


class Publisher:
    """Writes signed versions into a store directory that an origin serves."""

    def __init__(
        self,
        store_dir: str | Path,
        keypair: KeyPair,
        config: ShardcastConfig | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.keypair = keypair
        self.config = config or ShardcastConfig()
        self.store_dir.mkdir(parents=True, exist_ok=True)

    def latest(self) -> int | None:
        versions = store.ready_versions(self.store_dir)
        return versions[-1] if versions else None

    def publish(
        self, checkpoint_dir: str | Path, version: int, step: int | None = None
    ) -> Manifest:
        """Publish ``checkpoint_dir`` as ``version``; return the signed manifest."""
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.is_dir():
            raise MissingPathError(f"checkpoint directory not found: {checkpoint_dir}")
        rel_paths = store.checkpoint_files(checkpoint_dir)
        if not rel_paths:
            raise UserError(f"checkpoint directory {checkpoint_dir} has no files")
        parent = self.latest()
        if parent is not None and version <= parent:
            raise UserError(f"version {version} must be newer than the latest published {parent}")
        cfg = self.config
        started = time.perf_counter()
        partial = store.new_partial(self.store_dir, version)
        try:
            files: list[FileEntry] = []
            next_index = 0
            for rel in rel_paths:
                entry = _copy_and_shard(
                    checkpoint_dir / rel,
                    partial / rel,
                    rel,
                    next_index,
                    cfg.shard_size_bytes,
                    cfg.digest,
                )
                files.append(entry)
                next_index += len(entry.shards)
            keyframe = parent is None or not cfg.delta or version % cfg.keyframe_interval == 0
            deltas = [] if keyframe else self._encode_deltas(partial, files, parent)
            manifest = sign_manifest(
                Manifest(
                    publisher=self.keypair.public_key_hex,
                    version=version,
                    step=version if step is None else step,
                    parent_version=parent,
                    created_at=time.time(),
                    digest_algorithm=cfg.digest,
                    shard_size=cfg.shard_size_bytes,
                    files=files,
                    deltas=deltas,
                    keyframe=keyframe,
                    root_digest=root_digest(cfg.digest, files),
                ),
                self.keypair,
            )
            store.write_manifest(partial, manifest)
            store.promote(partial, self.store_dir, version)
        except OSError as exc:
            store.discard(partial)  # nothing half-written stays behind
            if exc.errno in WRITE_FAULTS:
                raise DiskWriteError(
                    f"publishing v{version} into {self.store_dir} failed: {exc}"
                ) from exc
            raise
        except BaseException:
            store.discard(partial)
            raise
        store.prune(self.store_dir, cfg.keep_versions)
        log.info(
            "published v%d: %d files, %d shards, %.1f MB, %d deltas (%.1f kB) in %.2fs",
            version,
            len(files),
            manifest.shard_count,
            manifest.total_bytes / 1e6,
            len(deltas),
            sum(d.size for d in deltas) / 1e3,
            time.perf_counter() - started,
        )
        return manifest

    def _encode_deltas(
        self, partial: Path, files: list[FileEntry], parent: int
    ) -> list[DeltaEntry]:
        """Delta blobs for the files whose parent copy has the same size and is not identical: one
        per shard of the file, each rebuilding that shard's bytes (so a relay passes on a part
        while the next arrives); none for a file whose parts together are not smaller than it."""
        parent_dir = store.ready_dir(self.store_dir, parent)
        parent_files = {f.path: f for f in store.load_manifest(parent_dir).files}
        deltas: list[DeltaEntry] = []
        for entry in files:
            old = parent_files.get(entry.path)
            if old is None or old.size != entry.size or entry.size == 0:
                continue
            if [s.digest for s in old.shards] == [s.digest for s in entry.shards]:
                continue  # unchanged: clients reuse their copy of the parent file
            parts: list[DeltaEntry] = []
            for shard in entry.shards:
                index = len(deltas) + len(parts)
                blob = store.delta_path(partial, index)
                size = delta_codec.encode_delta(
                    parent_dir / entry.path,
                    partial / entry.path,
                    blob,
                    self.config.zstd_level,
                    offset=shard.offset,
                    length=shard.size,
                )
                parts.append(
                    DeltaEntry(
                        index=index,
                        path=entry.path,
                        parent_version=parent,
                        encoding=delta_codec.ENCODING,
                        size=size,
                        digest=_file_digest(blob, self.config.digest),
                        offset=shard.offset,
                        length=shard.size,
                    )
                )
            if sum(p.size for p in parts) >= entry.size:
                for p in parts:
                    store.delta_path(partial, p.index).unlink()
                continue
            deltas.extend(parts)
        return deltas
