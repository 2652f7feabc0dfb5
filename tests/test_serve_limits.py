"""``swarmrl serve`` under hostile or careless clients: every refusal is a clean 4xx with an
OpenAI error body, limits hold before the work they bound (memory and time measured on the real
server process), abandoned requests stop generating, and ``/health`` answers throughout."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swarmrl.testing.serve import ServeProcess

KEY = "limits-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 256 << 10
CHAT = "/v1/chat/completions"
ONE = [{"role": "user", "content": "1+2="}]
LONG = 3000  # new tokens of a request meant to run for a while (ignore_eos)


@pytest.fixture(scope="module")
def server(colocated_run: Path) -> Iterator[ServeProcess]:
    flags = ["--api-key", KEY, "--threads", "1", "--max-concurrent", "2"]
    flags += ["--max-body-bytes", str(BODY_LIMIT), "--max-prompt-chars", "4096"]
    flags += ["--max-tokens-limit", str(LONG), "--body-timeout-s", "2", "--max-head-bytes", "8192"]
    with ServeProcess(colocated_run, *flags) as proc:
        yield proc


def _post(server: ServeProcess, body: bytes | dict, path: str = CHAT, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **kw.pop("headers", {})}
    timeout = kw.pop("timeout", 60)
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout, **kw)


def _health(server: ServeProcess) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def _error(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a refusal, after checking its status and shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _raw(server: ServeProcess, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head + body)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response on ``sock`` (the server closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _head(length: int, key: str = KEY) -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _idle(server: ServeProcess, within_s: float) -> dict:
    """/health once no request is admitted, waiting at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while (health := _health(server))["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health["requests"] == 0, health
    return health


@pytest.mark.parametrize("mib", [1, 8, 64])
def test_a_huge_body_is_refused_before_it_is_read(server: ServeProcess, mib: int):
    before = server.memory_kib()["VmRSS"]
    started = time.monotonic()
    with _raw(server, _head(mib << 20)) as sock:
        status, body = _answer(sock)
    assert time.monotonic() - started < 2.0
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"limit of {BODY_LIMIT} bytes" in body["error"]["message"]
    assert server.memory_kib()["VmRSS"] - before < 10 << 10  # KiB: nothing was buffered


def test_a_body_sent_without_a_length_is_cut_off_at_the_limit(server: ServeProcess):
    before = server.memory_kib()["VmHWM"]
    head = _head(0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
    sent = 0
    with _raw(server, head) as sock:
        with pytest.raises(OSError):  # the server answers 413 and closes: the send fails
            for _ in range(16 << 4):  # 16 MiB
                sock.sendall(chunk)
                sent += 1
    assert sent * (64 << 10) < 8 << 20  # refused long before the client was done
    assert server.memory_kib()["VmHWM"] - before < 20 << 10
    assert _health(server)["refused"]["413"] >= 1


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(server: ServeProcess):
    started = time.monotonic()
    error = _error(_post(server, {"messages": [{"role": "user", "content": "1" * 200_000}]}), 400)
    assert time.monotonic() - started < 2.0
    assert error["param"] == "messages"
    assert "200000 characters, over this server's limit of 4096" in error["message"]
    many = {"prompt": ["12"] * 3000}  # 6000 characters over many prompts
    error = _error(_post(server, many | {"max_tokens": 1}, "/v1/completions"), 400)
    assert error["param"] == "prompt"


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED = {
    "not JSON": (b'{"messages": [', "not valid JSON"),
    "not an object": (b"[1, 2]", "must be a JSON object"),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', "not valid JSON"),
    "NaN": (b'{"messages": [], "temperature": NaN}', "NaN is not a JSON number"),
    "infinite": (b'{"messages": [], "temperature": 1e999}', "finite"),
    "lone surrogate": (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "surrogate"),
    "NUL": (b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}', "NUL"),
    "nested deeply": (DEEP, "nests"),
    "nested past 16": (b'{"x": ' + b"[" * 20 + b"]" * 20 + b', "messages": []}', "deeper"),
    "messages a string": (b'{"messages": "1+2="}', "param=messages"),
    "n a string": (b'{"messages": [{"role": "user", "content": "1"}], "n": "2"}', "param=n"),
    "max_tokens true": (
        b'{"messages": [{"role": "user", "content": "1"}], "max_tokens": true}',
        "param=max_tokens",
    ),
    "unknown role": (b'{"messages": [{"role": "robot", "content": "1"}]}', "param=messages.0.role"),
    "image part": (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        "only text content parts",
    ),
    "no messages": (b'{"messages": []}', "param=messages"),
    "five stops": (
        b'{"messages": [{"role": "user", "content": "1"}], "stop": ["a","b","c","d","e"]}',
        "param=stop",
    ),
    "negative seed": (
        b'{"messages": [{"role": "user", "content": "1"}], "seed": -1}',
        "param=seed",
    ),
    "other model": (
        b'{"messages": [{"role": "user", "content": "1"}], "model": "gpt-4"}',
        "not served here",
    ),
    "n over the limit": (b'{"messages": [{"role": "user", "content": "1"}], "n": 9}', "limit of 8"),
    "max_tokens over the limit": (
        b'{"messages": [{"role": "user", "content": "1"}], "max_tokens": 3001}',
        "limit of 3000",
    ),
    "beyond the context": (
        b'{"messages": [{"role": "user", "content": "' + b"1" * 3000 + b'"}], "max_tokens": 3000}',
        "context of 4096 tokens",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_are_400_with_an_openai_error_body(server: ServeProcess, case: str):
    body, says = MALFORMED[case]
    error = _error(_post(server, body), 400)
    assert error["type"] == "invalid_request_error"
    if says.startswith("param="):
        assert error["param"] == says.removeprefix("param="), error
    else:
        assert says in error["message"], error


def test_too_many_prompts_and_unknown_routes_are_refused_alike(server: ServeProcess):
    error = _error(_post(server, {"prompt": ["1"] * 33}, "/v1/completions"), 400)
    assert error["param"] == "prompt" and "1 to 32 prompts" in error["message"]
    _error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)
    _error(httpx.get(server.url + CHAT, headers=AUTH), 405)


def test_without_the_api_key_v1_is_401_before_the_body_is_read(server: ServeProcess):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(server.url + CHAT, json={"messages": ONE}, headers=headers)
        assert _error(response, 401)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert _error(httpx.get(server.url + "/v1/models"), 401)["code"] == "invalid_api_key"
    with _raw(server, _head(64 << 20, key="wrong")) as sock:  # a 64 MiB body never sent
        assert _answer(sock)[0] == 401
    assert _health(server)["ok"]  # /health is open
    assert _post(server, {"messages": ONE, "max_tokens": 2}).status_code == 200


def test_the_openai_client_reports_a_wrong_key(server: ServeProcess):
    openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_an_oversized_request_head_is_431(server: ServeProcess):
    started = _head(2).split(b"\r\n\r\n")[0] + b"\r\nX-Pad: "
    answer = b""
    with _raw(server, started) as sock:
        sock.settimeout(0.2)
        for _ in range(256):  # up to 1 MiB of header, 4 KiB at a time, never ended
            sock.sendall(b"a" * 4096)
            try:
                answer = sock.recv(100)
                break
            except TimeoutError:
                continue
    assert answer.startswith(b"HTTP/1.1 431")


def test_past_the_concurrency_limit_requests_get_429_until_a_slot_frees(server: ServeProcess):
    _idle(server, 10)
    slow = [_raw(server, _head(100), b'{"messages"') for _ in range(2)]  # bodies that stall
    try:
        deadline = time.monotonic() + 5
        while _health(server)["requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = _post(server, {"messages": ONE, "max_tokens": 2})
        assert _error(refused, 429)["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
        for sock in slow:  # the body timeout (2 s) frees their slots
            status, body = _answer(sock)
            assert status == 408 and body["error"]["code"] == "request_timeout"
    finally:
        for sock in slow:
            sock.close()
    assert _post(server, {"messages": ONE, "max_tokens": 2}).status_code == 200


def _long(n: int = 8) -> dict:
    return {"messages": ONE, "max_tokens": LONG, "n": n, "ignore_eos": True}


def test_a_stream_whose_client_leaves_stops_generating(server: ServeProcess):
    before = _idle(server, 10)["abandoned"]
    with httpx.stream(
        "POST", server.url + CHAT, json=_long() | {"stream": True}, headers=AUTH, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        for _ in range(10):  # /health does not wait for the generation
            started = time.monotonic()
            assert _health(server)["requests"] == 1
            assert time.monotonic() - started < 0.5
            time.sleep(0.05)
    left = time.monotonic()
    health = _idle(server, 5)  # 8 x 3000 tokens take far longer
    assert health["abandoned"] == before + 1
    assert time.monotonic() - left < 5


def test_a_request_whose_client_gives_up_stops_generating(server: ServeProcess):
    before = _idle(server, 10)["abandoned"]
    with pytest.raises(httpx.ReadTimeout):
        _post(server, _long(), timeout=httpx.Timeout(10, read=0.5))
    health = _idle(server, 5)
    assert health["abandoned"] == before + 1


def test_health_answers_while_45_clients_give_up_on_long_requests(server: ServeProcess):
    """The issue's case: 45 abandoned requests blocked /health for 25 s."""
    _idle(server, 10)
    statuses: list[int | str] = []
    sessions = [httpx.Client(headers=AUTH, timeout=httpx.Timeout(10, read=0.3)) for _ in range(45)]

    def give_up(session: httpx.Client) -> None:
        try:
            statuses.append(session.post(server.url + CHAT, json=_long()).status_code)
        except httpx.ReadTimeout:
            statuses.append("gave up")
        session.close()

    clients = [threading.Thread(target=give_up, args=(s,)) for s in sessions]
    for client in clients:
        client.start()
    waits = []
    while any(c.is_alive() for c in clients):
        started = time.monotonic()
        assert _health(server)["ok"]
        waits.append(time.monotonic() - started)
        time.sleep(0.05)
    for client in clients:
        client.join()
    assert max(waits) < 1.0, waits
    assert 429 in statuses and "gave up" in statuses, statuses
    assert set(statuses) <= {429, "gave up"}, statuses
    _idle(server, 5)  # nothing left generating for clients that are gone


def test_the_body_limit_set_is_the_one_held_on_every_path(colocated_run: Path):
    """``--max-body-bytes`` above the HTTP layer's default (8 MiB) is the limit: a 9 MiB body
    reaches the app (and is refused there for its content, before tokenizing), and a body over
    the limit is refused in the same OpenAI error form."""
    limit = 12 << 20
    flags = ["--threads", "1", "--max-body-bytes", str(limit), "--max-prompt-chars", "4096"]
    with ServeProcess(colocated_run, *flags) as proc:
        prompt = [{"role": "user", "content": "1" * (9 << 20)}]
        answer = httpx.post(proc.url + CHAT, json={"messages": prompt}, timeout=60)
        assert _error(answer, 400)["code"] != "request_too_large"  # the app's own checks answer
        with _raw(proc, _head(limit + 1)) as sock:  # refused on its head, in the same form
            status, body = _answer(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert f"{limit}" in body["error"]["message"]
