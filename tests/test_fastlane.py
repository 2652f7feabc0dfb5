"""The direct lane through uvicorn's httptools protocol (``swarmrl.protocol.fastlane``), on
loopback: its answers go out in one TCP segment, in request order, within every limit the ASGI
path keeps; what it does not take reaches the app unchanged."""

import socket
import struct
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from swarmrl.protocol.fastlane import Answer, Headers
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.serving import ThreadServer

pytest.importorskip("httptools")
LIMITS = HttpLimits(max_head_bytes=8 * 1024, head_timeout_s=0.5, keep_alive_s=0.5)


class Upper:
    """Answers ``POST /lane`` with its body upper-cased; ``app`` goes to the app, ``boom``
    raises."""

    max_body_bytes = 1000

    def __init__(self) -> None:
        self.answered = 0

    def wants(self, raw_path: bytes) -> bool:
        return raw_path == b"/lane"

    def answer(self, raw_path: bytes, headers: Headers, body: bytes) -> Answer | None:
        if body == b"app":
            return None
        if body == b"boom":
            raise RuntimeError("boom")
        self.answered += 1
        return Answer(200, [(b"x-head", dict(headers).get(b"x-head", b"-"))], body.upper())

    def too_large(self) -> Answer:
        return Answer(413, [], b"too large")


async def _app_answer(request: Request) -> PlainTextResponse:
    return PlainTextResponse(b"app: " + await request.body())


def _serve(lane: Upper):
    """A server whose lane is ``lane`` and whose app echoes what falls through to it."""
    app = Starlette(routes=[Route("/{path:path}", _app_answer, methods=["GET", "POST"])])
    with ThreadServer(app, nodelay=True, **uvicorn_options(LIMITS, "httptools", lane)) as server:
        yield server, lane


@pytest.fixture
def lane_server():
    yield from _serve(Upper())


class BigUpper(Upper):
    max_body_bytes = 100_000


@pytest.fixture
def big_lane_server():
    yield from _serve(BigUpper())


