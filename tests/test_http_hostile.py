"""Hostile HTTP against every server of the pool and of shardcast: the same line on every path.

Real servers on loopback (an orchestrator with its direct lane and its FastAPI routes, one behind
a front process, an origin, a relay); the hostile peers are raw sockets. Each case asserts the
answer (status and error body), that the socket is closed in bounded time, and for bodies
trickled in tiny chunks that the server's memory stays bounded.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from swarmrl.config.pool import PoolConfig
from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.protocol import http_limits
from swarmrl.protocol.http_limits import HttpLimits, uvicorn_options
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams
from swarmrl.serving import ThreadServer
from swarmrl.shardcast import Publisher
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.relay import Follower
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator
from swarmrl.testing.shardcast import random_weights, serve_store, write_checkpoint

BODY_CAP = 4 << 20  # the orchestrator's max_body_bytes here
LIMITS = HttpLimits(head_timeout_s=2.0, keep_alive_s=2.0, body_timeout_s=2.0)
KEY = KeyPair.from_seed(b"\x0c" * 32)
CFG = ShardcastConfig(shard_size_bytes=16 * 1024, header_timeout_s=2.0, keep_alive_s=2.0)
HEARTBEAT = "/pools/p1/heartbeat"  # answered by the direct lane
JOIN = "/pools/p1/join"  # answered by FastAPI
CLOSED_WITHIN_S = 8.0  # the limits' 2 s, with room for a loaded machine


@pytest.fixture(scope="module")
def orchestrator(tmp_path_factory):
    ctx = make_context(
        KeyPair.generate(), tmp_path_factory.mktemp("orch"), PoolConfig(max_body_bytes=BODY_CAP)
    )
    with OrchestratorServer(ctx, limits=LIMITS) as server:
        yield (server.host, server.port)


@pytest.fixture(scope="module")
def patient_orchestrator(tmp_path_factory):
    """As ``orchestrator``, with a 60 s body timeout: a test of the byte count must not turn
    into a test of how fast a loaded machine parses a million 2-byte chunks."""
    ctx = make_context(
        KeyPair.generate(), tmp_path_factory.mktemp("orch"), PoolConfig(max_body_bytes=BODY_CAP)
    )
    limits = HttpLimits(head_timeout_s=2.0, keep_alive_s=2.0, body_timeout_s=60.0)
    with OrchestratorServer(ctx, limits=limits) as server:
        yield (server.host, server.port)


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    Publisher(root / "store", KEY, CFG).publish(
        write_checkpoint(root / "ck", random_weights(4096)), 1
    )
    server = serve_store(root / "store", CFG)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def relay(origin, tmp_path_factory):
    """A relay as ``swarmrl relay`` runs one: a follower of the origin and its server."""
    catalog = Catalog(tmp_path_factory.mktemp("relay") / "store", CFG.keep_versions)
    follower = Follower([origin.url], [KEY.public_key_hex], catalog, CFG)
    follower.start()
    server = serve_in_thread(build_app(catalog, CFG, role="relay"))
    yield server
    server.stop()
    follower.stop()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _exchange(address: tuple[str, int], data: bytes, within_s: float) -> tuple[bytes, bool]:
    """Send ``data`` (the server may cut it short), then read until the server closes: what it
    answered, and whether it closed the connection within ``within_s``."""
    with socket.create_connection(address) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # closed by the server while we sent: it may still have answered
        sock.settimeout(within_s)
        deadline, answer = time.monotonic() + within_s, b""
        try:
            while time.monotonic() < deadline:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return answer, True
                answer += chunk
        except TimeoutError:
            return answer, False
        except ConnectionResetError:
            return answer, True
        return answer, False


def _status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), answer[:200]
    return int(head.split(b" ", 2)[1]), body


def _pool_error(answer: bytes, status: int, code: str) -> None:
    got, body = _status_and_body(answer)
    assert got == status, answer[:300]
    assert json.loads(body)["error"]["code"] == code, body[:300]


def _trickle(path: str, wire_bytes: int) -> bytes:
    """A chunked POST whose body comes in 2-byte chunks, ``wire_bytes`` of them, never ended."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    return head + b"2\r\nab\r\n" * (wire_bytes // 7)


def _unfinished(path: str, method: str = "POST") -> bytes:
    """A complete head promising 1,000 bytes of body, and 10 of them."""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n".encode() + b"{" * 10
    )


