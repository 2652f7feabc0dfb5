"""Shared fixtures: databases for the pool tests; SIGINT as the tests expect it.

PostgreSQL: with ``SWARMRL_TEST_PG_URL`` set, that server is used (and left alone). Otherwise
the test session starts a private server of its own (``swarmrl.testing.postgres``: a temporary
cluster on a free loopback port with a random password) and stops and deletes it when the
session ends, so nothing keeps running after ``pytest``. Tests that need PostgreSQL are skipped,
with the reason, only when no server can be had (``.ci/services`` installs the binaries). Each
module (``pg_url``) or test (``db_url``) gets a fresh database, dropped afterwards.

A shell starts its background jobs with SIGINT ignored, and an ignored signal stays ignored in
every process started from it: tests that interrupt a run or a supervisor with SIGINT would
then wait for an interrupt their child never sees. The session takes SIGINT back (Python's
own handler), so the processes it starts get the default again.

Hypothesis keeps its example database and caches in ``.hypothesis/`` of the current directory
unless told otherwise: here they go to the user cache (``run.cache_dir``'s default, under
``hypothesis/``), so a test run leaves nothing in the repository. ``HYPOTHESIS_STORAGE_DIRECTORY``
set beforehand wins.

``colocated_run`` is the directory of a short colocated ``swarmrl run`` made once per session,
and ``runs`` those of a short swarm run and a short colocated one, for tools that work on run
directories to be tested on what a run really writes.
"""

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from swarmrl.config.run import user_cache_dir
from swarmrl.errors import ServiceUnavailable
from swarmrl.testing.postgres import private_postgres
from swarmrl.testing.runs import SERVE_SHORT, SWARM_RUN_STEPS, SWARM_SHORT, short_run

# read by hypothesis when it first stores something, which is after this module is imported
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(Path(user_cache_dir()) / "hypothesis"))

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """Base URL of a reachable PostgreSQL server for this session, or skip."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")
    given = os.environ.get("SWARMRL_TEST_PG_URL")
    if given:
        yield given
        return
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(private_postgres())
        except ServiceUnavailable as exc:
            pytest.skip(f"no PostgreSQL server: {exc}")
        yield url


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


@pytest.fixture(scope="session")
def colocated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory ``swarmrl run configs/arith.toml --colocated`` wrote (a tiny model,
    ``swarmrl.testing.runs.SERVE_SHORT``)."""
    run_dir, _ = short_run(tmp_path_factory.mktemp("colocated-run"), SERVE_SHORT, "--colocated")
    return run_dir


@pytest.fixture(scope="session")
def swarm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``swarmrl run configs/arith.toml`` as a swarm with the short settings and
    ``SWARM_RUN_STEPS`` steps, its console piped (not ``--quiet``): its run directory and
    console. One run for every test that reads what a swarm run wrote."""
    settings = [s for s in SWARM_SHORT if not s.startswith("rl.steps=")]
    return short_run(
        tmp_path_factory.mktemp("swarm-run"),
        [*settings, f"rl.steps={SWARM_RUN_STEPS}"],
        quiet=False,
    )


@pytest.fixture(scope="session")
def runs(swarm_run: tuple[Path, str]) -> dict[str, Path]:
    """The run directories ``swarmrl run configs/arith.toml`` wrote, as a swarm (``swarm``:
    :func:`swarm_run`) and with ``--colocated`` (``colocated``), with the short settings (the
    warm start shared)."""
    swarm = swarm_run[0]
    colocated, _ = short_run(swarm.parent.parent, SWARM_SHORT, "--colocated")
    return {"swarm": swarm, "colocated": colocated}


@pytest.fixture(scope="module")
def tiny_arith() -> tuple:
    """(config, env, tokenizer, model): 2-digit arith and a one-layer tiny model, seeded."""
    import torch

    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.envs import build_env
    from swarmrl.model import build_char_tokenizer, create_tiny_model

    torch.manual_seed(0)
    config = load_config(
        [EMBEDDED_DEFAULT],
        ["env.digits=2", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
         "model.tiny.intermediate_size=64"],
    )  # fmt: skip
    env = build_env(config.env)
    tokenizer = build_char_tokenizer(env.alphabet)
    model = create_tiny_model(config.model.tiny, tokenizer).eval()
    return config, env, tokenizer, model
