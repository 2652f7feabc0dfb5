"""Wire types of shardcast: the signed manifest of a policy version and the version list.

A version is published as the files of an HF checkpoint directory, each cut into shards of at
most ``shard_size`` bytes (shards never cross a file boundary), plus optional delta blobs that
rebuild a file from the same file of the parent version. The manifest lists every shard with
its digest, binds them all in a root digest, and is signed with the publisher's ed25519 key
over ``canonical_json`` of every field except ``signature``.

Worked example (digests shortened)::

    {
      "format": "swarmrl.shardcast/1",
      "publisher": "9f3c…(64 hex)",
      "version": 12, "step": 12, "parent_version": 11,
      "created_at": 1790000000.25,
      "digest_algorithm": "blake3",
      "shard_size": 33554432,
      "files": [
        {"path": "config.json", "size": 812,
         "shards": [{"index": 0, "offset": 0, "size": 812, "digest": "a1…"}]},
        {"path": "model.safetensors", "size": 40000000,
         "shards": [{"index": 1, "offset": 0, "size": 33554432, "digest": "b2…"},
                    {"index": 2, "offset": 33554432, "size": 6445568, "digest": "c3…"}]}
      ],
      "deltas": [{"index": 0, "path": "model.safetensors", "parent_version": 11,
                  "encoding": "xor-planes2-zstd", "size": 180233, "digest": "d4…"}],
      "keyframe": false,
      "root_digest": "e5…",
      "signature": "7a…(128 hex)"
    }

Knows nothing about HTTP, disks or how digests are computed (see ``swarmrl.shardcast``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FORMAT = "swarmrl.shardcast/1"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardEntry(_Wire):
    """One shard: a contiguous byte range of one file."""

    index: int = Field(ge=0, description="Global shard number in the version (0-based, dense).")
    offset: int = Field(ge=0, description="Byte offset of the shard inside its file.")
    size: int = Field(ge=0, description="Length of the shard in bytes.")
    digest: str = Field(description="Hex digest (manifest's algorithm) of the shard bytes.")


class FileEntry(_Wire):
    """One file of the checkpoint directory and the shards it is cut into (in offset order)."""

    path: str = Field(description="Relative POSIX path inside the checkpoint dir; no '..'.")
    size: int = Field(ge=0, description="File size in bytes; equals the sum of its shard sizes.")
    shards: list[ShardEntry] = Field(description="Shards covering the file, in offset order.")


class DeltaEntry(_Wire):
    """A blob that rebuilds one file of this version from the same file of the parent."""

    index: int = Field(ge=0, description="Delta blob number in this version (0-based, dense).")
    path: str = Field(description="The file (a FileEntry.path) the delta rebuilds.")
    parent_version: int = Field(ge=0, description="Version whose file the delta applies to.")
    encoding: Literal["xor-planes2-zstd"] = Field(
        description="XOR of the two files' bytes, split into 2 byte planes, zstd-compressed; "
        "only used when both files have the same size."
    )
    size: int = Field(ge=0, description="Length of the compressed blob in bytes.")
    digest: str = Field(description="Hex digest (manifest's algorithm) of the blob bytes.")
    offset: int = Field(
        0,
        ge=0,
        description="First byte of the file the blob rebuilds. A file's deltas from one parent "
        "follow one another in index order and cover it from 0 to its end, without gaps.",
    )
    length: int | None = Field(
        None, ge=0, description="Bytes of the file the blob rebuilds from offset; None: to the end."
    )


class Manifest(_Wire):
    """The signed description of one policy version."""

    format: Literal["swarmrl.shardcast/1"] = Field(
        default=MANIFEST_FORMAT, description="Wire format tag."
    )
    publisher: str = Field(description="ed25519 public key of the publisher, 64 hex chars.")
    version: int = Field(ge=0, description="Policy version (optimizer steps taken).")
    step: int = Field(ge=0, description="Trainer step that produced the weights.")
    parent_version: int | None = Field(
        description="The version this one was trained from; None for the first version."
    )
    created_at: float = Field(description="Publish time, Unix seconds (informational).")
    digest_algorithm: Literal["blake3", "sha256"] = Field(description="Hash of all digests.")
    shard_size: int = Field(gt=0, description="Maximum shard size in bytes.")
    files: list[FileEntry] = Field(description="Every file of the checkpoint directory.")
    deltas: list[DeltaEntry] = Field(
        default_factory=list, description="Delta blobs from the parent; empty for a keyframe."
    )
    keyframe: bool = Field(description="True when the version carries no delta by policy.")
    root_digest: str = Field(
        description="Digest of canonical_json([[path, size, [shard digests…]] for each file]); "
        "binds every byte of the version."
    )
    signature: str = Field(
        default="", description="Hex ed25519 signature over the other fields; '' = unsigned."
    )

    @property
    def total_bytes(self) -> int:
        """Bytes of the full version (all files)."""
        return sum(f.size for f in self.files)

    @property
    def shard_count(self) -> int:
        return sum(len(f.shards) for f in self.files)


class VersionInfo(_Wire):
    """One entry of a server's version list."""

    version: int = Field(ge=0, description="Policy version.")
    step: int = Field(ge=0, description="Trainer step of the version.")
    complete: bool = Field(
        description="True when every shard is on this server; False while still arriving "
        "(shards already verified are served)."
    )
    total_bytes: int = Field(ge=0, description="Bytes of the full version.")


class VersionList(_Wire):
    """What ``GET /versions`` and the long-poll ``GET /versions/wait`` return.

    Example: ``{"latest": 12, "versions": [{"version": 11, …}, {"version": 12, …}]}``.
    """

    latest: int | None = Field(description="Highest version listed; None when there is none.")
    versions: list[VersionInfo] = Field(description="Versions on this server, oldest first.")
    manifest: dict[str, Any] | None = Field(
        None,
        description="The long-poll's answer to ``manifest=1``: the signed manifest of ``latest``, "
        "verified by the client as if fetched from ``/v/{latest}/manifest``; absent otherwise.",
    )
