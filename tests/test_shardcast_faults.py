"""Fault tests against real servers on loopback: every fetch ends verified or cleanly refused.

A bad source here is a real HTTP server over a real store whose bytes were damaged on disk
(flipped, truncated, forged, replayed), or a real relay process killed mid-transfer.
"""

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import (
    BadSignature,
    CorruptData,
    InfraError,
    PeerUnavailable,
    ReplayedRequest,
    WaitTimeout,
)
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, WeightClient, store
from swarmrl.shardcast.assemble import Assembly, FileWriter
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

SHARD = 16 * 1024
CFG = ShardcastConfig(
    shard_size_bytes=SHARD, parallel_downloads=4, request_timeout_s=10, long_poll_timeout_s=2
)
KEY = KeyPair.from_seed(b"\x07" * 32)
# a server over a store damaged on purpose must not repair it at start: it is the liar here
LYING = CFG.model_copy(update={"recheck_on_start": False})


@pytest.fixture
def origin(tmp_path):
    """A store with v1 (~512 KiB of weights, 32+ shards) served on loopback."""
    ck = write_checkpoint(tmp_path / "ck1", random_weights(128 * 1024, seed=1))
    Publisher(tmp_path / "origin", KEY, CFG).publish(ck, 1)
    server = serve_store(tmp_path / "origin", CFG)
    yield server
    server.stop()


def _weights_bytes(tmp_path: Path) -> bytes:
    return (tmp_path / "ck1" / "model.safetensors").read_bytes()


def _assert_clean(out: Path) -> None:
    """No ready version and no partial directory left behind."""
    assert store.ready_versions(out) == []
    assert list(out.iterdir()) == []


def _damaged_copy(tmp_path: Path, name: str, damage) -> Path:
    bad = tmp_path / name
    shutil.copytree(tmp_path / "origin", bad)
    damage(store.ready_dir(bad, 1))
    return bad


