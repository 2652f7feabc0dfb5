"""The trainer's weight origin: the publisher that saves, shards and signs each policy version
into a store (``swarmrl.shardcast``), and the HTTP server that serves that store to relays and
workers. Counts what it published for the run's summary. Knows nothing about the orchestrator
or the training loop.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from swarmrl.config import SwarmConfig
from swarmrl.identity import KeyPair
from swarmrl.serving import Tls
from swarmrl.shardcast import Publisher, store
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.server import build_app, serve_in_thread


class Origin:
    """The publisher and the HTTP origin serving its store."""

    def __init__(
        self,
        store_dir: Path,
        keypair: KeyPair,
        config: SwarmConfig,
        host: str,
        port: int,
        tls: Tls | None = None,
    ) -> None:
        self.store_dir = store_dir
        store.discard_stale_partials(store_dir)  # a killed trainer's unfinished version
        self.publisher = Publisher(store_dir, keypair, config.shardcast)
        catalog = Catalog(store_dir, config.shardcast.keep_versions)
        catalog.refresh()
        self.server = serve_in_thread(
            build_app(catalog, config.shardcast, role="origin", watch_disk=True),
            host,
            port,
            tls=tls,
        )
        self.bytes_full = 0
        self.bytes_delta = 0
        self.versions: list[int] = []

    def publish(self, save: Callable[[Path], Path], version: int, scratch: Path) -> None:
        """Save (``save(dir)``: a snapshot of the whole policy, or the base and a LoRA
        adapter), shard, sign and serve ``version``; the checkpoint copy is removed afterwards."""
        checkpoint = save(scratch / f"v{version}")
        manifest = self.publisher.publish(checkpoint, version, version)
        self.bytes_full += manifest.total_bytes
        self.bytes_delta += sum(d.size for d in manifest.deltas)
        self.versions.append(version)
        shutil.rmtree(checkpoint)

    def stop(self) -> None:
        self.server.stop()
