"""Relays on loopback: tiers, immediate notice of new versions, serving while arriving,
client tracking, metrics, Range, and the CLI verbs."""

import json
import os
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import PeerUnavailable, VersionGone
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, WeightClient, store
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.cli import main as cli_main
from swarmrl.shardcast.relay import Follower
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

KEY = KeyPair.from_seed(b"\x05" * 32)
# long-polls are held 20 s: anything that arrives in well under that came from a push
CFG = ShardcastConfig(
    shard_size_bytes=32 * 1024, long_poll_timeout_s=20, request_timeout_s=30, shard_wait_s=0.5
)
# a server over a store damaged on purpose must not repair it at start: it is the liar here
LYING = CFG.model_copy(update={"recheck_on_start": False})


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


class _Relay:
    def __init__(self, root, upstreams):
        self.catalog = Catalog(root, CFG.keep_versions)
        self.follower = Follower(upstreams, [KEY.public_key_hex], self.catalog, CFG)
        self.server = serve_in_thread(build_app(self.catalog, CFG, role="relay"))
        self.follower.start()
        self.url = self.server.url

    def stop(self):
        self.follower.stop(timeout_s=1)
        self.server.stop()


def test_two_tier_relays_push_new_versions_and_ship_deltas(tmp_path):
    weights = random_weights(256 * 1024, seed=3)
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck1", weights), 1)
    origin = serve_store(tmp_path / "origin", CFG)
    tier1 = _Relay(tmp_path / "r1", [origin.url])
    tier2 = _Relay(tmp_path / "r2", [tier1.url])
    try:
        client = WeightClient(
            [tier2.url], KEY.public_key_hex, tmp_path / "out", CFG, client_id="worker-a"
        )
        _wait(lambda: tier2.catalog.latest(complete_only=True) == 1, 15, "v1 at tier 2")
        client.fetch("latest")
        # publish v2: the notice must travel origin -> tier1 -> tier2 -> client by push
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(client.wait_for_newer(timeout_s=15)))
        waiter.start()
        time.sleep(0.3)  # the client's long-poll is parked at tier 2
        bumped = {
            k: v + np.float32(1e-4) * (np.arange(v.size) % 211 == 0) for k, v in weights.items()
        }
        started = time.monotonic()
        m2 = pub.publish(write_checkpoint(tmp_path / "ck2", bumped), 2)
        waiter.join(15)
        notice_s = time.monotonic() - started
        assert got == [2] and notice_s < 12.0, notice_s  # pushed: well inside one 20 s long-poll
        path = client.fetch("latest")
        assert (path / "model.safetensors").read_bytes() == (
            tmp_path / "ck2" / "model.safetensors"
        ).read_bytes()
        assert client.last_report.from_delta == ["model.safetensors"]
        assert client.last_report.network_bytes == sum(d.size for d in m2.deltas)
        # both relays rebuilt v2 from the delta too, not from full shards
        metrics = httpx.get(f"{tier1.url}/metrics").text
        upstream = float(
            next(
                line.split()[1]
                for line in metrics.splitlines()
                if line.startswith("shardcast_upstream_bytes_total")
            )
        )
        assert upstream < m2.total_bytes * 1.2 + sum(
            d.size for d in m2.deltas
        )  # v1 full + v2 delta
        assert "shardcast_latest_version 2" in metrics
        assert "shardcast_bytes_served_total" in metrics
        # tier 2 tracks what its client reported
        seen = httpx.get(f"{tier2.url}/clients").json()
        assert seen["clients"]["worker-a"]["held"] in (1, 2)
        assert httpx.get(f"{tier2.url}/health").json()["status"] == "ok"
    finally:
        tier2.stop()
        tier1.stop()
        origin.stop()


