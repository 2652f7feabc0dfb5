"""A long-poll's answer carries the new version's signed manifest (``manifest=1``): a relay
replicates a version with no manifest request across its upstream link, a client fetches the
version it was just told of without listing its sources or asking for the manifest, and an
inline manifest is judged exactly as a fetched one, in the place of the source that sent it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import BadSignature, ObjectMissing, PeerError, VersionGone
from swarmrl.identity import KeyPair
from swarmrl.roles.worker.versions import store_version
from swarmrl.shardcast import Publisher, WeightClient
from swarmrl.shardcast import client as client_module
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.client import connections, fetch_manifest, parse_version_list
from swarmrl.shardcast.relay import Follower
from swarmrl.shardcast.transport import SourcePool
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

KEY = KeyPair.from_seed(b"\x07" * 32)
CFG = ShardcastConfig(shard_size_bytes=32 * 1024, long_poll_timeout_s=5, shard_wait_s=0.5)


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {s.name: s.value for f in families for s in f.samples}


def _published(tmp_path, versions: int = 1):
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    for v in range(1, versions + 1):
        pub.publish(write_checkpoint(tmp_path / f"ck{v}", random_weights(64 * 1024, seed=v)), v)
    return pub


def test_a_relay_replicates_a_new_version_without_asking_its_upstream_for_the_manifest(tmp_path):
    pub = _published(tmp_path)
    origin = serve_store(tmp_path / "origin", CFG)
    catalog = Catalog(tmp_path / "relay", CFG.keep_versions)
    follower = Follower([origin.url], [KEY.public_key_hex], catalog, CFG)
    follower.start()
    try:
        deadline = time.monotonic() + 20
        while catalog.latest(complete_only=True) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert catalog.latest(complete_only=True) == 1
        pub.publish(write_checkpoint(tmp_path / "ck2", random_weights(64 * 1024, seed=2)), 2)
        while catalog.latest(complete_only=True) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert catalog.latest(complete_only=True) == 2
        seen = _metrics(origin.url)
        assert seen.get("shardcast_manifests_served_total", 0) == 0  # no /v/N/manifest asked
        assert seen["shardcast_manifests_inline_total"] == 2
        assert follower.pool.reports == []
    finally:
        follower.stop(timeout_s=1)
        origin.stop()


def test_a_long_poll_carries_the_manifest_only_when_asked_and_only_of_a_newer_version(tmp_path):
    _published(tmp_path)
    origin = serve_store(tmp_path / "origin", CFG)
    try:
        plain = httpx.get(f"{origin.url}/versions/wait?after=0&timeout=1").json()
        assert "manifest" not in plain and plain["latest"] == 1  # older clients: unchanged
        assert "manifest" not in httpx.get(f"{origin.url}/versions").json()
        asked = httpx.get(f"{origin.url}/versions/wait?after=0&timeout=1&manifest=1").json()
        fetched = httpx.get(f"{origin.url}/v/1/manifest").json()
        assert asked["manifest"] == fetched
        # nothing newer than what the client holds: the list after the hold, no manifest
        held = httpx.get(f"{origin.url}/versions/wait?after=1&timeout=0.2&manifest=1").json()
        assert held["latest"] == 1 and "manifest" not in held
    finally:
        origin.stop()


def test_a_forged_inline_manifest_is_reported_against_its_sender_and_the_next_source_serves(
    tmp_path,
):
    _published(tmp_path)
    good = serve_store(tmp_path / "origin", CFG)
    liar = "http://127.0.0.1:9"  # never asked: its manifest came inline
    try:
        real = httpx.get(f"{good.url}/v/1/manifest").json()
        forged = real | {"step": real["step"] + 1}  # the signature no longer covers it
        conns = connections(CFG, {})
        pool = SourcePool([liar, good.url])
        pool.ordered = lambda: [liar, good.url]  # the liar is asked first
        manifest = fetch_manifest(
            pool, conns, 1, [KEY.public_key_hex], held=None, allow_rollback=False,
            offered={liar: forged},
        )  # fmt: skip
        assert manifest.version == 1 and manifest.signature == real["signature"]
        assert [(r.source, r.what) for r in pool.reports] == [(liar, "manifest")]
        # the liar alone: its forgery is refused as the peer error it is, never installed
        alone = SourcePool([liar])
        with pytest.raises(PeerError) as refused:
            fetch_manifest(
                alone, conns, 1, [KEY.public_key_hex], held=None, allow_rollback=False,
                offered={liar: forged},
            )  # fmt: skip
        assert isinstance(refused.value, BadSignature), refused.value
        # an inline manifest of a version other than the one asked for is refused too
        with pytest.raises(PeerError):
            fetch_manifest(
                SourcePool([liar]), conns, 2, [KEY.public_key_hex], held=None,
                allow_rollback=False, offered={liar: real},
            )  # fmt: skip
    finally:
        good.stop()


def test_a_client_fetches_the_version_a_long_poll_announced_without_listing_or_asking_again(
    tmp_path, monkeypatch
):
    pub = _published(tmp_path)
    origin = serve_store(tmp_path / "origin", CFG)
    try:
        client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        client.fetch("latest")
        before = _metrics(origin.url)
        waiter = threading.Thread(target=lambda: got.append(client.wait_for_newer(timeout_s=10)))
        got: list[int] = []
        waiter.start()
        time.sleep(0.3)  # parked at the origin
        pub.publish(write_checkpoint(tmp_path / "ck2", random_weights(64 * 1024, seed=2)), 2)
        waiter.join(10)
        assert got == [2]
        assert store_version(client.fetch("latest")) == 2
        after = _metrics(origin.url)
        # neither the listing nor the manifest was asked for: the notice carried both
        assert after["shardcast_listings_served_total"] == before["shardcast_listings_served_total"]
        assert after.get("shardcast_manifests_served_total", 0) == before.get(
            "shardcast_manifests_served_total", 0
        )
        assert after["shardcast_manifests_inline_total"] == 1
        # a notice taken once: the next fetch lists the sources again (nothing newer: held)
        assert store_version(client.fetch("latest")) == 2
        assert _metrics(origin.url)["shardcast_listings_served_total"] == (
            after["shardcast_listings_served_total"] + 1
        )
        # a notice grown stale stands in for nothing: the fetch lists the sources
        monkeypatch.setattr(client_module, "NOTICE_FRESH_S", 0.0)
        got.clear()
        waiter = threading.Thread(target=lambda: got.append(client.wait_for_newer(timeout_s=10)))
        waiter.start()
        time.sleep(0.3)
        pub.publish(write_checkpoint(tmp_path / "ck3", random_weights(64 * 1024, seed=3)), 3)
        waiter.join(10)
        listed = _metrics(origin.url)["shardcast_listings_served_total"]
        assert got == [3] and store_version(client.fetch("latest")) == 3
        assert _metrics(origin.url)["shardcast_listings_served_total"] == listed + 1
    finally:
        origin.stop()


NASTY_LISTINGS = [
    b'{"latest":1,"versions":[],"manifest":5}',
    b'{"latest":1,"versions":[],"manifest":{"a":NaN}}',
    b'{"latest":1,"versions":[],"manifest":{"a":"\\ud800"}}',
    b'{"latest":1,"versions":[],"manifest":{"a\\u0000":"\\u0000"}}',
    b'{"latest":1,"versions":[],"manifest":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
    b'{"latest":1,"versions":[],"manifest":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
]


@pytest.mark.parametrize("raw", NASTY_LISTINGS, ids=range(len(NASTY_LISTINGS)))
def test_a_nasty_inline_manifest_is_a_peer_error_and_nothing_is_installed(tmp_path, raw):
    """What a source may send with its notice: a listing the client cannot parse is a
    PeerError; one it can parse carries a manifest that is refused, reported against its sender,
    and the next source serves the real one."""
    _published(tmp_path)
    good = serve_store(tmp_path / "origin", CFG)
    liar = "http://127.0.0.1:9"
    try:
        try:
            listing = parse_version_list(raw)
        except PeerError:
            return  # refused whole, as a malformed listing always was
        conns = connections(CFG, {})
        pool = SourcePool([liar, good.url])
        pool.ordered = lambda: [liar, good.url]
        manifest = fetch_manifest(
            pool, conns, 1, [KEY.public_key_hex], held=None, allow_rollback=False,
            offered={liar: listing.manifest},
        )  # fmt: skip
        assert manifest.version == 1
        assert [(r.source, r.what) for r in pool.reports] == [(liar, "manifest")]
    finally:
        good.stop()


def test_a_manifest_that_came_with_a_notice_stands_in_once_and_a_pruned_version_is_gone(
    tmp_path, monkeypatch
):
    """A manifest a source sent with its notice is taken once: kept, it stood in for the
    source after the source pruned that version, and a validator asking for it again to replay
    a late unit met the missing shards (a transient error) on every retry, for its whole
    ``give_up_s``, while the swarm waited for its verdicts. Now the second request asks the
    source, which says the version is gone; a stale offer is not taken at all."""
    pub = _published(tmp_path)
    origin = serve_store(tmp_path / "origin", CFG)
    try:
        client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "out", CFG)
        client.fetch("latest")
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(client.wait_for_newer(timeout_s=10)))
        waiter.start()
        time.sleep(0.3)  # parked at the origin
        pub.publish(write_checkpoint(tmp_path / "ck2", random_weights(64 * 1024, seed=2)), 2)
        waiter.join(10)
        assert got == [2]  # v2's manifest came with the notice; v2 is not fetched
        for v in range(3, CFG.keep_versions + 3):  # the origin prunes v2
            pub.publish(write_checkpoint(tmp_path / f"ck{v}", random_weights(64 * 1024, seed=v)), v)
        deadline = time.monotonic() + 10  # the origin rescans its store
        while httpx.get(f"{origin.url}/v/2/manifest").status_code != 410:
            assert time.monotonic() < deadline, "the origin still serves v2"
            time.sleep(0.1)
        with pytest.raises((ObjectMissing, VersionGone)):  # the offer, taken while fresh
            client.fetch(2, allow_rollback=True)
        with pytest.raises(VersionGone):  # asked of the source: gone, not retried
            client.fetch(2, allow_rollback=True)
        # a stale offer stands in for nothing: the source is asked at once
        monkeypatch.setattr(client_module, "NOTICE_FRESH_S", 0.0)
        got.clear()
        waiter = threading.Thread(target=lambda: got.append(client.wait_for_newer(0, 10)))
        waiter.start()
        waiter.join(10)
        latest = CFG.keep_versions + 2
        assert got == [latest]
        with pytest.raises(VersionGone):
            client.fetch(2, allow_rollback=True)
        assert store_version(client.fetch(latest)) == latest
    finally:
        origin.stop()