def _flip_bytes(version_dir: Path) -> None:
    path = version_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    for offset in range(100, len(data), SHARD):  # one flipped bit in every shard
        data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupting_relay_is_penalised_reported_and_bypassed(tmp_path, origin):
    bad = serve_store(_damaged_copy(tmp_path, "bad", _flip_bytes), LYING)
    try:
        client = WeightClient([bad.url, origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        path = client.fetch("latest")
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
        assert client.reports and {r.source for r in client.reports} == {bad.url}
        assert all(r.reason == "digest mismatch" for r in client.reports)
        stats = client.pool.stats
        assert stats[bad.url].corrupt > 0 and stats[bad.url].weight() < stats[origin.url].weight()
        alone = WeightClient([bad.url], KEY.public_key_hex, tmp_path / "out2", CFG)
        with pytest.raises(CorruptData, match="corrupt"):
            alone.fetch(1)
        _assert_clean(tmp_path / "out2")
    finally:
        bad.stop()


def test_truncated_responses_are_resumed_elsewhere(tmp_path, origin):
    def truncate(version_dir: Path) -> None:
        path = version_dir / "model.safetensors"
        os.truncate(path, path.stat().st_size // 2 + 1000)  # mid-shard cut: short bodies

    short = serve_store(_damaged_copy(tmp_path, "short", truncate), LYING)
    try:
        client = WeightClient([short.url, origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        path = client.fetch(1)
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
        assert client.pool.stats[short.url].failures > 0
        alone = WeightClient([short.url], KEY.public_key_hex, tmp_path / "out2", CFG)
        with pytest.raises(PeerUnavailable, match="IncompleteRead|gave up"):
            alone.fetch(1)
        _assert_clean(tmp_path / "out2")
    finally:
        short.stop()


def test_a_fast_source_that_keeps_cutting_one_shard_short_is_not_retried_for_it(tmp_path, origin):
    """A liar the client rates far above the honest origin still cannot use up the attempts."""

    def truncate(version_dir: Path) -> None:
        path = version_dir / "model.safetensors"
        os.truncate(path, path.stat().st_size // 2 + 1000)

    short = serve_store(_damaged_copy(tmp_path, "short", truncate), LYING)
    try:
        for run in range(3):
            out = tmp_path / f"out{run}"
            client = WeightClient([short.url, origin.url], KEY.public_key_hex, out, CFG)
            client.pool.stats[origin.url].failures = 10**6  # weight ~1e-6 of the liar's
            path = client.fetch(1)
            assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
            assert client.pool.stats[short.url].failures > 0
    finally:
        short.stop()


def test_forged_and_unsigned_manifests_are_refused(tmp_path, origin):
    forger = KeyPair.from_seed(b"\x09" * 32)
    ck = write_checkpoint(tmp_path / "evil", random_weights(1000, seed=666))
    Publisher(tmp_path / "forged", forger, CFG).publish(ck, 1)
    forged = serve_store(tmp_path / "forged", CFG)

    def strip_signature(version_dir: Path) -> None:
        mpath = store.manifest_path(version_dir)
        mpath.write_text(mpath.read_text().replace('"signature":"', '"signature":"00', 1))

    tampered = serve_store(_damaged_copy(tmp_path, "tampered", strip_signature), LYING)
    try:
        for server, message in ((forged, "unknown publisher"), (tampered, "signature")):
            client = WeightClient([server.url], KEY.public_key_hex, tmp_path / "o", CFG)
            with pytest.raises(BadSignature, match=message):
                client.fetch(1)
            _assert_clean(tmp_path / "o")
        both = WeightClient([forged.url, origin.url], KEY.public_key_hex, tmp_path / "ok", CFG)
        assert (both.fetch(1) / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
    finally:
        forged.stop()
        tampered.stop()


def test_replayed_older_manifest_and_rollback_are_refused(tmp_path, origin):
    # a relay answers "v2" with the validly signed v1 manifest and bytes
    replay_store = tmp_path / "replay"
    shutil.copytree(tmp_path / "origin", replay_store)
    shutil.copytree(store.ready_dir(replay_store, 1), store.ready_dir(replay_store, 2))
    replay = serve_store(replay_store, LYING)
    try:
        client = WeightClient([replay.url], KEY.public_key_hex, tmp_path / "out", CFG)
        with pytest.raises(ReplayedRequest, match="asked for manifest v2, got a validly signed v1"):
            client.fetch("latest")
        _assert_clean(tmp_path / "out")
        # a client already holding v2 refuses to be rolled back to v1 unless asked
        shutil.copytree(tmp_path / "origin", tmp_path / "only_v1")
        ck2 = write_checkpoint(tmp_path / "ck2", random_weights(128 * 1024, seed=2))
        Publisher(tmp_path / "origin", KEY, CFG).publish(ck2, 2)
        holder = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "held", CFG)
        deadline = time.monotonic() + 5
        while holder.latest_version() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        holder.fetch("latest")
        with pytest.raises(ReplayedRequest, match="rollback"):
            holder.fetch(1)
        only_v1 = serve_store(tmp_path / "only_v1", CFG)
        try:
            behind = WeightClient([only_v1.url], KEY.public_key_hex, tmp_path / "held", CFG)
            with pytest.raises(ReplayedRequest, match="refusing rollback to v1"):
                behind.fetch("latest")
        finally:
            only_v1.stop()
        assert store.ready_versions(tmp_path / "held") == [2]
        assert holder.fetch(1, allow_rollback=True).name == "v00000001"
    finally:
        replay.stop()


def test_a_relay_advertising_a_version_it_cannot_back_is_skipped(tmp_path, origin):
    liar_store = tmp_path / "liar"
    shutil.copytree(tmp_path / "origin", liar_store)
    shutil.copytree(store.ready_dir(liar_store, 1), store.ready_dir(liar_store, 99))
    liar = serve_store(liar_store, LYING)
    try:
        client = WeightClient([liar.url, origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        assert client.advertised_versions() == [99, 1]
        path = client.fetch("latest")
        assert path.name == "v00000001"
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
        assert [(r.source, r.what) for r in client.reports] == [(liar.url, "manifest")]
    finally:
        liar.stop()


def _publish_v2_with_a_delta(tmp_path: Path) -> Path:
    weights = {
        k: v + np.float32(1e-4) * (np.arange(v.size) % 101 == 0)
        for k, v in random_weights(128 * 1024, 1).items()
    }
    ck2 = write_checkpoint(tmp_path / "ck2", weights)
    assert Publisher(tmp_path / "origin", KEY, CFG).publish(ck2, 2).deltas
    return ck2


def test_corrupt_delta_falls_back_to_full_download(tmp_path, origin, caplog):
    client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
    client.fetch(1)
    ck2 = _publish_v2_with_a_delta(tmp_path)
    blob = store.delta_path(store.ready_dir(tmp_path / "origin", 2), 0)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    client.wait_for_newer(timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="swarmrl.shardcast.assemble"):
        path = client.fetch("latest")
    assert "v2: delta for model.safetensors unusable" in caplog.text  # a source's bad bytes
    assert (path / "model.safetensors").read_bytes() == (ck2 / "model.safetensors").read_bytes()
    assert client.last_report.delta_failures and client.last_report.downloaded == [
        "model.safetensors"
    ]
    assert any(r.what == "delta 0" for r in client.reports)


def test_a_delta_whose_source_went_away_is_no_fault_of_the_delta(
    tmp_path, origin, caplog, monkeypatch
):
    """The origin goes between the manifest and the delta (a run's end): the fetch fails as
    unreachable, and the delta is not told as unusable at warning level."""
    client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
    client.fetch(1)
    _publish_v2_with_a_delta(tmp_path)
    client.wait_for_newer(timeout_s=5)
    apply_deltas = Assembly._apply_deltas

    def origin_goes_first(self, *args):
        origin.stop()
        return apply_deltas(self, *args)

    monkeypatch.setattr(Assembly, "_apply_deltas", origin_goes_first)
    with caplog.at_level(logging.DEBUG, logger="swarmrl.shardcast.assemble"):
        with pytest.raises(InfraError, match="Connection refused"):
            client.fetch(2)
    told = [r for r in caplog.records if "v2: delta for model.safetensors" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.DEBUG], told


def test_relay_killed_mid_transfer(tmp_path, origin):
    relay_store = tmp_path / "relay"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmrl.cli",
            "relay",
            "--upstream",
            origin.url,
            "--publisher-key",
            KEY.public_key_hex,
            "--store",
            str(relay_store),
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on "), line
        relay_url = line.split()[-1]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listing = httpx.get(f"{relay_url}/versions", timeout=5).json()
            if listing["versions"] and listing["versions"][-1]["complete"]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("relay did not replicate v1 within 20 s")

        class KillRelayHalfway(FileWriter):
            written = 0

            def write(self, fd, offset, data):
                KillRelayHalfway.written += len(data)
                if KillRelayHalfway.written > 200_000 and proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
                super().write(fd, offset, data)

        client = WeightClient(
            [relay_url, origin.url],
            KEY.public_key_hex,
            tmp_path / "out",
            CFG,
            writer=KillRelayHalfway(),
        )
        path = client.fetch(1)
        assert proc.poll() is not None
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
        assert client.pool.stats[relay_url].failures > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_worker_next_to_a_lying_source_backs_off_instead_of_spinning(tmp_path, origin):
    """The worker's weight loop (fetch the latest, wait for a newer one) beside a source that
    announces v1000000 and can only back it with the replayed v1 manifest."""
    liar_store = tmp_path / "liar"
    shutil.copytree(tmp_path / "origin", liar_store)
    shutil.copytree(store.ready_dir(liar_store, 1), store.ready_dir(liar_store, 1_000_000))
    liar = serve_store(liar_store, LYING)
    client = WeightClient([liar.url, origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
    try:
        loops, started = 0, time.monotonic()
        while time.monotonic() - started < 4.0:
            loops += 1
            assert client.fetch("latest").name == "v00000001"
            try:
                client.wait_for_newer(timeout_s=max(0.1, 4.0 - (time.monotonic() - started)))
            except WaitTimeout:
                pass
        assert loops <= 6, f"{loops} fetch-and-wait loops in 4 s"
        # the pause ends when a real version is announced: v2 at the origin arrives at once
        ck2 = write_checkpoint(tmp_path / "ck2", random_weights(128 * 1024, seed=2))
        Publisher(tmp_path / "origin", KEY, CFG).publish(ck2, 2)
        assert client.wait_for_newer(timeout_s=30) in (2, 1_000_000)
        deadline = time.monotonic() + 30
        while client.fetch("latest").name != "v00000002":
            assert time.monotonic() < deadline
            client.wait_for_newer(timeout_s=1)
    finally:
        liar.stop()


def test_connections_closed_by_an_idle_server_are_not_failures(tmp_path):
    """The server drops kept-alive connections after 0.3 s idle; the client does not know."""
    ck = write_checkpoint(tmp_path / "ck", random_weights(64 * 1024, seed=4))
    Publisher(tmp_path / "store", KEY, CFG).publish(ck, 1)
    server = serve_store(tmp_path / "store", CFG.model_copy(update={"keep_alive_s": 0.3}))
    trusting = CFG.model_copy(update={"keep_alive_s": 60.0})  # believes idle sockets live
    try:
        for config in (trusting, CFG):
            client = WeightClient([server.url], KEY.public_key_hex, tmp_path / "out", config)
            assert client.advertised_versions() == [1]
            time.sleep(0.8)  # the server has closed the idle connection meanwhile
            assert client.advertised_versions() == [1]
            path = client.fetch(1)
            assert (path / "model.safetensors").read_bytes() == (
                ck / "model.safetensors"
            ).read_bytes()
            assert client.pool.stats[server.url].failures == 0
            shutil.rmtree(tmp_path / "out")
    finally:
        server.stop()


class _FallsSilent:
    """A TCP proxy in front of a real server that passes on the first ``after`` bytes the server
    sends on each connection and then nothing more, the connection left open: what a worker
    sees of a relay whose host is cut off mid-transfer."""

    def __init__(self, target: str, after: int) -> None:
        parts = target.rsplit(":", 1)
        self.target = (parts[0].removeprefix("http://"), int(parts[1]))
        self.after = after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.silenced = 0  # connections that reached ``after`` bytes
        self._open: list[socket.socket] = []
        self._closing = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
            self._open += [client, server]
            threading.Thread(target=self._copy, args=(client, server, None), daemon=True).start()
            threading.Thread(
                target=self._copy, args=(server, client, self.after), daemon=True
            ).start()

    def _copy(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if limit is not None and sent + len(data) >= limit:
                    sink.sendall(data[: limit - sent])
                    self.silenced += 1
                    self._closing.wait()  # silent from here on, the connection held open
                    return
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self._closing.set()
        self.listener.close()
        for sock in self._open:
            sock.close()


def test_a_source_gone_silent_mid_body_is_left_for_the_next_at_the_byte_it_reached(
    tmp_path, caplog
):
    """A relay that stops sending part way through a shard (its host cut off: no reset, no
    FIN) holds the fetch for stall_timeout_s, not request_timeout_s: the shard is resumed from
    the origin at the last byte taken in (bodies are read a CHUNK at a time), the rest comes
    from the origin while the silent source rests, and the version is byte-exact."""
    cfg = CFG.model_copy(
        update={"shard_size_bytes": 2 << 20, "stall_timeout_s": 0.5, "request_timeout_s": 60}
    )
    ck = write_checkpoint(tmp_path / "ck", random_weights(3 << 18, seed=6))  # 3 MiB: 2 shards
    Publisher(tmp_path / "store", KEY, cfg).publish(ck, 1)
    origin = serve_store(tmp_path / "store", cfg)
    silent = _FallsSilent(origin.url, after=1_600_000)  # 1.5 MiB into the first shard's answer
    try:
        client = WeightClient([silent.url, origin.url], KEY.public_key_hex, tmp_path / "out", cfg)
        client.pool.stats[origin.url].failures = 10**6  # the silent source is chosen first
        with caplog.at_level(logging.INFO, logger="swarmrl.shardcast.transport"):
            path = client.fetch(1)
        assert (path / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    finally:
        silent.close()
        origin.stop()
    assert silent.silenced >= 1
    stats = client.pool.stats[silent.url]
    assert stats.silences >= 1 and client.pool.resting(silent.url), stats
    assert f"weight source {silent.url} went silent (no byte from {silent.url} for 0.5 s" in (
        caplog.text
    )
    assert re.search(rf"resuming at byte [1-9]\d* of {2 << 20} from {origin.url}", caplog.text)


def test_a_source_that_never_answers_a_request_is_left_after_stall_timeout_s(tmp_path, origin):
    """The silence starts before the answer (the relay's host cut off between two requests)."""
    silent = _FallsSilent(origin.url, after=0)
    cfg = CFG.model_copy(update={"stall_timeout_s": 0.5, "request_timeout_s": 60})
    try:
        client = WeightClient([silent.url, origin.url], KEY.public_key_hex, tmp_path / "out", cfg)
        path = client.fetch(1)
        assert (path / "model.safetensors").read_bytes() == _weights_bytes(tmp_path)
    finally:
        silent.close()
    assert client.pool.stats[silent.url].silences >= 1
    assert client.pool.stats[silent.url].bytes_ok == 0