def test_a_relay_passes_on_each_part_of_a_delta_while_the_rest_arrives(tmp_path, monkeypatch):
    """A file's delta comes in parts, one per shard: a relay serves a part it holds (verified)
    while a later part is still on its way, as it does with shards."""
    from swarmrl.shardcast.assemble import Assembly

    weights = random_weights(256 * 1024, seed=4)
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck1", weights), 1)
    origin = serve_store(tmp_path / "origin", CFG)
    relay = _Relay(tmp_path / "relay", [origin.url])
    last_may_come = threading.Event()
    download = Assembly._download

    def last_part_held_back(self, path, size, digest, what, fd, base):
        held_at_relay = str(tmp_path / "relay") in str(self.partial)
        if held_at_relay and what == f"delta {len(self.m.deltas) - 1}":
            last_may_come.wait(15)
        return download(self, path, size, digest, what, fd, base)

    monkeypatch.setattr(Assembly, "_download", last_part_held_back)
    try:
        _wait(lambda: relay.catalog.latest(complete_only=True) == 1, 15, "v1 at the relay")
        bumped = {
            k: v + np.float32(1e-4) * (np.arange(v.size) % 211 == 0) for k, v in weights.items()
        }
        m2 = pub.publish(write_checkpoint(tmp_path / "ck2", bumped), 2)
        assert len(m2.deltas) > 1
        _wait(lambda: relay.catalog.get(2) is not None, 15, "v2 in progress at the relay")
        first = httpx.get(f"{relay.url}/v/2/delta/0", timeout=10)
        blob = store.delta_path(store.ready_dir(tmp_path / "origin", 2), 0).read_bytes()
        assert first.status_code == 200 and first.content == blob
        assert relay.catalog.latest(complete_only=True) == 1  # the last part not there yet
        last = httpx.get(f"{relay.url}/v/2/delta/{len(m2.deltas) - 1}", timeout=10)
        assert last.status_code == 503  # still arriving (the relay holds it 0.5 s, then says so)
        last_may_come.set()
        _wait(lambda: relay.catalog.latest(complete_only=True) == 2, 15, "v2 at the relay")
        client = WeightClient([relay.url], KEY.public_key_hex, tmp_path / "out", CFG)
        client.fetch(1)
        path = client.fetch(2)
        assert client.last_report.from_delta == ["model.safetensors"]
        assert (path / "model.safetensors").read_bytes() == (
            tmp_path / "ck2" / "model.safetensors"
        ).read_bytes()
    finally:
        last_may_come.set()
        relay.stop()
        origin.stop()


def test_clients_behind_are_counted_and_told_at_once(tmp_path):
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck1", random_weights(1000)), 1)
    origin = serve_store(tmp_path / "origin", CFG)
    try:
        headers = {"X-Shardcast-Client": "w1", "X-Shardcast-Held-Version": "0"}
        fast = httpx.get(
            f"{origin.url}/versions/wait?after=0&timeout=10", headers=headers, timeout=15
        )
        assert fast.json()["latest"] == 1  # already behind: answered immediately
        assert httpx.get(f"{origin.url}/clients").json()["clients"]["w1"] == {
            "held": 0,
            "behind": True,
            "last_seen": pytest.approx(time.time(), abs=5),
        }
        assert "shardcast_clients_behind 1" in httpx.get(f"{origin.url}/metrics").text
        started = time.monotonic()
        held = httpx.get(f"{origin.url}/versions/wait?after=1&timeout=0.3", timeout=5)
        assert held.json()["latest"] == 1 and 0.25 < time.monotonic() - started < 3
    finally:
        origin.stop()


