"""What a stranger can cost an origin or relay: client reports, request heads, idle sockets.

Real servers on loopback; the hostile peers are raw sockets and plain HTTP clients.
"""

import socket
import threading
import time

import httpx
import pytest

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

KEY = KeyPair.from_seed(b"\x0b" * 32)
CFG = ShardcastConfig(
    shard_size_bytes=16 * 1024,
    long_poll_timeout_s=3,
    max_clients=50,
    header_timeout_s=0.5,
    keep_alive_s=0.5,
    max_header_bytes=16 * 1024,
)


@pytest.fixture
def origin(tmp_path):
    Publisher(tmp_path / "store", KEY, CFG).publish(
        write_checkpoint(tmp_path / "ck", random_weights(4096)), 1
    )
    server = serve_store(tmp_path / "store", CFG)
    yield server
    server.stop()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1 << 16) == b"" or sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_client_reports_are_bounded_in_count_and_size(origin):
    with httpx.Client(base_url=origin.url) as http:
        for i in range(120):
            headers = {"X-Shardcast-Client": f"w{i}", "X-Shardcast-Held-Version": "1"}
            assert http.get("/versions", headers=headers).status_code == 200
        for bad in ("x" * 8192, "y" * 65, "\u00e9t\u00e9", "w1;w2"):
            answer = http.get("/versions", headers={"X-Shardcast-Client": bad.encode("utf-8")})
            assert answer.status_code == 400 and "X-Shardcast-Client" in answer.json()["error"]
        for held in ("-1", "1e9", "9" * 5000, "NaN"):
            answer = http.get(f"/versions/wait?after=0&held={held}")
            assert answer.status_code == 400, held
        listing = http.get("/clients")
        clients = listing.json()["clients"]
        assert len(clients) == 50 and "w119" in clients and "w0" not in clients
        assert len(listing.content) < 8192
        assert "shardcast_client_reports_refused_total 8" in http.get("/metrics").text


def _health_s(url: str) -> float:
    """The median time of five /health requests: the server's quiet pace on this machine now."""
    times = []
    for _ in range(5):
        t = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        times.append(time.monotonic() - t)
    return sorted(times)[2]


def test_a_huge_request_head_is_refused_at_once(origin):
    replies: list[bytes] = []
    sent = [0]  # attack bytes the server took before it cut the connection

    def attack() -> None:
        with socket.create_connection(_address(origin.url)) as sock:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
                for _ in range(96):  # up to 96 MiB, one MiB at a time
                    sock.sendall(b"a" * (1 << 20))
                    sent[0] += 1 << 20
            except OSError:
                pass  # the server closed the connection: what we want
            sock.settimeout(5)
            try:
                replies.append(sock.recv(4096))
            except OSError:
                replies.append(b"")

    quiet = _health_s(origin.url)
    started = time.monotonic()
    thread = threading.Thread(target=attack)
    thread.start()
    worst = 0.0
    while thread.is_alive() and time.monotonic() - started < 30:
        t = time.monotonic()
        assert httpx.get(f"{origin.url}/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t)
    thread.join(30)
    # cut off after its head limit (plus what the kernel buffers), not after 96 MiB; and
    # /health kept answering at about its quiet pace (the bound scales with the machine's load)
    assert sent[0] <= 32 << 20, sent[0]
    assert replies and (replies[0] == b"" or replies[0].startswith(b"HTTP/1.1 431"))
    assert worst < 1.0 + 20 * quiet, (worst, quiet)


def test_idle_and_slow_connections_are_dropped_but_long_polls_are_not(origin):
    host, port = _address(origin.url)
    idle = [socket.create_connection((host, port)) for _ in range(40)]
    slow = socket.create_connection((host, port))
    try:
        # a long-poll held past the head timeout is answered, not dropped
        started = time.monotonic()
        held = httpx.get(f"{origin.url}/versions/wait?after=1&timeout=1.5", timeout=10)
        assert held.status_code == 200 and time.monotonic() - started > 1.4
        for chunk in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n"):
            try:
                slow.sendall(chunk)  # a head trickling in slower than the timeout allows
            except OSError:
                break
            time.sleep(0.3)
        assert all(_closed_by_server(sock, 2.0) for sock in idle)
        assert _closed_by_server(slow, 2.0)
        # a kept-alive connection that goes quiet after its response is dropped too
        with socket.create_connection((host, port)) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            kept.settimeout(2)
            assert kept.recv(4096).startswith(b"HTTP/1.1 200")
            assert _closed_by_server(kept, 2.0)
    finally:
        for sock in [*idle, slow]:
            sock.close()
