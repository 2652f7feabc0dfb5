"""Bytes flipped on the wire (``swarmrl.testing.linkproxy``'s ``corrupt``): what a broken
middlebox, or a lying relay's link, delivers past TCP's checksum. A weight fetch through such a
link ends byte-exact or fails with a clear error, and never keeps a flipped byte; the
orchestrator answers every damaged request with a refusal (never a 5xx, never a silent accept)
and goes on serving. Loopback only."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import InfraError, PeerError
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol.pool import Heartbeat
from swarmrl.shardcast import Publisher, WeightClient
from swarmrl.testing.linkproxy import Impairment, LinkProxy
from swarmrl.testing.pool_nodes import CPU_NODE, quiet_pool
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

KEY = KeyPair.from_seed(b"\x0c" * 32)
CFG = ShardcastConfig(shard_size_bytes=32 * 1024, request_timeout_s=10, shard_wait_s=0.5)
POOL = "wire"


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def origin(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ck", random_weights(256 * 1024, seed=4))
    Publisher(tmp_path / "origin", KEY, CFG).publish(checkpoint, 1)
    server = serve_store(tmp_path / "origin", CFG)
    yield server, checkpoint
    server.stop()


def _proxy_url(proxy: LinkProxy) -> str:
    return f"http://{proxy.address[0]}:{proxy.address[1]}"


def test_a_fetch_across_a_corrupting_link_and_a_clean_one_ends_byte_exact(tmp_path, origin):
    """One source behind a link that flips a bit in 2 % of its segments (heads and bodies
    alike), the origin reachable directly too: the fetch ends with the signed bytes, and the
    damaged source is what the client's reports name."""
    server, checkpoint = origin
    port = int(server.url.rsplit(":", 1)[1])
    with LinkProxy(("127.0.0.1", port), down=Impairment(corrupt=0.02), seed=3) as proxy:
        url = _proxy_url(proxy)
        client = WeightClient([url, server.url], KEY.public_key_hex, tmp_path / "out", CFG)
        for _ in range(3):  # the source order is weighted: fetch until the proxy carried bytes
            path = client.fetch(1)
            if proxy.flips:
                break
            client = WeightClient([url, server.url], KEY.public_key_hex, tmp_path / "out2", CFG)
        assert proxy.flips > 0
    for name in ("model.safetensors", "config.json"):
        assert _digest(path / name) == _digest(checkpoint / name), name


def test_a_fetch_across_only_a_corrupting_link_is_exact_or_a_clear_failure(tmp_path, origin):
    """The only source behind a link that flips bits: each attempt ends with the signed bytes
    on disk or with a PeerError/InfraError (a source that served corrupt bytes is given up for
    that fetch), nothing unverified is left as a version, and the verified shards an attempt
    kept carry the next one (as a worker's retries do) to the exact version."""
    server, checkpoint = origin
    port = int(server.url.rsplit(":", 1)[1])
    with LinkProxy(("127.0.0.1", port), down=Impairment(corrupt=0.01), seed=5) as proxy:
        out = tmp_path / "out"
        client = WeightClient([_proxy_url(proxy)], KEY.public_key_hex, out, CFG)
        outcomes: list[str] = []
        for _ in range(20):
            try:
                path = client.fetch(1)
            except (PeerError, InfraError) as exc:
                outcomes.append(type(exc).__name__)
                assert client.held_version() is None, "a failed fetch left a version"
            else:
                outcomes.append("exact")
                break
        assert proxy.flips > 0
    assert outcomes[-1] == "exact", outcomes
    assert _digest(path / "model.safetensors") == _digest(checkpoint / "model.safetensors")
    print(f"attempts: {outcomes}")


@pytest.fixture
def pool(tmp_path):
    with quiet_pool(tmp_path, POOL) as running:
        yield running


def test_the_orchestrator_refuses_what_a_corrupting_link_damaged_and_goes_on(pool):
    """Signed heartbeats sent across a link that flips a bit in 30 % of the segments towards
    the orchestrator: every answer that arrives is a 200 or a 4xx refusal (a flipped body fails
    its signature; a flipped head is malformed), none a 5xx; the damaged ones are refused, and
    a clean request afterwards is served."""
    server, owner = pool
    node = KeyPair.generate()
    PoolClient(server.url, node).join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
    port = int(server.url.rsplit(":", 1)[1])
    path = f"/pools/{POOL}/heartbeat"
    statuses: list[int | str] = []
    with LinkProxy(("127.0.0.1", port), up=Impairment(corrupt=0.3), seed=11) as proxy:
        url = _proxy_url(proxy)
        for _ in range(60):
            body = Heartbeat(status="ok").model_dump_json().encode()
            headers = sign_request(node, "POST", path, body) | {"Content-Type": "application/json"}
            try:  # a fresh connection each: a damaged head may leave a stream out of step
                reply = httpx.post(url + path, content=body, headers=headers, timeout=10)
                statuses.append(reply.status_code)
                if reply.status_code >= 400:
                    assert "error" in reply.json() or reply.status_code in (400, 408), reply.text
            except httpx.HTTPError as exc:  # a head damaged past parsing: the connection closed
                statuses.append(type(exc).__name__)
        flips = proxy.flips
    assert flips > 0
    codes = [s for s in statuses if isinstance(s, int)]
    assert all(c < 500 for c in codes), statuses
    assert 200 in codes and any(c >= 400 for c in codes), statuses  # some damaged, some not
    print({s: statuses.count(s) for s in set(statuses)}, f"{flips} bits flipped")
    time.sleep(0.1)
    clean = PoolClient(server.url, node)
    clean.heartbeat(POOL, Heartbeat(status="ok"))
    assert httpx.get(server.url + "/healthz", timeout=10).status_code < 500