def test_relay_serves_verified_shards_while_the_rest_arrives(tmp_path):
    """A version in progress: a ready shard is served, a missing one waits, then 503."""
    Publisher(tmp_path / "origin", KEY, CFG).publish(
        write_checkpoint(tmp_path / "ck", random_weights(64 * 1024)), 1
    )
    manifest = store.load_manifest(store.ready_dir(tmp_path / "origin", 1))
    catalog = Catalog(tmp_path / "relay", 2)
    cfg = CFG.model_copy(update={"shard_wait_s": 2.0})
    server = serve_in_thread(build_app(catalog, cfg, role="relay"))
    try:
        partial = store.new_partial(tmp_path / "relay", 1)
        weights = next(f for f in manifest.files if f.path == "model.safetensors")
        src = (store.ready_dir(tmp_path / "origin", 1) / weights.path).read_bytes()
        (partial / weights.path).write_bytes(src)  # bytes on disk, but not yet verified
        catalog.add_in_progress(manifest, partial)
        first, second = weights.shards[0], weights.shards[1]
        catalog.mark_shard(1, first.index)
        listing = httpx.get(f"{server.url}/versions").json()
        assert listing["versions"][0]["complete"] is False
        ok = httpx.get(f"{server.url}/v/1/shard/{first.index}")
        assert ok.status_code == 200 and ok.content == src[first.offset : first.offset + first.size]
        assert httpx.get(f"{server.url}/v/1/shard/{second.index}").status_code == 503
        threading.Timer(0.2, catalog.mark_shard, args=(1, second.index)).start()
        started = time.monotonic()
        late = httpx.get(f"{server.url}/v/1/shard/{second.index}", headers={"Range": "bytes=10-19"})
        assert late.status_code == 206 and time.monotonic() - started >= 0.15  # it was held
        assert late.content == src[second.offset + 10 : second.offset + 20]
        assert late.headers["content-range"] == f"bytes 10-19/{second.size}"
        bad = httpx.get(
            f"{server.url}/v/1/shard/{first.index}", headers={"Range": f"bytes={first.size}-"}
        )
        assert bad.status_code == 416
        assert httpx.get(f"{server.url}/v/1/shard/99999").status_code == 404
        assert httpx.get(f"{server.url}/v/7/manifest").status_code == 404
    finally:
        server.stop()


def test_cli_publish_serve_and_fetch(tmp_path, capsys):
    KEY.save(tmp_path / "key.json")
    ck = write_checkpoint(tmp_path / "ck", random_weights(50_000))
    assert (
        cli_main(
            "shardcast",
            [
                "publish",
                str(ck),
                "--key",
                str(tmp_path / "key.json"),
                "--store",
                str(tmp_path / "store"),
                "--set",
                "shardcast.shard_size_bytes=65536",
            ],
        )
        == 0
    )
    published = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert published["version"] == 1 and published["shards"] >= 4
    origin = serve_store(tmp_path / "store", CFG)
    try:
        code = cli_main(
            "shardcast",
            [
                "fetch",
                "--source",
                origin.url,
                "--out",
                str(tmp_path / "out"),
                "--publisher-key",
                str(tmp_path / "key.json"),
            ],
        )
        assert code == 0
        out = capsys.readouterr().out.strip().splitlines()[-1]
        assert out.endswith("v00000001")
        assert (tmp_path / "out" / "v00000001" / "model.safetensors").read_bytes() == (
            ck / "model.safetensors"
        ).read_bytes()
        assert os.path.isfile(store.manifest_path(tmp_path / "out" / "v00000001"))
    finally:
        origin.stop()


def test_relay_refuses_forged_upstreams_and_routes_around_corrupt_ones(tmp_path):
    ck = write_checkpoint(tmp_path / "ck", random_weights(256 * 1024, seed=4))
    Publisher(tmp_path / "origin", KEY, CFG).publish(ck, 1)
    Publisher(tmp_path / "forged", KeyPair.from_seed(b"\x66" * 32), CFG).publish(ck, 1)
    shutil.copytree(tmp_path / "origin", tmp_path / "bad")
    weights = store.ready_dir(tmp_path / "bad", 1) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    for offset in range(64, len(data), CFG.shard_size_bytes):
        data[offset] ^= 0x80
    weights.write_bytes(bytes(data))
    origin, forged = (serve_store(tmp_path / n, CFG) for n in ("origin", "forged"))
    bad = serve_store(tmp_path / "bad", LYING)
    fooled = _Relay(tmp_path / "r_forged", [forged.url])
    careful = _Relay(tmp_path / "r_mixed", [bad.url, origin.url])
    try:
        _wait(lambda: careful.catalog.latest(complete_only=True) == 1, 15, "v1 at the relay")
        copy = store.ready_dir(tmp_path / "r_mixed", 1) / "model.safetensors"
        assert copy.read_bytes() == (ck / "model.safetensors").read_bytes()
        metrics = httpx.get(f"{careful.url}/metrics").text
        corrupt = next(
            line
            for line in metrics.splitlines()
            if line.startswith("shardcast_upstream_corrupt_total")
        )
        assert float(corrupt.split()[1]) > 0
        _wait(lambda: fooled.follower.errors, 10, "the forged manifest to be refused")
        assert "unknown publisher" in fooled.follower.errors[0]
        assert httpx.get(f"{fooled.url}/versions").json()["versions"] == []
    finally:
        for node in (fooled, careful, origin, forged, bad):
            node.stop()


