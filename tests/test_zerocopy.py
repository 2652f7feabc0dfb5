"""Shards go out with sendfile (whole, by Range, reused connections, vanishing peers); downloaders
write one file one at a time."""

import http.client
import os
import socket
import time

import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.protocol import zerocopy
from swarmrl.shardcast import Publisher, serve_origin, store
from swarmrl.testing.shardcast import random_weights, write_checkpoint

CFG = ShardcastConfig(shard_size_bytes=16 << 20, keep_versions=2)


@pytest.fixture
def origin(tmp_path, monkeypatch):
    yield from _origin(tmp_path, monkeypatch, CFG)


@pytest.fixture
def streaming_origin(tmp_path, monkeypatch):
    yield from _origin(tmp_path, monkeypatch, CFG.model_copy(update={"zero_copy": False}))


def _origin(tmp_path, monkeypatch, cfg):
    calls = []
    real = os.sendfile

    def counting(out, fd, offset, count):
        n = real(out, fd, offset, count)
        calls.append(n)
        return n

    monkeypatch.setattr(zerocopy.os, "sendfile", counting)
    ck = write_checkpoint(tmp_path / "ck", random_weights(9_000_000, 3))
    Publisher(tmp_path / "store", KeyPair.from_seed(b"\x02" * 32), CFG).publish(ck, 1)
    running = serve_origin(tmp_path / "store", cfg)
    yield running, calls, tmp_path / "store"
    running.stop()


def _big_shards(store_dir):
    manifest = store.load_manifest(store.ready_dir(store_dir, 1))
    return [s.index for f in manifest.files for s in f.shards if s.size == CFG.shard_size_bytes]


def _shard_bytes(store_dir, index):
    directory = store.ready_dir(store_dir, 1)
    manifest = store.load_manifest(directory)
    owner = next(f for f in manifest.files if f.shards[-1].index >= index)
    shard = next(s for s in owner.shards if s.index == index)
    with open(directory / owner.path, "rb") as f:
        f.seek(shard.offset)
        return f.read(shard.size)


def test_shards_and_ranges_are_sent_by_the_kernel_on_one_connection(origin):
    running, calls, store_dir = origin
    conn = http.client.HTTPConnection(running.host, running.port, timeout=10)
    big = _big_shards(store_dir)[0]
    want = _shard_bytes(store_dir, big)
    conn.request("GET", f"/v/1/shard/{big}")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == want
    # every byte went through sendfile; the server counts a call once it returns, which may be
    # just after the client has read the bytes it sent
    deadline = time.monotonic() + 10
    while sum(calls) < len(want) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(calls) == len(want)
    for header, start, end in [("bytes=1000-", 1000, len(want)), ("bytes=5-9", 5, 10)]:
        conn.request("GET", f"/v/1/shard/{big}", headers={"Range": header})  # same connection
        resp = conn.getresponse()
        assert resp.status == 206 and resp.read() == want[start:end]
    conn.request("HEAD", f"/v/1/shard/{big}")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b""
    conn.request("GET", "/v/1/manifest")  # an ordinary answer after zero-copy ones
    assert conn.getresponse().status == 200
    conn.close()


def test_without_zero_copy_the_same_bytes_are_streamed(streaming_origin):
    """``shardcast.zero_copy = false``: whole shards and ranges as before, no sendfile."""
    running, calls, store_dir = streaming_origin
    conn = http.client.HTTPConnection(running.host, running.port, timeout=10)
    big = _big_shards(store_dir)[0]
    want = _shard_bytes(store_dir, big)
    for header, start, end in [(None, 0, len(want)), ("bytes=1000-", 1000, len(want))]:
        conn.request("GET", f"/v/1/shard/{big}", headers={"Range": header} if header else {})
        resp = conn.getresponse()
        assert resp.status == (206 if header else 200) and resp.read() == want[start:end]
    conn.close()
    assert calls == []


def test_a_peer_that_leaves_mid_body_costs_nothing(origin):
    running, calls, store_dir = origin
    first, second = _big_shards(store_dir)[:2]
    for _ in range(5):
        sock = socket.create_connection((running.host, running.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"GET /v/1/shard/{first} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        sock.recv(100)
        sock.close()
    time.sleep(0.2)
    conn = http.client.HTTPConnection(running.host, running.port, timeout=10)
    conn.request("GET", f"/v/1/shard/{second}")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == _shard_bytes(store_dir, second)


def test_a_peer_that_stops_reading_is_dropped(origin, monkeypatch):
    running, calls, store_dir = origin
    big = _big_shards(store_dir)[0]
    monkeypatch.setattr(zerocopy, "STALL_S", 0.5)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect((running.host, running.port))
    sock.sendall(f"GET /v/1/shard/{big} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    time.sleep(2.0)  # never reads: the server gives up after STALL_S and closes
    sock.settimeout(10)
    got = 0
    while chunk := sock.recv(1 << 16):
        got += len(chunk)
    assert 0 < got < CFG.shard_size_bytes  # the connection ended short of the body
    sock.close()


def test_downloaders_write_one_file_one_at_a_time(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from swarmrl.shardcast import assemble

    active, most = {"n": 0}, {"n": 0}
    real = os.pwrite

    def slow_pwrite(fd, data, offset):
        active["n"] += 1
        most["n"] = max(most["n"], active["n"])
        time.sleep(0.01)  # long enough for another thread to arrive meanwhile
        active["n"] -= 1
        return real(fd, data, offset)

    monkeypatch.setattr(assemble.os, "pwrite", slow_pwrite)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    writer = assemble.FileWriter()
    with ThreadPoolExecutor(8) as pool:
        for i in range(32):
            pool.submit(writer.write, fd, i * 4, memoryview(b"%04d" % i))
    os.close(fd)
    assert most["n"] == 1
    assert (tmp_path / "f").read_bytes() == b"".join(b"%04d" % i for i in range(32))