def _request(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def _responses(sock: socket.socket, count: int, within_s: float = 10.0) -> list[bytes]:
    """``count`` whole responses (each with a content-length) read from ``sock``."""
    sock.settimeout(within_s)
    data, found = b"", []
    while len(found) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            head = data[:end].decode().lower()
            length = int(head.split("content-length: ")[1].split("\r\n")[0])
            if len(data) >= end + 4 + length:
                found.append(data[: end + 4 + length])
                data = data[end + 4 + length :]
                continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return found


def _data_segments_in(sock: socket.socket) -> int:
    """Linux ``tcp_info.tcpi_data_segs_in``: TCP segments with data this socket received."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("I", info, 152)[0]


def test_a_lane_answer_is_one_segment_and_the_app_answer_is_not(lane_server):
    server, lane = lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        for path, want in (("/lane", 1), ("/other", 2)):  # the app writes head and body apart
            before = _data_segments_in(sock)
            sock.sendall(_request(path, b"hello"))
            (response,) = _responses(sock, 1)
            time.sleep(0.2)  # a second segment, if any, has arrived
            assert _data_segments_in(sock) - before == want, path
    assert response.endswith(b"app: hello")
    assert lane.answered == 1


def test_pipelined_requests_are_answered_in_order(lane_server):
    server, lane = lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(
            _request("/lane", b"one", "x-head: 1\r\n")
            + _request("/other", b"two")
            + _request("/lane", b"three")
            + _request("/lane", b"app")
            + _request("/lane", b"four")
        )
        answers = _responses(sock, 5)
    bodies = [a.split(b"\r\n\r\n", 1)[1] for a in answers]
    # behind a request the app still answers, the lane steps aside: the app answers the rest
    assert bodies == [b"ONE", b"app: two", b"app: three", b"app: app", b"app: four"]
    assert b"x-head: 1" in answers[0]


def test_a_body_in_pieces_an_oversized_body_and_a_fault(lane_server):
    server, _ = lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        request = _request("/lane", b"x" * 600)
        for i in range(0, len(request), 97):  # slowly, in pieces
            sock.sendall(request[i : i + 97])
            time.sleep(0.01)
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"X" * 600)
        sock.sendall(_request("/lane", b"x" * 5000))
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer
        assert sock.recv(1024) == b""  # closed, the rest of the body unread
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(_request("/lane", b"boom"))
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 500") and sock.recv(1024) == b""
    with socket.create_connection((server.host, server.port)) as sock:  # still serving
        sock.sendall(_request("/lane", b"ok"))
        assert _responses(sock, 1)[0].endswith(b"OK")


def test_the_head_limits_still_hold_on_the_lane(lane_server):
    server, _ = lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /lane HTTP/1.1\r\nx-big: " + b"a" * 20_000)
        sock.settimeout(5)
        assert sock.recv(1024).startswith(b"HTTP/1.1 431")
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(_request("/lane", b"idle"))
        assert _responses(sock, 1)[0].endswith(b"IDLE")
        sock.settimeout(5)
        started = time.monotonic()
        assert sock.recv(1024) == b""  # an idle kept-alive connection is dropped on time
        assert time.monotonic() - started < 3
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /lane HTTP/1.1\r\ncontent-length: nine\r\n\r\nabc")
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 400")


def test_lane_requests_in_one_read_past_the_head_limit_keep_the_connection(lane_server):
    """Requests the lane answers while their bytes are parsed are not counted as the next
    request's head: ten of them in one read (more bytes than a head may have) are all
    answered, and the connection then serves the next one instead of a 431."""
    server, lane = lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        burst = b"".join(_request("/lane", b"%d" % i + b"x" * 900) for i in range(10))
        assert len(burst) > LIMITS.max_head_bytes
        sock.sendall(burst)
        answers = _responses(sock, 10)
        assert [a.split(b"\r\n")[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 10
        sock.sendall(_request("/lane", b"next"))
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"NEXT")
    assert lane.answered == 11


def test_a_large_lane_body_ending_a_read_is_not_the_next_head(big_lane_server):
    """A body larger than a head may be, whose last read the lane answers, does not count
    toward the next request's head: the connection serves the next request (a submission
    followed by a lease on one kept-alive connection)."""
    server, lane = big_lane_server
    with socket.create_connection((server.host, server.port)) as sock:
        request = _request("/lane", b"y" * 50_000)
        sock.sendall(request[:2000])
        time.sleep(0.2)  # the head and the body's start arrive first
        sock.sendall(request[2000:])
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"Y" * 100)
        sock.sendall(_request("/lane", b"next"))
        (answer,) = _responses(sock, 1)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"NEXT")
    assert lane.answered == 2


def test_a_peer_sending_while_leaving_the_lanes_answers_unread_is_dropped():
    lane = Upper()
    app = Starlette(routes=[Route("/{path:path}", _app_answer, methods=["GET", "POST"])])
    limits = HttpLimits(max_unread_bytes=64 * 1024)
    with ThreadServer(app, **uvicorn_options(limits, "httptools", lane)) as server:
        flood = _request("/lane", b"x" * 900) * 200  # each answered at once, ~1 KB back
        with socket.create_connection((server.host, server.port)) as sock:
            sock.settimeout(5)
            dropped = False
            try:
                for _ in range(150):  # ~30 MB of answers if none were dropped, past the kernel's
                    sock.sendall(flood)
            except (ConnectionResetError, BrokenPipeError):
                dropped = True
            if not dropped:
                try:
                    while sock.recv(1 << 16):
                        pass
                    dropped = True
                except ConnectionResetError:
                    dropped = True
        assert dropped
        assert lane.answered < 150 * 200  # it stopped answering the flood
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(_request("/lane", b"ok"))
            (answer,) = _responses(sock, 1)
        assert answer.endswith(b"OK")
