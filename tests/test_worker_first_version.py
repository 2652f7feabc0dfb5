"""A worker waiting for the run's first version waits on its sources' long-poll, answered the
moment the version is published, not on a poll every ``retry_s`` (each poll lists every
source, and across a far link each listing and manifest is a round trip of the first step)."""

from __future__ import annotations

import logging
import threading
import time

from swarmrl.config.swarm import SwarmSection
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.worker.versions import VersionFollower
from swarmrl.shardcast import Publisher, WeightClient
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint
from test_shardcast_inline_manifest import CFG, KEY, _metrics

RETRY_S = 0.1


def test_the_first_version_is_awaited_on_the_long_poll_not_by_polling(tmp_path):
    (tmp_path / "origin").mkdir()
    origin = serve_store(tmp_path / "origin", CFG)  # nothing published yet
    stop = threading.Event()
    weights = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
    status = StatusReporter("worker", "w0", None, node_id="ab" * 16)
    follower = VersionFollower(
        weights, SwarmSection(retry_s=RETRY_S), status, logging.getLogger("test.first"), stop
    )
    thread = threading.Thread(target=follower.run, daemon=True)
    try:
        thread.start()
        time.sleep(20 * RETRY_S)  # a poll every retry_s would ask about 20 times by now
        publisher = Publisher(tmp_path / "origin", KEY, CFG)
        publisher.publish(write_checkpoint(tmp_path / "ck", random_weights(64 * 1024)), 1)
        assert follower.wait(1, 20.0), "the published version never arrived"
        served = _metrics(origin.url)
        # one listing (the first fetch finds nothing), no manifest request (the notice carried
        # it), where polling had listed the source once every retry_s
        assert served["shardcast_listings_served_total"] <= 2, served
        assert served.get("shardcast_manifests_served_total", 0) == 0, served
        assert served["shardcast_manifests_inline_total"] == 1
    finally:
        stop.set()
        weights.close()
        origin.stop()
