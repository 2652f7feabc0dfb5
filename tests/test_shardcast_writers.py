"""Writers on a real filesystem: direct writes land every byte, in order, restarts included;
a relay never serves a shard it has not verified."""

import os
import shutil
import time

import httpx
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, WeightClient, store, writers
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.relay import Follower
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

KEY = KeyPair.from_seed(b"\x09" * 32)
CFG = ShardcastConfig(shard_size_bytes=64 * 1024, long_poll_timeout_s=2, shard_wait_s=0.2)


@pytest.fixture
def small_stage(monkeypatch):
    monkeypatch.setattr(writers, "STAGE", 2 * writers.ALIGN)  # objects cross many stages


def _direct_fds(monkeypatch) -> list[int]:
    """Descriptors opened with O_DIRECT from now on."""
    opened: list[int] = []
    real = os.open

    def spy(path, flags, *args, **kwargs):
        fd = real(path, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            opened.append(fd)
        return fd

    monkeypatch.setattr(writers.os, "open", spy)
    return opened


def _pieces(data: bytes, sizes: list[int]):
    offset = 0
    while offset < len(data):
        for size in sizes:
            piece = data[offset : offset + size]
            if piece:
                yield offset, memoryview(piece)
            offset += len(piece)


def test_direct_sink_writes_whole_blocks_around_the_cache_and_restarts_cleanly(
    tmp_path, small_stage, monkeypatch
):
    direct = _direct_fds(monkeypatch)
    data = os.urandom(5 * writers.ALIGN + 1234)  # 2.5 stages and a partial last block
    base = 3 * writers.ALIGN
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, base + len(data))
    sink = writers.DirectFileWriter().sink(fd, base)
    try:
        assert len(direct) == 1
        for offset, piece in _pieces(b"\xff" * len(data), [5000, 3]):  # a bad first attempt
            sink.write(offset, piece)
        for offset, piece in _pieces(data, [1, 4095, 9000, 77]):  # starts over at 0
            sink.write(offset, piece)
        with pytest.raises(ValueError, match="out-of-order"):
            sink.write(7, memoryview(b"x"))
        sink.finish()
    finally:
        sink.close()
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\0" * base + data


def test_unaligned_objects_go_through_the_page_cache(tmp_path, monkeypatch):
    direct = _direct_fds(monkeypatch)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    sink = writers.DirectFileWriter().sink(fd, 100)
    sink.write(0, memoryview(b"abc"))
    sink.finish()
    sink.close()
    os.close(fd)
    assert direct == [] and (tmp_path / "f").read_bytes() == b"\0" * 100 + b"abc"


def test_a_client_fetch_writes_direct_and_matches_the_published_bytes(tmp_path, monkeypatch):
    ck = write_checkpoint(tmp_path / "ck", random_weights(300 * 1024 + 7, seed=3))
    Publisher(tmp_path / "origin", KEY, CFG).publish(ck, 1)
    origin = serve_store(tmp_path / "origin", CFG)
    direct = _direct_fds(monkeypatch)
    try:
        path = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG).fetch(1)
    finally:
        origin.stop()
    assert direct, "the client wrote nothing with O_DIRECT"
    for name in ("model.safetensors", "config.json"):
        assert (path / name).read_bytes() == (ck / name).read_bytes()


class _RecordingCatalog(Catalog):
    """Remembers every shard marked servable."""

    marked: list[int]

    def mark_shard(self, version: int, index: int) -> None:
        self.__dict__.setdefault("marked", []).append(index)
        super().mark_shard(version, index)


def test_a_relay_never_serves_a_shard_it_has_not_verified(tmp_path):
    """Its only upstream serves one shard corrupt: that shard is never served, at any moment."""
    ck = write_checkpoint(tmp_path / "ck", random_weights(512 * 1024, seed=5))
    Publisher(tmp_path / "origin", KEY, CFG).publish(ck, 1)
    shutil.copytree(tmp_path / "origin", tmp_path / "bad")
    manifest = store.load_manifest(store.ready_dir(tmp_path / "bad", 1))
    weights = next(f for f in manifest.files if f.path == "model.safetensors")
    victim = weights.shards[1]
    path = store.ready_dir(tmp_path / "bad", 1) / weights.path
    data = bytearray(path.read_bytes())
    data[victim.offset + 10] ^= 0x01
    path.write_bytes(bytes(data))
    bad = serve_store(tmp_path / "bad", CFG.model_copy(update={"recheck_on_start": False}))
    catalog = _RecordingCatalog(tmp_path / "relay", CFG.keep_versions)
    relay = serve_in_thread(build_app(catalog, CFG, role="relay"))
    follower = Follower([bad.url], [KEY.public_key_hex], catalog, CFG)
    follower.start()
    answers: set[int] = set()
    try:
        deadline = time.monotonic() + 20
        while True:  # ask at least once more after the relay gave the version up
            done = bool(follower.errors) or time.monotonic() > deadline
            resp = httpx.get(f"{relay.url}/v/1/shard/{victim.index}", timeout=10)
            answers.add(resp.status_code)
            assert resp.status_code != 200, "the relay served a shard that failed its digest"
            if done:
                break
        assert follower.errors and "v1" in follower.errors[0]
        assert answers and answers <= {404, 503}
        assert catalog.latest() is None  # the failed version is not offered
        assert victim.index not in catalog.__dict__.get("marked", [])  # never, not for a moment
    finally:
        follower.stop(timeout_s=1)
        relay.stop()
        bad.stop()


def _damaged_copy(tmp_path, name: str, damage) -> str:
    shutil.copytree(tmp_path / "origin", tmp_path / name)
    damage(store.ready_dir(tmp_path / name, 1) / "model.safetensors")
    return serve_store(tmp_path / name, CFG.model_copy(update={"recheck_on_start": False}))


def _flip_late_in_every_shard(path) -> None:
    data = bytearray(path.read_bytes())
    for offset in range(CFG.shard_size_bytes - 100, len(data), CFG.shard_size_bytes):
        data[offset] ^= 0x01  # after several blocks of the shard were already written
    path.write_bytes(bytes(data))


def test_corrupt_shards_written_direct_are_refetched_elsewhere(tmp_path, small_stage):
    """Blocks of a bad source already on disk are overwritten by the good source's bytes."""
    ck = write_checkpoint(tmp_path / "ck", random_weights(200 * 1024, seed=6))
    Publisher(tmp_path / "origin", KEY, CFG).publish(ck, 1)
    origin = serve_store(tmp_path / "origin", CFG)
    bad = _damaged_copy(tmp_path, "bad", _flip_late_in_every_shard)
    try:
        client = WeightClient([bad.url, origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        client.pool.stats[origin.url].failures = 10**6  # the bad source is tried first
        path = client.fetch(1)
        stats = client.pool.stats[bad.url]
    finally:
        bad.stop()
        origin.stop()
    assert stats.corrupt > 0  # it did serve, and was caught
    assert (path / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
