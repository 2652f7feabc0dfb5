"""Peers that fail in the ways the internet fails: a server that accepts a connection and never
answers, a name that does not resolve. The orchestrator's and the weights' clients each end
with one line naming the peer within their timeout, never a hang. (A link dropped mid-shard and
a relay lost mid-transfer: tests/test_shardcast_faults.py, tests/test_hosts_scenarios.py; a
certificate that does not match: tests/test_tls.py.)"""

import socket
import threading
import time

import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.errors import PeerUnavailable
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.shardcast import WeightClient

UNRESOLVABLE = "no-such-host.invalid"  # .invalid never resolves (RFC 2606)


@pytest.fixture
def silent_url():
    """A server that accepts every connection and never reads or answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn, _ in held:
        conn.close()


def _fails_in_one_line(call, within_s: float) -> str:
    started = time.monotonic()
    with pytest.raises(PeerUnavailable) as failed:
        call()
    assert time.monotonic() - started < within_s
    message = str(failed.value)
    assert "\n" not in message
    return message


def test_the_pool_client_gives_up_on_a_server_that_never_answers(silent_url):
    client = PoolClient(silent_url, KeyPair.generate(), timeout_s=2)
    message = _fails_in_one_line(client.pools, within_s=10)
    assert message == f"GET /pools: no answer from {silent_url} in 2.0 s"


def test_the_pool_client_names_a_host_that_does_not_resolve():
    client = PoolClient(f"http://{UNRESOLVABLE}:8600", KeyPair.generate(), timeout_s=2)
    message = _fails_in_one_line(client.pools, within_s=10)
    assert message.startswith(f"GET /pools: cannot reach http://{UNRESOLVABLE}:8600: ")


@pytest.mark.parametrize("where", ["silent", "unresolvable"])
def test_the_weight_client_gives_up_on_a_source_that_never_answers_or_resolves(
    tmp_path, silent_url, where
):
    url = silent_url if where == "silent" else f"http://{UNRESOLVABLE}:8471"
    cfg = ShardcastConfig(request_timeout_s=2, fetch_timeout_s=5)
    client = WeightClient([url], KeyPair.generate().public_key_hex, tmp_path / "out", cfg)
    message = _fails_in_one_line(lambda: client.fetch(1), within_s=15)
    assert message.startswith(f"no source served the manifest of v1: {url}: "), message
