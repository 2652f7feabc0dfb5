"""Tiny TCP probes run inside a test bed's hosts: a byte sink, a timed sender, an echo server.

``python -m swarmrl.testing.netprobe sink HOST PORT`` accepts connections, reads each to EOF and
answers one byte; ``send HOST PORT NBYTES`` sends that many bytes, waits for the answer and prints
the seconds it took (a throughput measurement that ends when the receiver has every byte);
``echo HOST PORT`` echoes every connection; ``rtt HOST PORT N`` prints the median round trip in
seconds of N 64-byte exchanges over one connection. Knows nothing about namespaces.
"""

from __future__ import annotations

import socket
import socketserver
import statistics
import sys
import time


class _Sink(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while self.request.recv(1 << 20):
            pass
        self.request.sendall(b"k")


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def send(host: str, port: int, nbytes: int) -> float:
    """Seconds from connect to the receiver's acknowledgement of ``nbytes`` bytes."""
    block = b"\0" * 65536
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=120) as sock:
        left = nbytes
        while left > 0:
            left -= sock.send(block[: min(left, len(block))])
        sock.shutdown(socket.SHUT_WR)
        if sock.recv(1) != b"k":
            raise ConnectionError("the sink closed without acknowledging the bytes")
    return time.perf_counter() - start


def rtt(host: str, port: int, count: int) -> float:
    """Median seconds of ``count`` 64-byte request/response exchanges over one connection."""
    times = []
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"x" * 64)
            got = 0
            while got < 64:
                chunk = sock.recv(64 - got)
                if not chunk:
                    raise ConnectionError("the echo server closed mid-exchange")
                got += len(chunk)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    verb, host, port = argv[0], argv[1], int(argv[2])
    if verb in ("sink", "echo"):
        handler = _Sink if verb == "sink" else _Echo
        with _Server((host, port), handler) as server:
            server.serve_forever()
    elif verb == "send":
        print(f"{send(host, port, int(argv[3])):.6f}")
    elif verb == "rtt":
        print(f"{rtt(host, port, int(argv[3])):.6f}")
    else:
        raise SystemExit(f"unknown probe {verb!r}: sink, echo, send or rtt")


if __name__ == "__main__":
    main(sys.argv[1:])
