"""The validator's policy versions: past the engines it keeps, a new version is swapped into the
least recently used engine in place; no engine is started per version.

Real shardcast versions of a tiny model in a local store, real engines (the vLLM case starts one
vLLM engine and is skipped where vLLM is not installed).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import PeerUnavailable, WaitTimeout
from swarmrl.identity import KeyPair
from swarmrl.inference import interface
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy
from swarmrl.roles.validator.process import KEEP_LOADED, Versions
from swarmrl.shardcast import WeightClient, store
from swarmrl.shardcast.publisher import Publisher
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

TOKENIZER = build_char_tokenizer("0123456789+-*= ")
PAIR = ([1, 5, 6, 18, 7], [9, 4, 12])


class StoreClient:
    """``WeightClient.fetch`` over a local store (versions already complete there)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fetch(self, version: int, allow_rollback: bool = False) -> Path:
        return store.ready_dir(self.root, version)


def publish(tmp_path: Path, count: int) -> Path:
    keep = ShardcastConfig(keep_versions=count)  # every version stays in the store
    publisher = Publisher(tmp_path / "store", KeyPair.from_seed(bytes(32)), keep)
    for version in range(1, count + 1):
        torch.manual_seed(version)
        model = create_tiny_model(TinyModelConfig(num_layers=2), TOKENIZER)
        save_policy(model, TOKENIZER, tmp_path / f"ck{version}")
        publisher.publish(tmp_path / f"ck{version}", version)
    return tmp_path / "store"


def versions_for(root: Path, backend: str) -> Versions:
    config = SwarmConfig.model_validate({"inference": {"backend": backend}})
    return Versions(StoreClient(root), config, logging.getLogger("test"), threading.Event())


def assert_replays_version(loaded, root: Path, version: int) -> None:
    fresh = TorchEngine.from_checkpoint(store.ready_dir(root, version))
    ours, want = loaded.engine.prefill(*PAIR), fresh.prefill(*PAIR)
    assert torch.allclose(ours.logits, want.logits, atol=1e-4)
    assert loaded.version == version
    assert loaded.root_digest == store.load_manifest(store.ready_dir(root, version)).root_digest


def test_torch_versions_past_the_kept_ones_reuse_the_oldest_engine(tmp_path):
    root = publish(tmp_path, KEEP_LOADED["torch"] + 2)
    versions = versions_for(root, "torch")
    try:
        engines = [versions(v).engine for v in (1, 2, 3)]
        assert len({id(e) for e in engines}) == 3
        fourth = versions(4)
        assert fourth.engine is engines[0]  # v1's engine, least recently used, now holds v4
        assert sorted(versions.loaded) == [2, 3, 4]
        assert_replays_version(fourth, root, 4)
        assert_replays_version(versions(3), root, 3)  # still loaded, untouched
        back = versions(1)  # evicted earlier: comes back in v2's engine, with v1's weights
        assert back.engine is engines[1]
        assert_replays_version(back, root, 1)
    finally:
        versions.close()


@pytest.mark.skipif(not interface.vllm_available(), reason="vLLM not installed")
def test_vllm_validator_keeps_one_engine_and_swaps_versions_into_it(tmp_path):
    root = publish(tmp_path, 3)
    versions = versions_for(root, "vllm")
    try:
        first = versions(1)
        engine = first.engine
        assert_replays_version(first, root, 1)
        for version in (2, 3, 1):
            loaded = versions(version)
            assert loaded.engine is engine  # no second vLLM engine was started
            assert_replays_version(loaded, root, version)
        assert list(versions.loaded) == [1]
    finally:
        versions.close()


def test_validator_downloads_each_announced_version_before_a_check_asks(tmp_path):
    """The follower fetches every version a weight source announces, so the first check on a
    new version finds it on disk instead of waiting for its download."""
    keep = ShardcastConfig(long_poll_timeout_s=5, request_timeout_s=10)
    publisher = Publisher(tmp_path / "origin", KeyPair.from_seed(bytes(32)), keep)
    weights = random_weights(64 * 1024, seed=1)
    publisher.publish(write_checkpoint(tmp_path / "ck1", weights), 1)
    origin = serve_store(tmp_path / "origin", keep)
    out = tmp_path / "validator" / "weights"
    client = WeightClient([origin.url], KeyPair.from_seed(bytes(32)).public_key_hex, out, keep)
    stop = threading.Event()
    versions = Versions(client, SwarmConfig(), logging.getLogger("test"), stop)
    follower = threading.Thread(target=versions.follow, kwargs={"wait_s": 2.0}, daemon=True)
    follower.start()

    def ready(version: int) -> bool:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if store.manifest_path(store.ready_dir(out, version)).is_file():
                return True
            time.sleep(0.05)
        return False

    try:
        assert ready(1)
        bumped = {k: v + np.float32(1e-3) for k, v in weights.items()}
        publisher.publish(write_checkpoint(tmp_path / "ck2", bumped), 2)
        assert ready(2)  # announced, downloaded; no check has asked for it
        assert not versions.loaded  # downloading loads nothing
    finally:
        stop.set()
        follower.join(10)
        origin.stop()
    assert not follower.is_alive()


class AwayClient:
    """``WeightClient.fetch`` with every source away: each attempt fails as unreachable."""

    def __init__(self) -> None:
        self.attempts = 0

    def fetch(self, version, allow_rollback=False):
        self.attempts += 1
        raise PeerUnavailable(f"v{version}: no source answered")


def test_a_version_whose_fetch_gave_up_is_not_fetched_again_at_once(tmp_path):
    """The fetch retries for ``give_up_s`` and gives up (a ``WaitTimeout``, which defers the
    units of that version: ``judge_many``); asked again at once, the version is not fetched
    again for ``UNAVAILABLE_PAUSE_S``, so each re-claim of its units does not wait out a whole
    retry in turn while other units wait for their verdicts."""
    config = SwarmConfig.model_validate({"swarm": {"give_up_s": 0.3, "retry_s": 0.05}})
    client = AwayClient()
    versions = Versions(client, config, logging.getLogger("test.away"), threading.Event())
    with pytest.raises(WaitTimeout):
        versions(7)
    tried = client.attempts
    assert tried >= 2  # retried before giving up
    with pytest.raises(WaitTimeout, match="gave up"):
        versions(7)
    assert client.attempts == tried  # not fetched again
