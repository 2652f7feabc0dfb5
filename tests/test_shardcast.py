"""Unit tests of shardcast: manifests and signatures, deltas, ranges, the publisher's store."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import BadSignature, CorruptData, ReplayedRequest, UserError
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, store
from swarmrl.shardcast.delta import apply_delta, encode_delta
from swarmrl.shardcast.manifest import parse_manifest, sign_manifest, verify_manifest
from swarmrl.shardcast.server import parse_range
from swarmrl.testing.shardcast import random_weights, write_checkpoint

CFG = ShardcastConfig(shard_size_bytes=64 * 1024, keep_versions=2, keyframe_interval=3)


@pytest.fixture
def key():
    return KeyPair.from_seed(b"\x01" * 32)


def _publish(tmp_path, key, version, seed=0, n=100_000, cfg=CFG):
    ck = write_checkpoint(tmp_path / f"ck{version}", random_weights(n, seed))
    return Publisher(tmp_path / "store", key, cfg).publish(ck, version)


def test_manifest_lists_every_byte_in_shards_and_is_signed(tmp_path, key):
    m = _publish(tmp_path, key, 1)
    sizes = {f.path: f.size for f in m.files}
    assert sizes["model.safetensors"] == os.path.getsize(tmp_path / "ck1" / "model.safetensors")
    weights = next(f for f in m.files if f.path == "model.safetensors")
    assert len(weights.shards) == -(-weights.size // CFG.shard_size_bytes)
    assert [s.index for f in m.files for s in f.shards] == list(range(m.shard_count))
    assert m.parent_version is None and m.keyframe and m.deltas == []
    verify_manifest(m, [key.public_key_hex])
    # the copy in the store is the same bytes the manifest describes
    ready = store.ready_dir(tmp_path / "store", 1)
    assert (ready / "model.safetensors").read_bytes() == (
        tmp_path / "ck1" / "model.safetensors"
    ).read_bytes()


def test_tampered_unsigned_foreign_and_replayed_manifests_are_refused(tmp_path, key):
    m = _publish(tmp_path, key, 1)
    with pytest.raises(BadSignature, match="does not verify"):
        verify_manifest(m.model_copy(update={"step": 99}), [key.public_key_hex])
    with pytest.raises(BadSignature, match="unsigned"):
        verify_manifest(m.model_copy(update={"signature": ""}), [key.public_key_hex])
    other = KeyPair.from_seed(b"\x02" * 32)
    with pytest.raises(BadSignature, match="unknown publisher"):
        verify_manifest(sign_manifest(m, other), [key.public_key_hex])
    with pytest.raises(ReplayedRequest, match="asked for manifest v2"):
        verify_manifest(m, [key.public_key_hex], expected_version=2)
    with pytest.raises(ReplayedRequest, match="rollback"):
        verify_manifest(m, [key.public_key_hex], held_version=3)
    verify_manifest(m, [key.public_key_hex], held_version=3, allow_rollback=True)
    # a validly signed manifest whose root digest does not bind its shards is corrupt
    files = [f.model_copy(update={"size": f.size}) for f in m.files]
    bad_shard = files[-1].shards[0].model_copy(update={"digest": "00" * 32})
    files[-1] = files[-1].model_copy(update={"shards": [bad_shard, *files[-1].shards[1:]]})
    with pytest.raises(CorruptData, match="root digest"):
        verify_manifest(
            sign_manifest(m.model_copy(update={"files": files}), key), [key.public_key_hex]
        )
    with pytest.raises(CorruptData, match="malformed"):
        parse_manifest(b'{"version": "x"}')


def test_delta_roundtrip_and_sparsity(tmp_path):
    rng = np.random.default_rng(0)
    old = (rng.standard_normal(500_001) * 0.02).astype(np.float32)
    new = old.copy()
    new[rng.choice(old.size, 500, replace=False)] += 1e-3  # 0.1 % of values change
    (tmp_path / "old").write_bytes(old.tobytes() + b"x")  # odd length exercises the tail byte
    (tmp_path / "new").write_bytes(new.tobytes() + b"y")
    size = encode_delta(tmp_path / "old", tmp_path / "new", tmp_path / "blob")
    assert size < 0.02 * old.nbytes
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        apply_delta(tmp_path / "old", tmp_path / "blob", fd, os.path.getsize(tmp_path / "new"))
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == (tmp_path / "new").read_bytes()
    (tmp_path / "garbage").write_bytes(b"not zstd at all")
    fd = os.open(tmp_path / "out2", os.O_RDWR | os.O_CREAT)
    with pytest.raises(ValueError):
        apply_delta(tmp_path / "old", tmp_path / "garbage", fd, os.path.getsize(tmp_path / "new"))
    os.close(fd)


def test_a_delta_in_byte_ranges_rebuilds_each_range_alone(tmp_path):
    rng = np.random.default_rng(1)
    old = rng.integers(0, 256, 300_001, dtype=np.uint8)
    new = old.copy()
    new[rng.choice(old.size, 300, replace=False)] ^= 1
    (tmp_path / "old").write_bytes(old.tobytes())
    (tmp_path / "new").write_bytes(new.tobytes())
    ranges = [(0, 100_000), (100_000, 150_001), (250_001, None)]  # the last: to the end
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, old.size)
        for i, (offset, length) in reversed(list(enumerate(ranges))):  # any order
            blob = tmp_path / f"blob{i}"
            encode_delta(tmp_path / "old", tmp_path / "new", blob, offset=offset, length=length)
            apply_delta(tmp_path / "old", blob, fd, old.size, offset=offset, length=length)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == new.tobytes()
    scratch = os.open(tmp_path / "scratch", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="longer"):  # a range's blob on a shorter range
            apply_delta(tmp_path / "old", tmp_path / "blob0", scratch, old.size, 0, 50_000)
        with pytest.raises(ValueError, match="outside"):
            apply_delta(tmp_path / "old", tmp_path / "blob2", scratch, old.size, 300_000, 2)
    finally:
        os.close(scratch)
    with pytest.raises(ValueError, match="outside"):
        encode_delta(tmp_path / "old", tmp_path / "new", tmp_path / "x", 0, 300_000, 2)


def test_a_files_deltas_must_cover_it_in_order(tmp_path, key):
    pub = Publisher(tmp_path / "store", key, CFG)
    weights = random_weights(100_000, 0)
    pub.publish(write_checkpoint(tmp_path / "ck1", weights), 1)
    weights = {k: v + np.float32(1e-3) for k, v in weights.items()}
    m = pub.publish(write_checkpoint(tmp_path / "ck2", weights), 2)
    assert len(m.deltas) > 2
    verify_manifest(m, [key.public_key_hex])

    def signed(deltas):
        return sign_manifest(m.model_copy(update={"deltas": deltas}), key)

    first, second, *rest = m.deltas
    gap = second.model_copy(update={"offset": second.offset + 1})
    short = [first, second, *rest[:-1]]  # the file's last bytes rebuilt by nothing
    past = rest[-1].model_copy(update={"length": rest[-1].length + 1})
    for deltas, match in [
        ([first, gap, *rest], "not the next ones"),
        ([second.model_copy(update={"index": 0}), first.model_copy(update={"index": 1}),
          *rest], "not the next ones"),
        (short, "stop short"),
        ([first, second, *rest[:-1], past], "not the next ones"),
    ]:  # fmt: skip
        with pytest.raises(CorruptData, match=match):
            verify_manifest(signed(deltas), [key.public_key_hex])


def test_publisher_deltas_keyframes_and_pruning(tmp_path, key):
    pub = Publisher(tmp_path / "store", key, CFG)
    weights = random_weights(100_000, 0)
    for version in (1, 2, 3, 4):
        weights = {
            k: v + np.float32(1e-3) * (np.arange(v.size) % 997 == 0) for k, v in weights.items()
        }
        m = pub.publish(write_checkpoint(tmp_path / f"ck{version}", weights), version)
        if version == 3:  # keyframe_interval=3
            assert m.keyframe and m.deltas == []
        elif version > 1:
            assert not m.keyframe and m.parent_version == version - 1
            weights_file = next(f for f in m.files if f.path == "model.safetensors")
            # config/tokenizer unchanged; the weights: one delta per shard, each its byte range
            assert {d.path for d in m.deltas} == {"model.safetensors"}
            assert len(weights_file.shards) > 1
            assert [(d.offset, d.length) for d in m.deltas] == [
                (sh.offset, sh.size) for sh in weights_file.shards
            ]
            assert sum(d.size for d in m.deltas) < 0.1 * m.total_bytes
    assert store.ready_versions(tmp_path / "store") == [3, 4]  # keep_versions=2
    with pytest.raises(UserError, match="newer"):
        pub.publish(tmp_path / "ck4", 4)
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_failed_publish_leaves_no_version(tmp_path, key):
    _publish(tmp_path, key, 1)
    # the parent's weights vanish from the store: encoding the delta fails mid-publish
    (store.ready_dir(tmp_path / "store", 1) / "model.safetensors").unlink()
    ck = write_checkpoint(tmp_path / "ck2", random_weights(100_000, seed=1))
    with pytest.raises(FileNotFoundError):
        Publisher(tmp_path / "store", key, CFG).publish(ck, 2)
    assert store.ready_versions(tmp_path / "store") == [1]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["v00000001"]


def test_parse_range():
    assert parse_range(None, 10) is None
    assert parse_range("bytes=2-5", 10) == (2, 6)
    assert parse_range("bytes=7-", 10) == (7, 10)
    assert parse_range("bytes=-3", 10) == (7, 10)
    assert parse_range("bytes=5-100", 10) == (5, 10)
    for bad in ("bytes=10-", "bytes=4-2", "items=1-2", "bytes=1-2,4-5", "bytes=x-1"):
        with pytest.raises(ValueError):
            parse_range(bad, 10)


def test_protocol_worked_example_is_a_valid_manifest():
    import json

    import swarmrl.protocol.shardcast as wire

    doc = wire.__doc__
    example = doc[doc.index("{") : doc.rindex("}") + 1]
    manifest = wire.Manifest.model_validate(json.loads(example))
    assert manifest.shard_count == 3 and manifest.total_bytes == 812 + 40000000
    assert [s.size for s in manifest.files[1].shards] == [33554432, 6445568]


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=3000), st.data())
def test_delta_roundtrip_any_bytes(tmp_path_factory, old, data):
    new = data.draw(st.binary(min_size=len(old), max_size=len(old)))
    d = tmp_path_factory.mktemp("delta")
    (d / "old").write_bytes(old)
    (d / "new").write_bytes(new)
    encode_delta(d / "old", d / "new", d / "blob")
    fd = os.open(d / "out", os.O_RDWR | os.O_CREAT)
    try:
        apply_delta(d / "old", d / "blob", fd, len(new))
    finally:
        os.close(fd)
    assert (d / "out").read_bytes() == new