def _huge_head(path: str, method: str = "POST") -> bytes:
    """A complete head of 120 KB (limit: 64 KiB), sent in one write."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 120_000}\r\n"
    return head.encode() + b"Content-Length: 2\r\n\r\n{}"


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


# -- the orchestrator -----------------------------------------------------------------------
@pytest.mark.parametrize("path", [HEARTBEAT, JOIN])
def test_a_trickled_chunked_body_costs_its_bytes_and_is_dropped(orchestrator, path):
    """Three sockets each trickle 1.5 MB of 2-byte chunks and never finish: the server (this
    process) holds a few MB for them, not a Python object per chunk, and drops each one in
    bounded time with a 408 in the pool's error form."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from now
    before = _peak_rss_bytes()
    payload = _trickle(path, 1_500_000)
    results: list[tuple[bytes, bool]] = []

    def attack() -> None:
        results.append(_exchange(orchestrator, payload, 20.0))

    started = time.monotonic()
    attackers = [threading.Thread(target=attack) for _ in range(3)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join(30)
    grew = _peak_rss_bytes() - before
    assert all(closed for _, closed in results) and len(results) == 3
    assert time.monotonic() - started < 20
    assert grew < 25 << 20, f"the server's peak RSS grew by {grew >> 20} MiB"
    for answer, _ in results:
        if answer:  # a reset may have beaten the answer to a peer still sending
            _pool_error(answer, 408, "request_timeout")


@pytest.mark.parametrize("path", [HEARTBEAT, JOIN])
def test_a_chunked_body_is_counted_as_it_arrives_framing_included(patient_orchestrator, path):
    """5 MB of 2-byte chunks is 1.4 MB of body but 5 MB on the wire: past the 4 MiB cap."""
    answer, closed = _exchange(patient_orchestrator, _trickle(path, 5_000_000), CLOSED_WITHIN_S)
    assert closed
    _pool_error(answer, 413, "oversized_request")
    assert f"limit of {BODY_CAP} bytes".encode() in answer


@pytest.mark.parametrize("path", [HEARTBEAT, JOIN])
def test_a_body_that_never_ends_is_answered_408_and_dropped(orchestrator, path):
    started = time.monotonic()
    answer, closed = _exchange(orchestrator, _unfinished(path), CLOSED_WITHIN_S)
    assert closed and time.monotonic() - started < CLOSED_WITHIN_S
    _pool_error(answer, 408, "request_timeout")


@pytest.mark.parametrize("path", [HEARTBEAT, JOIN])
def test_a_huge_head_in_one_read_is_refused(orchestrator, path):
    answer, closed = _exchange(orchestrator, _huge_head(path), CLOSED_WITHIN_S)
    assert closed
    _pool_error(answer, 431, "oversized_request")


@pytest.mark.parametrize("path", [HEARTBEAT, JOIN, "/pools"])
def test_json_nested_too_deep_gets_the_pools_error_form(orchestrator, path):
    body = b"[" * 5000
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    answer, closed = _exchange(orchestrator, request, CLOSED_WITHIN_S)
    assert closed
    _pool_error(answer, 422, "malformed")  # as a body that is not JSON at all


def test_what_uvicorn_refuses_and_unknown_routes_get_the_pools_error_form(orchestrator):
    answer, closed = _exchange(orchestrator, b"GARBAGE\x01 / HTTP/1.1\r\n\r\n", CLOSED_WITHIN_S)
    assert closed
    _pool_error(answer, 400, "peer_error")
    request = b"GET /no/such/route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer, _ = _exchange(orchestrator, request, CLOSED_WITHIN_S)
    _pool_error(answer, 404, "not_found")


# -- behind a front --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_front_decodes_paths_and_holds_the_same_line(tmp_path):
    orch, owner, node = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    orch.save(tmp_path / "orch.json")
    spec = PoolSpec(
        pool_id="open",
        owner_key=owner.public_key_hex,
        task_count=5,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validated_fraction=0.0,
    )
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    proc, url = spawn_orchestrator(
        tmp_path / "run",
        tmp_path / "orch.json",
        [tmp_path / "spec.json"],
        settings={"pool.max_body_bytes": 200_000},
        args=["--fronts", "1"],
    )
    try:
        assert PoolClient(url, node).join("open", CPU_NODE).state == "healthy"
        path, body = "/pools/%6fpen/heartbeat", Heartbeat(status="ok").model_dump_json().encode()
        headers = sign_request(node, "POST", path, body) | {"Content-Type": "application/json"}
        answer = httpx.post(url + path, content=body, headers=headers)
        assert answer.status_code == 200, answer.text  # as the orchestrator answers it directly
        address = _address(url)
        answer, closed = _exchange(address, _trickle(HEARTBEAT, 300_000), CLOSED_WITHIN_S)
        assert closed
        _pool_error(answer, 413, "oversized_request")
        answer, closed = _exchange(address, _huge_head(HEARTBEAT), CLOSED_WITHIN_S)
        assert closed
        _pool_error(answer, 431, "oversized_request")
        for bad in (b"{", b"[" * 5000):
            headers = sign_request(node, "POST", "/pools/open/join", bad)
            answer = httpx.post(
                url + "/pools/open/join",
                content=bad,
                headers=headers | {"Content-Type": "application/json"},
            )
            assert 400 <= answer.status_code < 500 and set(answer.json()) == {"error"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


# -- origin and relay -------------------------------------------------------------------------
@pytest.fixture(params=["origin", "relay"])
def shardcast(request):
    return _address(request.getfixturevalue(request.param).url)


def test_shardcast_drops_a_body_that_never_ends(shardcast):
    """A long-poll (25 s here) whose body never ends: refused at the body's time limit, not
    held until the poll ends."""
    started = time.monotonic()
    request = _unfinished("/versions/wait?after=99", "GET")
    answer, closed = _exchange(shardcast, request, CLOSED_WITHIN_S)
    assert closed and time.monotonic() - started < CLOSED_WITHIN_S
    assert _status_and_body(answer)[0] == 408


def test_shardcast_drops_a_trickled_chunked_body(shardcast):
    """Refused (413) once the 2-byte chunks pass the cap on the wire, or answered (405: no
    route takes a POST) before that and the socket dropped then: one answer either way."""
    started = time.monotonic()
    answer, closed = _exchange(shardcast, _trickle("/versions", 200_000), CLOSED_WITHIN_S)
    assert closed and time.monotonic() - started < CLOSED_WITHIN_S
    assert answer.count(b"HTTP/1.1 ") == 1 and _status_and_body(answer)[0] in (405, 413)


def test_shardcast_refuses_a_huge_head_in_one_read(shardcast):
    answer, closed = _exchange(shardcast, _huge_head("/versions", "GET"), CLOSED_WITHIN_S)
    assert closed and _status_and_body(answer)[0] == 431


# -- an unrecognised uvicorn -----------------------------------------------------------------
def test_an_unrecognised_uvicorn_gets_plain_uvicorn_and_one_log_line(monkeypatch, caplog):
    assert http_limits.recognised(uvicorn.__version__)  # the installed one is tested
    assert http_limits.recognised("0.47.0") and http_limits.recognised("0.55.9")
    assert not http_limits.recognised("0.46.0") and not http_limits.recognised("0.56.0")
    monkeypatch.setattr(uvicorn, "__version__", "9.1.0")
    with caplog.at_level(logging.WARNING, logger=http_limits.__name__):
        options = uvicorn_options(LIMITS)
    assert options["http"] == "auto"  # uvicorn's own protocol, no private hooks
    assert [r.getMessage() for r in caplog.records] == [
        "uvicorn 9.1.0 is not a version the HTTP limits were tested on (0.47 to 0.55): serving "
        "with plain uvicorn, without the head and body limits or the direct lane"
    ]
    app = Starlette(routes=[Route("/", lambda _: PlainTextResponse("ok"))])
    with ThreadServer(app, **options) as running:
        assert httpx.get(f"http://{running.host}:{running.port}/").text == "ok"


# -- both parsers uvicorn may use ------------------------------------------------------------
async def _echo(request):
    return PlainTextResponse(str(len(await request.body())))


@pytest.fixture(params=["h11", "httptools"])
def plain(request):
    limits = HttpLimits(max_body_bytes=100_000, body_timeout_s=1.0)
    app = Starlette(routes=[Route("/", _echo, methods=["POST"])])
    with ThreadServer(app, **uvicorn_options(limits, request.param)) as running:
        yield (running.host, running.port)


def test_either_parser_bounds_a_body_in_bytes_and_time(plain):
    answer, closed = _exchange(plain, _unfinished("/"), CLOSED_WITHIN_S)
    assert closed and _status_and_body(answer) == (408, b"request body not complete within 1s")
    answer, closed = _exchange(plain, _trickle("/", 150_000), CLOSED_WITHIN_S)
    assert closed
    assert _status_and_body(answer) == (413, b"request body exceeds the limit of 100000 bytes")
    whole = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    answer, closed = _exchange(plain, whole, CLOSED_WITHIN_S)
    assert closed and _status_and_body(answer) == (200, b"5")
