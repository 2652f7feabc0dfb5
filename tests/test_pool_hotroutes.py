"""The hot routes (heartbeat, lease, submission) answer exactly as their FastAPI routes do.

A request with a query string is not taken by ``swarmrl.pool.web.hotroutes`` and reaches FastAPI,
so each case is sent twice, once to each, signed for its own path: status, error code and
message must match, and nasty input is a 4xx on both. Runs on SQLite and PostgreSQL.
"""

import contextlib
import json
import socket
import struct
import time

import httpx
import pytest
from pydantic import ValidationError

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.web.hotroutes import HotRoutes
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "hr"
BEATS = [
    b'{"status": "ok", "model_version": 0, "log_tail": ["fine"]}',
    b'{"status": "bogus"}',
    b"[]",
    b'"ok"',
    b'{"status": "ok", "tokens_per_s": NaN}',
    b'{"status": "ok", "tokens_per_s": -Infinity}',
    b'{"status": "ok", "model_version": 99999999999999999999999}',
    b'{"status": "ok", "log_tail": ["\\ud800 lone", "nul \\u0000"]}',
    b'{"status": "ok", "log_tail": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"status": "ok"',
    b"\xff\xfe not utf-8",
    b"",
]


@pytest.fixture
def pool(db_url, tmp_path):
    with serving(tmp_path, PoolConfig(db_url=db_url)) as served:
        yield served


# the public paths beside each private piece: the ASGI app instead of the direct lane; the
# FastAPI routes and SQLAlchemy instead of the hot routes and statements handed to the driver
PUBLIC_PATHS = {
    "no direct lane": {"direct_lane": False},
    "no hot routes, no fast sql": {"hot_routes": False, "fast_sql": False},
}


@pytest.fixture(params=list(PUBLIC_PATHS))
def public_pool(request, tmp_path):
    with serving(tmp_path, PoolConfig(**PUBLIC_PATHS[request.param])) as served:
        yield served


@contextlib.contextmanager
def serving(tmp_path, config):
    """An orchestrator with pool ``POOL`` (open) and one node joined: (server, node key)."""
    orch, owner, node = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validated_fraction=0.0,
            max_leases_in_flight=64,
        )
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        yield server, node


def post(server, key, path, body, content_type="application/json"):
    headers = {} if content_type is None else {"Content-Type": content_type}
    if key is not None:
        headers |= sign_request(key, "POST", path, body)
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


def answer(response: httpx.Response) -> tuple[int, object]:
    """What a peer learns: the status and the error (a success's body holds fresh ids)."""
    if response.status_code == 200:
        return 200, None
    body = response.json()
    return response.status_code, body.get("error", body)  # FastAPI's own 400 has no "error"


def both(server, key, route, body, content_type="application/json"):
    """(hot route's answer, FastAPI route's answer) to the same request."""
    path = f"/pools/{POOL}/{route}"
    hot = post(server, key, path, body, content_type)
    slow = post(server, key, path + "?via=fastapi", body, content_type)
    return answer(hot), answer(slow)


@pytest.mark.parametrize("body", BEATS, ids=range(len(BEATS)))
def test_a_heartbeat_is_answered_alike_by_both_routes(pool, body):
    server, node = pool
    hot, slow = both(server, node, "heartbeat", body)
    assert hot == slow
    assert hot[0] < 500


def test_unsigned_forged_and_replayed_requests_are_refused_alike(pool):
    server, node = pool
    beat = BEATS[0]
    assert both(server, None, "heartbeat", beat) == ((401, _missing_key()), (401, _missing_key()))
    stranger = KeyPair.generate()  # signs correctly but never joined
    hot, slow = both(server, stranger, "heartbeat", beat)
    assert hot == slow and hot[0] == 404
    path = f"/pools/{POOL}/heartbeat"
    headers = sign_request(node, "POST", path, beat) | {"Content-Type": "application/json"}
    first = httpx.post(server.url + path, content=beat, headers=headers, timeout=30)
    again = httpx.post(server.url + path, content=beat, headers=headers, timeout=30)
    assert first.status_code == 200
    assert again.json()["error"]["code"] == "replayed_request"
    tampered = httpx.post(server.url + path, content=beat[:-1] + b" }", headers=headers)
    assert tampered.json()["error"]["code"] == "bad_signature"


def _missing_key() -> dict:
    return {"code": "bad_signature", "message": "missing header X-Swarm-Key"}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json; charset=utf-8"])
def test_other_content_types_reach_fastapi_unchanged(pool, content_type):
    server, node = pool
    hot, slow = both(server, node, "heartbeat", BEATS[0], content_type)
    assert hot == slow


def test_lease_and_submission_through_the_hot_routes(pool):
    server, node = pool
    client = PoolClient(server.url, node)
    work = client.lease(POOL).work
    assert work is not None
    body = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    receipt = client.submit(POOL, body)
    assert receipt.tokens > 0
    payload = body.model_dump_json().encode()
    hot, slow = both(server, node, "submissions", payload)
    assert hot == slow and hot[0] == 409  # the lease was answered already
    work = client.lease(POOL).work
    broken = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    payload = json.loads(broken.model_dump_json())
    payload["samples"][0]["logprobs"][0] = float("nan")
    payload["samples"][0]["extra"] = "\ud800"
    hot, slow = both(server, node, "submissions", json.dumps(payload).encode())
    assert hot == slow and hot[0] == 422


