"""The weight store on disk: a full disk, files synced before a version is named ready, and a
damaged held version found at start (a worker's and a relay's), each ending verified or cleanly
refused (real servers on loopback, as in test_shardcast_faults)."""

import errno
import os
import time
from pathlib import Path

import pytest

from swarmrl.errors import InfraError
from swarmrl.shardcast import Publisher, WeightClient, store
from swarmrl.shardcast.assemble import FileWriter
from swarmrl.testing.shardcast import random_weights, write_checkpoint
from test_shardcast_faults import CFG, KEY, _assert_clean, _weights_bytes, origin  # noqa: F401


class _FullDisk(FileWriter):
    """The disk fills up after ``budget`` bytes: the next write raises ENOSPC."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def write(self, fd, offset, data):
        self.budget -= len(data)
        if self.budget < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(fd, offset, data)


def test_full_disk_is_a_clean_infra_error(tmp_path, origin):  # noqa: F811
    client = WeightClient(
        [origin.url], KEY.public_key_hex, tmp_path / "out", CFG, writer=_FullDisk(100_000)
    )
    with pytest.raises(InfraError, match="No space left"):
        client.fetch(1)
    _assert_clean(tmp_path / "out")


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_every_file_is_synced_before_its_version_is_renamed_ready(tmp_path, origin, monkeypatch):  # noqa: F811
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", _fd_path(fd)))
        return real_fsync(fd)

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", str(src)))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
    path = client.fetch(1)
    promoted = [i for i, (kind, p) in enumerate(events) if kind == "rename" and ".partial-" in p]
    assert len(promoted) == 1
    partial = events[promoted[0]][1]
    synced = {p for kind, p in events[: promoted[0]] if kind == "fsync"}
    files = [f for f in path.rglob("*") if f.is_file()]
    assert files and all(str(f).replace(str(path), partial) in synced for f in files)
    assert partial in synced  # and the directory holding their names


def _flip_first_shard(version_dir: Path) -> None:
    weights = version_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[200] ^= 0x10
    weights.write_bytes(bytes(data))


def test_a_damaged_held_version_is_removed_at_start_and_fetched_again(tmp_path, origin):  # noqa: F811
    out = tmp_path / "out"
    WeightClient([origin.url], KEY.public_key_hex, out, CFG).fetch(1)
    _flip_first_shard(store.ready_dir(out, 1))
    restarted = WeightClient([origin.url], KEY.public_key_hex, out, CFG)
    assert restarted.held_version() is None  # the damaged copy is gone, not loaded
    path = restarted.fetch("latest")
    assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
    # a manifest edited on disk (signature no longer valid) is caught the same way
    mpath = store.manifest_path(path)
    mpath.write_text(mpath.read_text().replace('"step":1', '"step":7', 1))
    assert WeightClient([origin.url], KEY.public_key_hex, out, CFG).held_version() is None


def test_a_relay_restarted_on_a_damaged_store_refetches_instead_of_serving_it(tmp_path, origin):  # noqa: F811
    from swarmrl.shardcast.catalog import Catalog
    from swarmrl.shardcast.relay import Follower
    from swarmrl.shardcast.server import build_app, serve_in_thread

    def start_relay():
        catalog = Catalog(tmp_path / "relay", CFG.keep_versions)
        follower = Follower([origin.url], [KEY.public_key_hex], catalog, CFG)
        server = serve_in_thread(build_app(catalog, CFG, role="relay"))
        follower.start()
        return catalog, follower, server

    def until_ready(catalog):
        deadline = time.monotonic() + 15
        while catalog.latest(complete_only=True) != 1:
            assert time.monotonic() < deadline, "the relay did not (re)replicate v1"
            time.sleep(0.05)

    catalog, follower, server = start_relay()
    until_ready(catalog)
    follower.stop(timeout_s=1)
    server.stop()
    _flip_first_shard(store.ready_dir(tmp_path / "relay", 1))
    catalog, follower, server = start_relay()
    try:
        until_ready(catalog)
        alone = WeightClient([server.url], KEY.public_key_hex, tmp_path / "out", CFG)
        path = alone.fetch(1)
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
        assert catalog.counters.get("stored_versions_damaged_total") == 1
    finally:
        follower.stop(timeout_s=1)
        server.stop()


@pytest.mark.parametrize("failing", ["model.safetensors", "manifest.tmp"])
def test_publishing_onto_a_full_disk_is_one_line_and_leaves_no_temporary_files(
    tmp_path, failing, monkeypatch
):
    real_fsync = os.fsync

    def fsync(fd):  # where a full disk shows up on many filesystems: the data cannot be kept
        if _fd_path(fd).endswith(failing):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    ck = write_checkpoint(tmp_path / "ck", random_weights(4096, seed=3))
    store_dir = tmp_path / "store"
    Publisher(store_dir, KEY, CFG).publish(ck, 1)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(InfraError, match="publishing v2 .* No space left on device") as info:
        Publisher(store_dir, KEY, CFG).publish(ck, 2)
    assert "\n" not in str(info.value)
    leftovers = [p.name for p in store_dir.rglob("*") if ".tmp" in p.name or ".partial-" in p.name]
    assert leftovers == [] and store.ready_versions(store_dir) == [1]
