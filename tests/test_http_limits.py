"""The request-head guard on both HTTP parsers uvicorn may use (h11, httptools), on loopback."""

import asyncio
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.serving import ThreadServer

LIMITS = HttpLimits(max_head_bytes=8 * 1024, head_timeout_s=0.5, keep_alive_s=0.5)


async def _slow(request):
    await asyncio.sleep(float(request.query_params.get("s", "0")))
    return PlainTextResponse("ok")


@pytest.fixture(params=["h11", "httptools"])
def server(request):
    pytest.importorskip(request.param)
    app = Starlette(routes=[Route("/", _slow)])
    with ThreadServer(app, **uvicorn_options(LIMITS, request.param)) as running:
        yield (running.host, running.port)


def _read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection within ``within_s``."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def test_a_head_over_the_limit_gets_431(server):
    with socket.create_connection(server) as sock:
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20))
        except OSError:
            pass
        data, closed = _read_until_closed(sock, 3)
    assert closed and (data == b"" or data.startswith(b"HTTP/1.1 431"))


def test_silent_and_slow_heads_are_dropped_answered_requests_are_not(server):
    silent = socket.create_connection(server)
    slow = socket.create_connection(server)
    try:
        slow.sendall(b"GET / HTTP/1.1\r\n")
        time.sleep(0.3)
        slow.sendall(b"Host: x\r\n")  # the head is still not complete after the timeout
        assert _read_until_closed(silent, 2) == (b"", True)
        assert _read_until_closed(slow, 2) == (b"", True)
        # a request whose head arrived may take longer than the head timeout; two pipelined
        # requests are both answered, then the idle connection is closed
        with socket.create_connection(server) as sock:
            sock.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /?s=1.0 HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            data, closed = _read_until_closed(sock, 4)
        assert data.count(b"HTTP/1.1 200") == 2 and closed
    finally:
        silent.close()
        slow.close()


def _dropped_within(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closed ``sock`` within ``within_s`` in all (reading what it sends)."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def test_a_peer_pipelining_without_reading_is_dropped_and_others_are_served():
    pytest.importorskip("httptools")
    app = Starlette(routes=[Route("/", _slow)])
    limits = HttpLimits(max_pipelined=16)
    with ThreadServer(app, **uvicorn_options(limits, "httptools")) as running:
        address = (running.host, running.port)
        one = b"GET /?s=0.05 HTTP/1.1\r\nHost: x\r\n\r\n"
        # 16 pipelined requests are within the bound: all answered, in order
        with socket.create_connection(address) as sock:
            sock.sendall(one * 16)
            data = b""
            sock.settimeout(10)
            while data.count(b"HTTP/1.1 200") < 16:
                chunk = sock.recv(1 << 16)
                assert chunk, data
                data += chunk
        # thousands queued behind one being answered: the connection is dropped (answering
        # them one by one would take 2,000 s)
        with socket.create_connection(address) as sock:
            try:
                sock.sendall(b"GET /?s=1.0 HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)
            except (ConnectionResetError, BrokenPipeError):
                pass
            assert _dropped_within(sock, 5)
        with socket.create_connection(address) as sock:  # the server is still there
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5)
            assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
