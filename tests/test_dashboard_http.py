"""``swarmrl dashboard`` holds the same line against hostile HTTP as the pool's servers: a huge
head is refused without being held, a head or body that never finishes is dropped in bounded
time, a body is refused before it is read; measured on the real process serving a real run."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swarmrl.testing.serve import ServeProcess


@pytest.fixture(scope="module")
def dashboard(colocated_run: Path) -> Iterator[ServeProcess]:
    with ServeProcess(colocated_run, verb="dashboard") as proc:
        yield proc


def _status_and_close_s(sock: socket.socket, limit_s: float = 20.0) -> tuple[bytes, float]:
    """The status line the server sends (b"" for none) and the seconds until it closed."""
    started, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data.split(b"\r\n", 1)[0], time.monotonic() - started


def test_the_pages_answer(dashboard: ServeProcess):
    assert httpx.get(dashboard.url + "/ui/", timeout=30).status_code == 200


def test_a_48_mib_head_is_refused_without_being_held(dashboard: ServeProcess):
    before = dashboard.memory_kib()["VmHWM"]
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as sock:
        sock.sendall(b"GET /ui/ HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        sent = 0
        try:
            for _ in range(48 * 16):  # 48 MiB of one header, 64 KiB at a time, never ended
                sock.sendall(b"a" * (64 << 10))
                sent += 1
        except OSError:  # refused and closed while we were still sending
            pass
        status, _ = _status_and_close_s(sock)
    assert sent < 48 * 16 or status.startswith(b"HTTP/1.1 431")
    assert dashboard.memory_kib()["VmHWM"] - before < 16 << 10  # KiB


def test_a_head_that_never_finishes_is_dropped(dashboard: ServeProcess):
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as sock:
        sock.sendall(b"GET /ui/ HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        _, closed_after = _status_and_close_s(sock)
    assert closed_after < 15  # the 10 s head timeout, not never


def test_a_body_is_refused_before_it_is_read_and_one_never_finished_is_dropped(
    dashboard: ServeProcess,
):
    head = b"POST /ui/ HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as sock:
        sock.sendall(head % (200 << 20))  # a 200 MiB body announced
        status, closed_after = _status_and_close_s(sock)
    # refused on its head (413 for its size, or 405: no page takes a body) and dropped within
    # the keep-alive or body timeout
    assert status.split()[1] in (b"405", b"413") and closed_after < 15, (status, closed_after)
    before = dashboard.memory_kib()["VmHWM"]
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as sock:
        sock.sendall(head % (200 << 20))
        try:  # the body really sent: 32 MiB of it
            for _ in range(512):
                sock.sendall(b" " * (64 << 10))
        except OSError:  # refused and closed while we were still sending
            pass
    assert dashboard.memory_kib()["VmHWM"] - before < 16 << 10  # KiB: none of it held
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as sock:
        sock.sendall(head % 1000 + b"{")  # a small body that never finishes
        _, closed_after = _status_and_close_s(sock)
    assert closed_after < 15
