"""Serve an ASGI app with uvicorn from a background thread of this process.

:class:`ThreadServer` binds its socket at construction (port 0 picks a free one, so the URL is
known before anything is served), :meth:`ThreadServer.start` runs uvicorn in a daemon thread
and waits, bounded, until it accepts connections; :meth:`ThreadServer.stop` asks it to finish
and forces it after a timeout. The orchestrator's pool service and the shardcast origin/relay
both run on it; each passes its own uvicorn options (limits, keep-alive, backlog).

Knows nothing about routes or the apps it serves.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from swarmrl.errors import UserError, WaitTimeout


def _bind_error(host: str, port: int, exc: OSError) -> Exception:
    """What the person starting a server can do about a failed bind, in one line."""
    if exc.errno == errno.EADDRINUSE:
        return UserError(f"cannot listen on {host}:{port}: the port is in use (choose another)")
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
        return UserError(f"cannot listen on {host}:{port}: {exc.strerror}")
    return exc


class ThreadServer:
    """One app on ``host:port`` served by uvicorn from a daemon thread named ``name``."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "http",
        nodelay: bool = False,
        reuse_port: bool = False,
        **options: Any,
    ) -> None:
        """``nodelay``: accepted sockets skip Nagle's delay (small replies go out at once);
        ``reuse_port``: other processes may bind the same port (``SO_REUSEPORT``) and the kernel
        spreads new connections over them; ``options``: keyword arguments of
        ``uvicorn.Config`` (defaults: quiet, lifespan on)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if nodelay:  # accepted sockets inherit it
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise _bind_error(host, port, exc) from exc
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.name = f"{name}:{self.port}"
        config = {"log_level": "warning", "access_log": False, "lifespan": "on", **options}
        self.server = uvicorn.Server(uvicorn.Config(app, **config))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name=self.name
        )

    def start(self, timeout_s: float = 20.0) -> ThreadServer:
        """Start serving; raise :class:`WaitTimeout` if not accepting within ``timeout_s``."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise WaitTimeout(f"{self.name} on {self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def run_until_stopped(self, port_file: str | None = None) -> None:
        """The command-line verbs' loop: write the bound port to ``port_file`` (atomically)
        when given, serve until SIGTERM, Ctrl-C or the server thread ends, then stop."""
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        if port_file:
            tmp = Path(port_file + ".tmp")
            tmp.write_text(f"{self.port}\n")
            tmp.replace(port_file)
        try:
            while self.alive():
                self.thread.join(0.5)
        finally:
            self.stop()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def request_stop(self) -> None:
        """Ask uvicorn to finish (safe from a signal handler); :meth:`stop` waits for it."""
        self.server.should_exit = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish gracefully, force it after ``timeout_s``; raise if the thread still runs."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise WaitTimeout(f"{self.name} on {self.url} did not stop within {2 * timeout_s} s")
        self.sock.close()

    def __enter__(self) -> ThreadServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