def test_hot_routes_are_timed_under_their_route_template(pool):
    server, node = pool
    PoolClient(server.url, node).lease(POOL)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'route="/pools/{pool_id}/lease"' in text
    assert "node_id" not in text.split("swarmrl_orchestrator_request_seconds", 1)[1][:2000]


def test_a_hot_answer_leaves_in_one_segment_and_oversized_bodies_are_refused(pool):
    """The server answers heartbeats from its parser (``swarmrl.protocol.fastlane``): one
    socket write per answer, not a head and a body apart."""
    server, node = pool
    assert _segments_per_beat(server, node) == [1, 1, 1]
    huge = b'{"status": "ok", "log_tail": ["' + b"x" * (PoolConfig().max_body_bytes + 1) + b'"]}'
    hot, slow = both(server, node, "heartbeat", huge)
    assert hot == slow and hot[0] == 413


def test_the_public_paths_answer_as_the_fastapi_routes_do(public_pool):
    server, node = public_pool
    for body in BEATS:
        hot, slow = both(server, node, "heartbeat", body)
        assert hot == slow and hot[0] < 500
    client = PoolClient(server.url, node)
    work = client.lease(POOL).work
    assert work is not None
    sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    assert client.submit(POOL, sub).tokens > 0
    hot, slow = both(server, node, "submissions", sub.model_dump_json().encode())
    assert hot == slow and hot[0] == 409  # answered already
    huge = b'{"status": "ok", "log_tail": ["' + b"x" * (PoolConfig().max_body_bytes + 1) + b'"]}'
    hot, slow = both(server, node, "heartbeat", huge)
    assert hot == slow and hot[0] == 413


def test_the_public_paths_answer_through_the_asgi_app(public_pool):
    """Without the direct lane an answer leaves as uvicorn writes it, head and body apart;
    without the hot routes their middleware is not in the app."""
    server, node = public_pool
    config = server.ctx.config
    middleware = [m.cls for m in server.app.user_middleware]
    assert (HotRoutes in middleware) == config.hot_routes
    with_driver = server.ctx.engine.get_execution_options().get("swarmrl_fast_sql", True)
    assert with_driver == config.fast_sql
    assert _segments_per_beat(server, node) == [2, 2, 2]


def _segments_per_beat(server, node, beats: int = 3) -> list[int]:
    """TCP segments of each answer to ``beats`` heartbeats sent one after another on one
    connection."""
    path = f"/pools/{POOL}/heartbeat"
    host, port = server.url.removeprefix("http://").split(":")
    counts = []
    with socket.create_connection((host, int(port))) as sock:
        for _ in range(beats):
            body = BEATS[0]
            headers = sign_request(node, "POST", path, body) | {"content-type": "application/json"}
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            before = _data_segments_in(sock)
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode()
                + body
            )
            _read_answer(sock)
            time.sleep(0.2)  # a second segment, if any, has arrived
            counts.append(_data_segments_in(sock) - before)
    return counts


def _read_answer(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(1 << 16)
    assert head.startswith(b"HTTP/1.1 200"), head
    return rest


def _data_segments_in(sock: socket.socket) -> int:
    """Linux ``tcp_info.tcpi_data_segs_in``: TCP segments with data this socket received."""
    return struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 152)[
        0
    ]


def submission(task="1", logprob="-0.5", proof="null", head="") -> bytes:
    """A submission body with one sample whose fields are spelled as given."""
    sample = (
        f'{{"task_index": {task}, "prompt_tokens": [1], "output_tokens": [2], '
        f'"logprobs": [{logprob}], "finish_reason": "length", "policy_version": 0, '
        f'"proof": {proof}}}'
    )
    text = f'{{{head}"lease_id": "{"a" * 32}", "samples": [{sample}]}}'
    return text.encode("utf-8", "surrogatepass")


SUBMISSIONS = [
    submission(head=f'"lease_id": "{"b" * 32}", '),  # a duplicate key: the last one counts
    submission(task='1, "task_index": 7'),
    submission("1.0", "-0.0", '{"y": -0.0, "z": [1e-320, 5e-324, 1.7976931348623157e308]}'),
    submission('"5"', "-3", '{"x": 1, "x": 2}'),
    submission(logprob="-0.1000000000000000055511151231257827021181583404541015625"),
    submission(logprob="-2.2250738585072011e-308", proof='"00FF"'),
    submission(proof='{"x": "\\u00e9\\n\\ud83d\\ude00"}'),
    submission(logprob="NaN"),
    submission(logprob="-1e400"),
    submission(logprob="-" + "9" * 400),
    submission(proof='{"x": NaN}'),
    submission(proof='{"x": "\\ud800"}'),
    submission(proof='{"x": ' + "9" * 30 + "}"),
    b"\xef\xbb\xbf" + submission(),  # a UTF-8 byte order mark
    b" \n" + submission() + b" \n",
]


@pytest.mark.parametrize(
    "message, body",
    [(Submission, b) for b in SUBMISSIONS]
    + [(Heartbeat, b) for b in BEATS]
    + [(Heartbeat, b'{"status": "ok", "status": "error", "log_tail": ["\\ud83d\\ude00"]}')],
)
def test_pydantic_s_parser_gives_the_message_json_loads_would_or_refuses(message, body):
    """The hot routes validate a body with pydantic's JSON parser and fall back to
    ``json.loads`` where it refuses; a body both accept must be the same message."""
    try:
        direct = message.model_validate_json(body)
    except ValidationError:
        return
    assert direct.model_dump_json() == message.model_validate(json.loads(body)).model_dump_json()