@pytest.mark.slow
def test_fetched_version_loads_as_a_policy(tmp_path):
    torch = pytest.importorskip("torch")
    from swarmrl.config.model import TinyModelConfig
    from swarmrl.model.factory import create_tiny_model
    from swarmrl.model.io import load_policy, save_policy
    from swarmrl.model.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+=")
    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = create_tiny_model(tiny, tokenizer)
    Publisher(tmp_path / "store", KEY, CFG).publish(
        save_policy(model, tokenizer, tmp_path / "ck"), 1
    )
    origin = serve_store(tmp_path / "store", CFG)
    try:
        path = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "w", CFG).fetch("latest")
    finally:
        origin.stop()
    loaded, loaded_tokenizer = load_policy(path)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert loaded_tokenizer("12+3")["input_ids"] == tokenizer("12+3")["input_ids"]


def test_a_lying_upstream_does_not_stop_a_relay(tmp_path):
    """Upstreams LIAR,ORIGIN: the liar announces v1000000 (the signed v1 under that name)."""
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    weights = random_weights(64 * 1024, seed=8)
    pub.publish(write_checkpoint(tmp_path / "ck1", weights), 1)
    shutil.copytree(tmp_path / "origin", tmp_path / "liar")
    shutil.copytree(
        store.ready_dir(tmp_path / "liar", 1), store.ready_dir(tmp_path / "liar", 1_000_000)
    )
    origin, liar = serve_store(tmp_path / "origin", CFG), serve_store(tmp_path / "liar", LYING)
    relay = _Relay(tmp_path / "relay", [liar.url, origin.url])
    try:
        assert httpx.get(f"{liar.url}/versions").json()["latest"] == 1_000_000
        _wait(lambda: relay.catalog.latest(complete_only=True) == 1, 15, "v1 at the relay")
        # a new version at the origin arrives by push although the liar announces a higher one
        started = time.monotonic()
        bumped = {k: v + np.float32(1e-3) for k, v in weights.items()}
        pub.publish(write_checkpoint(tmp_path / "ck2", bumped), 2)
        _wait(lambda: relay.catalog.latest(complete_only=True) == 2, 15, "v2 at the relay")
        assert time.monotonic() - started < 12.0  # well inside one 20 s long-poll
        copy = store.ready_dir(tmp_path / "relay", 2) / "model.safetensors"
        assert copy.read_bytes() == (tmp_path / "ck2" / "model.safetensors").read_bytes()
        lies = [e for e in relay.follower.errors if e.startswith("v1000000:")]
        assert lies and "got a validly signed v1" in lies[0]
        assert len(lies) <= 4  # set aside with a growing cool-down, not retried in a loop
        assert 1_000_000 not in [
            v["version"] for v in httpx.get(f"{relay.url}/versions").json()["versions"]
        ]
    finally:
        relay.stop()
        liar.stop()
        origin.stop()


