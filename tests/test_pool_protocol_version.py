"""A client older than its orchestrator stops with one line saying to upgrade, not a parse
traceback: the orchestrator names its protocol version in ``/health``, and a client that cannot
read an answer asks for it (``swarmrl.pool.client``). The newer orchestrator here is a small
HTTP server on loopback answering what a real orchestrator answered, with one field this
version does not know added, as the next protocol version would."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from swarmrl.errors import PeerUnavailable, ProtocolMismatch
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PROTOCOL_VERSION
from swarmrl.testing.pool_nodes import quiet_pool

POOL = "proto"


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real orchestrator's answers: ``/health`` and the pool's info."""
    with quiet_pool(tmp_path_factory.mktemp("proto"), POOL) as (server, _owner):
        health = httpx.get(server.url + "/health", timeout=10).json()
        info = httpx.get(server.url + f"/pools/{POOL}", timeout=10).json()
    return health, info


@contextmanager
def newer(health: dict, info: dict) -> Iterator[str]:
    """Serve ``health`` and ``info`` on loopback (GET only); the base URL."""
    answers = {"/health": health, f"/pools/{POOL}": info}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = json.dumps(answers.get(self.path, {"error": "none"})).encode()
            self.send_response(200 if self.path in answers else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_the_orchestrator_names_its_protocol_and_its_answers_parse(real):
    health, info = real
    assert health["protocol"] == PROTOCOL_VERSION
    assert info["spec"]["pool_id"] == POOL


def test_an_older_client_of_a_newer_orchestrator_is_told_to_upgrade(real):
    health, info = real
    spec = dict(info["spec"], rule_of_the_next_version=1)
    with newer(health | {"protocol": PROTOCOL_VERSION + 1}, info | {"spec": spec}) as url:
        with PoolClient(url, KeyPair.generate(), timeout_s=10) as client:
            with pytest.raises(ProtocolMismatch) as refused:
                client.pool(POOL)
    message = str(refused.value)
    assert "\n" not in message
    assert f"speaks pool protocol {PROTOCOL_VERSION + 1}" in message
    assert message.endswith("upgrade swarmrl"), message


@pytest.mark.parametrize("protocol", [PROTOCOL_VERSION, None, "NaN"])
def test_an_unreadable_answer_of_the_same_protocol_is_an_unavailable_peer(real, protocol):
    """Not an upgrade (the orchestrator is not newer, or does not say): the call's error names
    what did not parse."""
    health, info = real
    spec = dict(info["spec"], rule_of_the_next_version=1)
    with newer(health | {"protocol": protocol}, info | {"spec": spec}) as url:
        with PoolClient(url, KeyPair.generate(), timeout_s=10) as client:
            with pytest.raises(PeerUnavailable) as refused:
                client.pool(POOL)
    message = str(refused.value)
    assert "unreadably" in message and "rule_of_the_next_version" in message, message
    assert "\n" not in message
