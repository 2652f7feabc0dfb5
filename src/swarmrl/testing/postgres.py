"""A private, throw-away PostgreSQL server on loopback for tests of the pool's PostgreSQL path.

``with private_postgres() as url:`` makes a fresh cluster in a temporary directory (``initdb``
with a random password, SCRAM authentication, loopback only, a free port), starts it, yields
a SQLAlchemy URL for a role that may create databases, and at exit stops the server
(``pg_ctl stop -m fast``) and deletes the directory. Nothing outlives the ``with`` block.

Needs Debian's PostgreSQL server binaries (``/usr/lib/postgresql/*/bin``; ``.ci/services``
installs them). As root, the server runs as the ``postgres`` user, which PostgreSQL requires.
Knows nothing about the pool.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from swarmrl.errors import ServiceUnavailable


def server_binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` holding ``initdb``, or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_server_user() -> list[str]:
    """PostgreSQL refuses to run as root: run its commands as ``postgres`` then."""
    return ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []


def _run(command: list[str], what: str, timeout_s: float = 120.0) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceUnavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ServiceUnavailable(f"{what} failed: {last[0]}")


@contextlib.contextmanager
def private_postgres(timeout_s: float = 60.0) -> Iterator[str]:
    """Start a private server; yield ``postgresql+psycopg://…/postgres``; stop and delete it."""
    binaries = server_binaries()
    if binaries is None:
        raise ServiceUnavailable("no PostgreSQL server binaries (run .ci/services to install)")
    home = Path(tempfile.mkdtemp(prefix="swarmrl-pg-"))
    data, password = home / "data", secrets.token_hex(16)
    secret = home / "password"
    secret.write_text(password + "\n")
    if os.getuid() == 0:
        entry = pwd.getpwnam("postgres")
        for path in (home, secret):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    user, port = _as_server_user(), _free_port()
    started = False
    try:
        _run(
            [*user, str(binaries / "initdb"), "-D", str(data), "-U", "swarmrl",
             "--pwfile", str(secret), "-A", "scram-sha-256", "--no-sync"],
            "initdb",
        )  # fmt: skip
        _run(
            [*user, str(binaries / "pg_ctl"), "-D", str(data), "-l", str(home / "server.log"),
             "-w", "-t", str(int(timeout_s)), "-o", f"-h 127.0.0.1 -p {port} -k {home}", "start"],
            "starting PostgreSQL",
            timeout_s + 10,
        )  # fmt: skip
        started = True
        yield f"postgresql+psycopg://swarmrl:{password}@127.0.0.1:{port}/postgres"
    finally:
        if started:
            _run(
                [*user, str(binaries / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                "stopping PostgreSQL",
            )
        shutil.rmtree(home, ignore_errors=True)
