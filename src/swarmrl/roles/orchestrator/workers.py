"""Several orchestrator processes on one port: ``swarmrl orchestrator --workers N``.

The first process (the one started) binds the port with ``SO_REUSEPORT``, then starts N − 1
copies of itself on that port; the kernel spreads new connections over the N listening
sockets, and each process runs its own event loop and database connections. They share
nothing but the PostgreSQL database, which keeps them apart (``swarmrl.pool.trust.service`` lists
the locks); SQLite has one writer, so N > 1 is refused there. The first process alone writes
the port file and the status file; it writes the port file only once every copy listens, and
it stops them all when it stops or when one of them ends.

Process wiring only; knows nothing about pool rules.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import sqlalchemy as sa

from swarmrl.errors import UserError, WaitTimeout

STOP_WAIT_S = 20.0


def require_postgres(db_url: str, workers: int) -> None:
    """Refuse ``workers`` > 1 unless ``db_url`` names a PostgreSQL database, in one line."""
    if workers < 1:
        raise UserError(f"--workers must be at least 1, not {workers}")
    if workers == 1:
        return
    try:
        backend = sa.engine.make_url(db_url).get_backend_name() if db_url else "sqlite"
    except sa.exc.ArgumentError as exc:
        raise UserError(f"bad database URL {db_url!r}: {exc}") from exc
    if backend != "postgresql":
        raise UserError(
            f"--workers {workers} needs a PostgreSQL database (--db postgresql+psycopg://…); "
            f"{backend} has one writer, so serve it with one process"
        )


def all_alive(procs: Sequence[subprocess.Popen[bytes]], name: Callable[[Any], str]) -> bool:
    """Whether every one of ``procs`` still runs; each that ended is reported on stderr."""
    ended = [p for p in procs if p.poll() is not None]
    for proc in ended:
        print(
            f"swarmrl orchestrator: {name(proc)} ended with status {proc.returncode}; stopping",
            file=sys.stderr,
            flush=True,
        )
    return not ended


def listening_port(
    proc: subprocess.Popen[bytes], port_file: Path, name: str, port: int, deadline: float
) -> int:
    """The port ``proc`` wrote to ``port_file`` once it listens (asked: ``port``, 0 = any);
    :class:`WaitTimeout` if it exits first or ``deadline`` (``time.monotonic``) passes."""
    while not port_file.exists():
        if proc.poll() is not None:
            raise WaitTimeout(
                f"orchestrator {name} exited with status {proc.returncode} before listening "
                f"on port {port}"
            )
        if time.monotonic() > deadline:
            raise WaitTimeout(f"orchestrator {name} did not listen on port {port} in time")
        time.sleep(0.05)
    return int(port_file.read_text())


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Terminate ``procs`` and wait for them, killing any still running after
    :data:`STOP_WAIT_S`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerGroup:
    """The N − 1 further server processes: the same command line on the same port."""

    def __init__(self, argv: Sequence[str], count: int, name: str, timeout_s: float = 120.0):
        """``argv``: this process's ``swarmrl orchestrator`` arguments; ``count``: how many
        further processes; ``timeout_s``: how long each may take to listen (it audits the
        ledger first)."""
        self.argv, self.count, self.name, self.timeout_s = list(argv), count, name, timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._dir: Path | None = None  # where the further processes write their port files

    def start(self, port: int) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="swarmrl-workers-"))
        files = [self._dir / f"worker-{i}.port" for i in range(1, self.count + 1)]
        for i, port_file in enumerate(files, 1):
            command = [
                sys.executable, "-m", "swarmrl.cli", "orchestrator", *self.argv,
                "--workers", "1", "--reuse-port", "--port", str(port),
                "--port-file", str(port_file), "--status-dir", "", "--name", f"{self.name}-{i}",
            ]  # fmt: skip
            self.procs.append(subprocess.Popen(command))
        deadline = time.monotonic() + self.timeout_s
        for proc, port_file in zip(self.procs, files, strict=True):
            listening_port(proc, port_file, f"worker {proc.args[-1]}", port, deadline)

    def alive(self) -> bool:
        return all_alive(self.procs, lambda proc: f"worker {proc.args[-1]}")

    def stop(self) -> None:
        stop_all(self.procs)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
