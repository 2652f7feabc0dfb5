"""A node whose clock is minutes off still gets its signed requests accepted: the client learns
the orchestrator's clock from its answers and signs in the server's time. The server's window
is unchanged, so replay stays closed."""

import time

import httpx
import pytest

from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol.pool import Heartbeat
from swarmrl.testing.pool_nodes import CPU_NODE, quiet_pool

POOL = "skew"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with quiet_pool(tmp_path_factory.mktemp("skew"), POOL) as running:
        yield running


@pytest.mark.parametrize("skew_s", [90.0, -90.0, 600.0, -3600.0])
def test_a_node_whose_clock_is_off_joins_and_beats(pool, skew_s):
    """+90 s is past the 5 s accepted ahead, −90 s past the 60 s window behind."""
    server, owner = pool
    node = KeyPair.generate()
    client = PoolClient(server.url, node, clock=lambda: time.time() + skew_s)
    # its very first request is a signed one: refused for its timestamp, signed again
    view = client.join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
    assert view.node_id == node.node_id
    assert abs(client.clock_offset_s + skew_s) < 2.0, client.clock_offset_s
    # deadlines the orchestrator sets are read on its clock, not this machine's
    assert abs(client.server_time() - time.time()) < 2.0
    for _ in range(3):
        client.heartbeat(POOL, Heartbeat(status="ok"))


def test_an_honest_clock_is_left_alone(pool):
    server, owner = pool
    client = PoolClient(server.url, KeyPair.generate())
    client.join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
    client.heartbeat(POOL, Heartbeat(status="ok"))
    assert client.clock_offset_s == 0.0


def _post(server, key, path, body, **sign_kw):
    headers = sign_request(key, "POST", path, body, **sign_kw) | JSON
    return httpx.post(server.url + path, content=body, headers=headers, timeout=10)


def test_the_window_still_refuses_what_it_refused(pool):
    """The server judges exactly as before: a request dated 90 s ahead of its clock, or one
    replayed, is refused whatever clients learn."""
    server, owner = pool
    node = KeyPair.generate()
    PoolClient(server.url, node).join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
    path, body = f"/pools/{POOL}/heartbeat", b'{"status":"ok"}'
    ahead = _post(server, node, path, body, now_s=time.time() + 90)
    assert ahead.status_code == 401 and "from server time" in ahead.text, ahead.text
    headers = sign_request(node, "POST", path, body) | JSON
    first = httpx.post(server.url + path, content=body, headers=headers, timeout=10)
    again = httpx.post(server.url + path, content=body, headers=headers, timeout=10)
    assert first.status_code == 200, first.text
    assert again.status_code == 401 and "already used" in again.text, again.text
