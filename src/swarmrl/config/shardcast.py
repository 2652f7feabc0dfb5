"""Config of the shardcast subsystem (weight distribution).

Only numbers and names; imports no torch and no HTTP code, so a relay installs light.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class ShardcastConfig(Section):
    """Settings of `swarmrl.shardcast`: publishing, relaying and fetching policy versions."""

    shard_size_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=4096,
        description="Size of one shard in bytes; a file's last shard may be shorter.",
    )
    digest: Literal["blake3", "sha256"] = Field(
        default="blake3", description="Hash used for shard digests and the root digest."
    )
    keep_versions: int = Field(
        default=4, ge=1, description="How many ready versions a publisher, relay or client keeps."
    )
    keyframe_interval: int = Field(
        default=8,
        ge=1,
        description="Every K-th version is a keyframe: full shards only, no delta from its parent.",
    )
    delta: bool = Field(
        default=True, description="Publish a delta from the parent version (XOR, zstd)."
    )
    zstd_level: int = Field(default=3, ge=1, le=19, description="zstd level of delta blobs.")
    parallel_downloads: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Shard downloads a client runs at once (a relay's own fetches from its "
        "upstreams: relay_parallel_downloads).",
    )
    relay_parallel_downloads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Shard and delta-part downloads a relay runs at once from its upstreams. "
        "Few, so that behind a slow upstream its shards arrive one after another and each is "
        "passed on while the rest arrive; with many at once they all finish together at the end "
        "(the relay tier measured 1.20–1.31x the bound for a full version and 1.49x for a delta "
        "with 2, against 1.32–1.75x and 1.86x with 8; BENCHMARKS.md).",
    )
    direct_writes: bool = Field(
        default=True,
        description="Clients write fetched shards to disk with O_DIRECT, around the page cache "
        "(falls back to ordinary writes where the filesystem refuses it); relays always write "
        "through the page cache, which they serve from.",
    )
    zero_copy: bool = Field(
        default=True,
        description="Origins and relays send shard and delta bodies with sendfile where the "
        "server offers it (swarmrl.protocol.zerocopy); false = streamed through ASGI messages.",
    )
    request_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for a source's answer (except a long-poll's), seconds; caps "
        "connect_timeout_s and stall_timeout_s.",
    )
    connect_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="How long opening a connection to a source (TCP and TLS) may take, seconds.",
    )
    stall_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="A source that sends no byte for this many seconds, while a body streams or "
        "for a request answered at once (manifest, version list), is given up for that object: "
        "the fetch resumes from the next source (at the last whole MiB taken in), and the "
        "silent source comes after every other for 30 s. A shard or delta request may wait shard_wait_s longer for its "
        "answer (a relay holds it while the shard arrives). A slow link still sends bytes "
        "every few milliseconds (20 Mbit/s at 150 ms RTT: a 1448-byte segment every 0.6 ms).",
    )
    long_poll_timeout_s: float = Field(
        default=25.0,
        gt=0,
        description="How long a version-notice long-poll is held open by the server, seconds.",
    )
    shard_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="How long a relay holds a request for a shard still arriving before a 503.",
    )
    fetch_timeout_s: float = Field(
        default=1800.0, gt=0, description="Deadline of one whole version fetch, seconds."
    )
    max_clients: int = Field(
        default=1024,
        ge=1,
        description="Client reports a server remembers for /clients; the longest silent goes first.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest request head (request line + headers) a server reads, bytes; "
        "more is answered 431 and the connection closed.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection that has not sent a complete request head this many seconds "
        "after it opened (or after its last response) is closed.",
    )
    keep_alive_s: float = Field(
        default=5.0,
        gt=0,
        description="How long a server keeps an idle connection open after a response, seconds "
        "(clients reuse a connection only when it has been idle for less).",
    )
    recheck_on_start: bool = Field(
        default=True,
        description="Relays, clients and origins re-read every stored version at start and "
        "remove any whose files no longer match the signed manifest (costs one read of the "
        "stored bytes).",
    )
