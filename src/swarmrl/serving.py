"""Serve an ASGI app with uvicorn from a background thread of this process.

:class:`ThreadServer` binds its socket at construction (port 0 picks a free one, so the URL is
known before anything is served), :meth:`ThreadServer.start` runs uvicorn in a daemon thread
and waits, bounded, until it accepts connections; :meth:`ThreadServer.stop` asks it to finish
and forces it after a timeout. The orchestrator's pool service and the shardcast origin/relay
both run on it; each passes its own uvicorn options (limits, keep-alive, backlog).

:class:`FullCollections` paces CPython's full garbage collections in a server process that
holds many connections.

:class:`Tls` is a certificate and its key: given one, a server speaks HTTPS (uvicorn's
``ssl_certfile``/``ssl_keyfile``) and its ``url`` says ``https``. Clients verify it against
the system's CA store or the bundle named by ``SSL_CERT_FILE`` (both ``httpx`` and
``http.client`` read it).

Knows nothing about routes or the apps it serves.
"""

from __future__ import annotations

import errno
import gc
import signal
import socket
import threading
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Tls:
    """A PEM certificate (chain) and its private key, for serving HTTPS."""

    cert: str
    key: str

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None) -> Tls | None:
        """``--tls-cert``/``--tls-key`` as given: both (checked readable) or neither."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise UserError("--tls-cert and --tls-key go together: give both or neither")
        for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
            if not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file")
        return cls(cert, key)

    def options(self) -> dict[str, str]:
        """The ``uvicorn.Config`` keyword arguments that serve HTTPS with it."""
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key}


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
        tls: Tls | None = None,
        **options: Any,
    ) -> None:
        """``nodelay``: accepted sockets skip Nagle's delay (small replies go out at once);
        ``reuse_port``: other processes may bind the same port (``SO_REUSEPORT``) and the kernel
        spreads new connections over them; ``tls``: serve HTTPS; ``options``: keyword arguments of
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
        self.url = f"{'https' if tls else 'http'}://{self.host}:{self.port}"
        self.name = f"{name}:{self.port}"
        config = {"log_level": "warning", "access_log": False, "lifespan": "on", **options}
        if tls is not None:
            config.update(tls.options())
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


class FullCollections:
    """Runs CPython's full (oldest-generation) garbage collection every ``every_s`` seconds
    instead of whenever the interpreter decides.

    A server holding thousands of kept-alive connections has a few hundred thousand objects
    that live as long as they do. CPython collects its oldest generation whenever a quarter as
    many objects again have survived two younger collections (a request's timers do), scanning
    all of them with the GIL held: measured in the orchestrator at 5,000 nodes, a full
    collection every 10–25 s, taking 0.3–0.55 s and freeing 0–90 objects. Every request waits
    through it. With :meth:`start`, the oldest generation's threshold is set out of reach
    (the young generations are collected as before) and a daemon thread collects it fully
    every ``every_s``: cyclic garbage that reached the oldest generation is freed that late,
    and the pause comes once per period instead of every few seconds. :meth:`stop` restores
    the interpreter's own schedule.
    """

    # full collections wait for this many young (generation 1) collections: never, in practice
    NEVER = (1 << 31) - 1  # (a C int)

    def __init__(self, every_s: float) -> None:
        if not every_s > 0:
            raise ValueError(f"a full collection period must be > 0 s, got {every_s!r}")
        self.every_s = every_s
        self.runs = 0  # full collections made
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="full-gc", daemon=True)
        self._thresholds = gc.get_threshold()

    def start(self) -> FullCollections:
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, self.NEVER)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        gc.set_threshold(*self._thresholds)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            gc.collect()
            self.runs += 1