def test_metrics_are_prometheus_text_with_one_registry_per_server(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    pub = Publisher(tmp_path / "a", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck", random_weights(5000)), 1)
    (tmp_path / "b").mkdir()
    a, b = serve_store(tmp_path / "a", CFG), serve_store(tmp_path / "b", CFG)
    try:
        httpx.get(f"{a.url}/v/1/manifest").raise_for_status()

        def scrape(url: str) -> dict[str, float]:
            text = httpx.get(f"{url}/metrics").text
            families = text_string_to_metric_families(text)
            return {s.name: s.value for f in families for s in f.samples}

        seen_a, seen_b = scrape(a.url), scrape(b.url)
        assert seen_a["shardcast_latest_version"] == 1
        assert seen_a["shardcast_manifests_served_total"] == 1
        assert seen_b["shardcast_latest_version"] == -1  # its own registry, its own catalog
        assert "shardcast_manifests_served_total" not in seen_b
    finally:
        a.stop()
        b.stop()


def test_a_pruned_version_is_gone_not_unavailable(tmp_path):
    """A version older than everything a source keeps answers 410; a client asking every such
    source gets VersionGone at once (no retrying for minutes), while a merely unknown newer
    version stays an ordinary miss."""
    keep = CFG.model_copy(update={"keep_versions": 2})
    publisher = Publisher(tmp_path / "origin", KEY, keep)
    for version in range(4):
        ckpt = write_checkpoint(tmp_path / f"ckpt{version}", random_weights(4096, seed=version))
        publisher.publish(ckpt, version)
    origin = serve_store(tmp_path / "origin", keep)
    try:
        assert httpx.get(f"{origin.url}/v/0/manifest").status_code == 410
        assert httpx.get(f"{origin.url}/v/9/manifest").status_code == 404
        client = WeightClient([origin.url], KEY.public_key_hex, tmp_path / "client", keep)
        assert client.fetch(3).name == store.ready_dir(tmp_path / "client", 3).name
        with pytest.raises(VersionGone, match="v1 has been pruned"):
            client.fetch(1, allow_rollback=True)
        with pytest.raises(PeerUnavailable):
            client.fetch(9)
    finally:
        origin.stop()


def test_an_upstream_announcing_ever_newer_versions_is_heard_less_and_less(tmp_path):
    """A real HTTP upstream that answers every poll at once with a higher version it never
    backs (its manifests are 404): the relay still follows the origin and stops hammering it."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    polls = []

    async def versions(request):
        polls.append(time.monotonic())
        v = 1_000_000 + len(polls)
        info = {"version": v, "step": v, "complete": True, "total_bytes": 1}
        return JSONResponse({"latest": v, "versions": [info]})

    async def missing(request):
        return JSONResponse({"error": "unknown version"}, status_code=404)

    app = Starlette(
        routes=[
            Route("/versions", versions),
            Route("/versions/wait", versions),
            Route("/v/{version:int}/manifest", missing),
        ]
    )
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck1", random_weights(16 * 1024, seed=9)), 1)
    origin, liar = serve_store(tmp_path / "origin", CFG), serve_in_thread(app)
    relay = _Relay(tmp_path / "relay", [liar.url, origin.url])
    try:
        _wait(lambda: relay.catalog.latest(complete_only=True) == 1, 15, "v1 at the relay")
        started = len(polls)
        time.sleep(4.0)
        assert len(polls) - started <= 4, f"{len(polls) - started} polls of the liar in 4 s"
    finally:
        relay.stop()
        liar.stop()
        origin.stop()


@pytest.mark.parametrize("quiet_s", [10.0, 0.0])
def test_an_upstream_gone_mid_replication_is_told_as_a_fault_only_once_it_stays_away(
    tmp_path, caplog, monkeypatch, quiet_s
):
    """The run's end: the origin announces its last version and goes before the relay has it.
    Away for less than ``SOURCES_AWAY_QUIET_S`` the relay says so at debug (and keeps trying);
    with the bound at 0 the same failure is a warning."""
    import logging

    from swarmrl.shardcast import relay as relay_module

    monkeypatch.setattr(relay_module, "SOURCES_AWAY_QUIET_S", quiet_s)
    pub = Publisher(tmp_path / "origin", KEY, CFG)
    pub.publish(write_checkpoint(tmp_path / "ck1", random_weights(64 * 1024, seed=8)), 1)
    origin = serve_store(tmp_path / "origin", CFG)
    catalog = Catalog(tmp_path / "relay", CFG.keep_versions)
    follower = Follower([origin.url], [KEY.public_key_hex], catalog, CFG)
    install = follower._install

    def origin_goes_first(manifest):
        origin.stop()  # the manifest was read; the shards are no longer there to fetch
        install(manifest)

    monkeypatch.setattr(follower, "_install", origin_goes_first)
    with caplog.at_level(logging.DEBUG, logger="swarmrl.shardcast.relay"):
        follower.start()
        try:
            _wait(lambda: follower.errors, 60, "the failed replication")
        finally:
            follower.stop(timeout_s=5)
    told = [r for r in caplog.records if "could not replicate v1" in r.getMessage()]
    assert told and "Connection refused" in told[0].getMessage()
    assert told[0].levelno == (logging.DEBUG if quiet_s else logging.WARNING)
    assert catalog.latest(complete_only=True) is None
