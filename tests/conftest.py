"""Shared fixtures: databases for the pool tests.

PostgreSQL: the server URL comes from SWARMRL_TEST_PG_URL or the file .ci/pg.env that
.ci/services writes; without either, the fixture runs ``.ci/services --no-install`` once.
Tests that need it are skipped, with the reason, only when no server can be started. Each
module (``pg_url``) or test (``db_url``) gets a fresh database, dropped afterwards.
"""

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

REPO = Path(__file__).resolve().parent.parent
ENV_FILE = REPO / ".ci" / "pg.env"


def _url_from_file() -> str | None:
    if not ENV_FILE.is_file():
        return None
    for line in ENV_FILE.read_text().splitlines():
        if line.startswith("SWARMRL_TEST_PG_URL="):
            return line.split("=", 1)[1].strip()
    return None


def _server_url() -> tuple[str | None, str]:
    url = os.environ.get("SWARMRL_TEST_PG_URL") or _url_from_file()
    if url:
        return url, ""
    services = REPO / ".ci" / "services"
    if not services.is_file():
        return None, "no SWARMRL_TEST_PG_URL and no .ci/services to start PostgreSQL"
    try:
        run = subprocess.run(
            [str(services), "--no-install"], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return None, ".ci/services did not start PostgreSQL within 120 s"
    return _url_from_file(), run.stderr.strip() or "PostgreSQL could not be started"


@pytest.fixture(scope="session")
def pg_server() -> str:
    """Base URL of a reachable PostgreSQL server, or skip."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")
    base, why = _server_url()
    if base is None:
        pytest.skip(f"no PostgreSQL server: {why}")
    return base


def _fresh_database(base: str) -> Iterator[str]:
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"swarmrl_t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL at {base} is not reachable: {exc.orig}")
    yield base.rsplit("/", 1)[0] + "/" + name
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture(scope="module")
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh PostgreSQL database for one test module."""
    yield from _fresh_database(pg_server)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The pool database URL of one test, once per backend: "" (SQLite in the run dir) or a
    fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield ""
    else:
        yield from _fresh_database(request.getfixturevalue("pg_server"))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """As ``db_url``, shared by one test module."""
    if request.param == "sqlite":
        yield ""
    else:
        yield from _fresh_database(request.getfixturevalue("pg_server"))
