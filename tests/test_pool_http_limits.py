"""What a stranger can cost the orchestrator before authentication: request heads and sockets.

A real orchestrator on loopback; the hostile peers are raw sockets.
"""

import socket
import threading
import time

import httpx

from swarmrl.identity import KeyPair
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.protocol.http_limits import HttpLimits

LIMITS = HttpLimits(max_head_bytes=16 * 1024, head_timeout_s=0.5, keep_alive_s=0.5)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _health_s(url: str) -> float:
    """The median time of five /health requests: the server's quiet pace on this machine now."""
    times = []
    for _ in range(5):
        t = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        times.append(time.monotonic() - t)
    return sorted(times)[2]


def test_orchestrator_refuses_huge_heads_and_drops_silent_sockets(tmp_path):
    with OrchestratorServer(make_context(KeyPair.generate(), tmp_path), limits=LIMITS) as server:
        address = (server.host, server.port)
        replies: list[bytes] = []
        sent = [0]  # attack bytes the server took before it cut the connection

        def attack() -> None:
            with socket.create_connection(address) as sock:
                try:
                    sock.sendall(b"POST /pools HTTP/1.1\r\nHost: x\r\nX-Big: ")
                    for _ in range(96):  # up to 96 MiB, unauthenticated
                        sock.sendall(b"a" * (1 << 20))
                        sent[0] += 1 << 20
                except OSError:
                    pass  # closed by the server: what we want
                sock.settimeout(5)
                try:
                    replies.append(sock.recv(4096))
                except OSError:
                    replies.append(b"")

        quiet = _health_s(server.url)
        started = time.monotonic()
        thread = threading.Thread(target=attack)
        thread.start()
        worst = 0.0
        while thread.is_alive() and time.monotonic() - started < 30:
            t = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - t)
        thread.join(30)
        # cut off after its head limit (plus what the kernel buffers), not after 96 MiB; and
        # /health kept answering at about its quiet pace (the bound scales with the machine's load)
        assert sent[0] <= 32 << 20, sent[0]
        assert worst < 1.0 + 20 * quiet, (worst, quiet)
        assert replies and (replies[0] == b"" or replies[0].startswith(b"HTTP/1.1 431"))

        idle = [socket.create_connection(address) for _ in range(50)]
        try:
            assert all(_closed_by_server(sock, 2.0) for sock in idle)
        finally:
            for sock in idle:
                sock.close()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
