"""Hostile HTTP/1.1 requests as raw bytes, and the raw-socket senders that deliver them and
report what came back (the statuses answered, and when the server closed the socket).

Builders: ``trickle`` (a chunked body in 2-byte chunks, never ended), ``unfinished`` (a body
shorter than its Content-Length), ``huge_head``, ``declared`` and ``chunked`` (bodies of a given
size), ``nested`` (JSON 5,000 deep) and four request-smuggling attempts. Senders (``Sender``:
address, start, window -> statuses, seconds to the close): ``send_and_read``, ``slow_head``
(slow-loris) and ``never_reads`` (a client that never reads its answer). Used by
``bench/granian_probes.py``; sends nothing anywhere but the address it is given.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable


def request_head(method: str, path: str, extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def trickle(path: str, wire_bytes: int) -> bytes:
    """A chunked POST in 2-byte chunks, never ended."""
    head = request_head(
        "POST", path, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    )
    return head + b"2\r\nab\r\n" * (wire_bytes // 7)


def unfinished(path: str, method: str = "POST") -> bytes:
    """A complete head promising 1,000 bytes of body, and 10 of them."""
    return request_head(method, path, "Content-Length: 1000\r\n") + b"{" * 10


def huge_head(path: str, method: str = "POST") -> bytes:
    """A 120 KB head in one write (the limit is 64 KiB)."""
    return request_head(method, path, f"X-Big: {'a' * 120_000}\r\nContent-Length: 2\r\n") + b"{}"


def declared(path: str, body_bytes: int) -> bytes:
    extra = f"Content-Type: application/json\r\nContent-Length: {body_bytes}\r\n"
    return request_head("POST", path, extra) + b"1" * body_bytes


def chunked(path: str, body_bytes: int, chunk_bytes: int = 64 << 10) -> bytes:
    head = request_head(
        "POST", path, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    )
    chunk = b"%x\r\n" % chunk_bytes + b"1" * chunk_bytes + b"\r\n"
    return head + chunk * (body_bytes // chunk_bytes) + b"0\r\n\r\n"


def nested(path: str) -> bytes:
    body = b"[" * 5000
    extra = (
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    )
    return request_head("POST", path, extra) + body


def smuggle_cl_te(path: str) -> bytes:
    """Content-Length and Transfer-Encoding both; a second request hidden behind the chunked end."""
    extra = "Content-Length: 6\r\nTransfer-Encoding: chunked\r\n"
    return request_head("POST", path, extra) + b"0\r\n\r\n" + request_head("GET", "/smuggled")


def smuggle_two_lengths(path: str) -> bytes:
    """Two different Content-Lengths; the longer one swallows a second request."""
    second = request_head("GET", "/smuggled")
    extra = f"Content-Length: 2\r\nContent-Length: {2 + len(second)}\r\n"
    return request_head("POST", path, extra) + b"{}" + second


def smuggle_te_obfuscated(path: str) -> bytes:
    """``Transfer-Encoding : chunked`` (a space before the colon) beside a Content-Length."""
    extra = "Content-Length: 4\r\nTransfer-Encoding : chunked\r\n"
    return request_head("POST", path, extra) + b"0\r\n\r\n" + request_head("GET", "/smuggled")


def smuggle_te_unknown(path: str) -> bytes:
    """``Transfer-Encoding: chunked, identity`` (chunked not last) and a Content-Length."""
    extra = "Content-Length: 4\r\nTransfer-Encoding: chunked, identity\r\n"
    return request_head("POST", path, extra) + b"0\r\n\r\n" + request_head("GET", "/smuggled")


STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


def _statuses(answer: bytes) -> str:
    found = [s.decode() for s in STATUS.findall(answer)]
    return ",".join(found) if found else "-"


def send_and_read(address, data: bytes, start: float, window_s: float) -> tuple[str, float | None]:
    """Send ``data`` and read until the server closes: statuses, seconds to the close."""
    answer, closed_at = exchange(address, data, start, start + window_s)
    return _statuses(answer), closed_at


def exchange(
    address: tuple[str, int], data: bytes, start: float, deadline: float
) -> tuple[bytes, float | None]:
    """Send ``data`` on a new connection (the server may cut it short) and read until the
    server closes or ``deadline`` passes (:func:`read_until`)."""
    with socket.create_connection(address) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # closed by the server while we sent: it may still have answered
        return read_until(sock, start, deadline)


def read_until(
    sock: socket.socket, start: float, deadline: float, size: int = 1 << 16
) -> tuple[bytes, float | None]:
    """Read until the server closes or ``deadline`` (monotonic) passes: what came, and seconds
    from ``start`` to the close (None: still open)."""
    answer, closed_at = b"", None
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(size)
            if not chunk:
                closed_at = time.monotonic() - start
                break
            answer += chunk
    except TimeoutError:
        pass
    except OSError:
        closed_at = time.monotonic() - start
    return answer, closed_at


def slow_head(address, path: str, start: float, window_s: float) -> tuple[str, float | None]:
    """A head sent one 8-byte header line every 0.5 s, never completed (slow-loris)."""
    answer, closed_at = b"", None
    with socket.create_connection(address) as sock:
        try:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())
            sock.settimeout(0.5)
            while time.monotonic() < start + window_s:
                try:
                    chunk = sock.recv(1 << 16)
                    if not chunk:
                        closed_at = time.monotonic() - start
                        break
                    answer += chunk
                except TimeoutError:
                    sock.sendall(b"X-a: b\r\n")
        except OSError:
            closed_at = time.monotonic() - start
    return _statuses(answer), closed_at


def never_reads(address, data: bytes, start: float, window_s: float) -> tuple[str, float | None]:
    """Send ``data`` with a 4 KiB receive buffer and read nothing for the window; then read for
    up to 3 s: the statuses, the MiB read then, and when the server's close was seen (``None``:
    not within those 3 s)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(address)
        sock.settimeout(window_s)
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server stopped reading: our send buffer filled for the window
        time.sleep(max(0.0, start + window_s - time.monotonic()))
        answer, closed_at = read_until(sock, start, time.monotonic() + 3.0, 1 << 20)
    return f"{_statuses(answer[:4096])} ({len(answer) / (1 << 20):.1f} MiB read after)", closed_at


Sender = Callable[[tuple[str, int], float, float], tuple[str, float | None]]


def sends(data: bytes, copies: int = 1) -> list[Sender]:
    return [lambda a, s, w, d=data: send_and_read(a, d, s, w)] * copies
