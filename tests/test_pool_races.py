"""Two server processes on one PostgreSQL database: every read-then-write of the pool, raced.

Each test builds two contexts over the same database with their own engines (two server
processes' worth of connections) and makes them overlap at the worst moment: the first
operation is held just before its write (``Pause``: a SQLAlchemy hook that blocks one
statement of one engine), the second runs meanwhile, then the first goes on. Without the lock
each test names, the second would read the state the first has not written yet: a forked
ledger, two leases past the cap, a 500 for a double submission or a double join, a lease
expired twice. The last test serves one pool from two real server processes (``--workers 2``) and checks the
one ledger they wrote.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import RateLimited
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import MemoryNonceStore, RequestVerifier, sign_request
from swarmrl.ledger.chain import ledger_table
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import judging, work
from swarmrl.pool.invites import make_invite
from swarmrl.pool.rejections import Conflict
from swarmrl.pool.server import make_context
from swarmrl.pool.state import db
from swarmrl.pool.state.nonces import DatabaseNonceStore
from swarmrl.pool.trust import joins, service
from swarmrl.pool.trust.audit import audit
from swarmrl.pool.trust.service import Context
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import JoinRequest, PoolSpec, RejoinRequest, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples

POOL = "race"
HOLD_S = 0.6  # how long the first operation is held: ample for the second to reach its lock


class Pause:
    """Blocks the first statement of ``engine`` that starts with ``prefix`` until released."""

    def __init__(self, engine: sa.Engine, prefix: str) -> None:
        self.prefix, self.reached, self.released = prefix, threading.Event(), threading.Event()
        self.armed = True
        sa.event.listen(engine, "before_cursor_execute", self._hook)

    def _hook(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.armed and statement.lstrip().upper().startswith(self.prefix):
            self.armed = False
            self.reached.set()
            assert self.released.wait(30), "the paused operation was never released"


class Run(threading.Thread):
    """``fn()`` in a thread, keeping its result or its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:  # kept for the test to assert on
            self.error = exc

    def outcome(self) -> Any:
        self.join(30)
        assert not self.is_alive(), "operation still running after 30 s"
        return self.error if self.error is not None else self.result


def race(first: Callable[[], Any], pause: Pause, second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run ``first`` until ``pause`` holds it, run ``second`` meanwhile (it blocks on a lock
    or finishes), release ``first``; both outcomes (result or exception)."""
    a = Run(first)
    a.start()
    assert pause.reached.wait(30), f"the first operation never reached {pause.prefix!r}"
    b = Run(second)
    b.start()
    b.join(HOLD_S)
    pause.released.set()
    return a.outcome(), b.outcome()


def spec(owner: KeyPair, **overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = dict(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        open=True,
        task_count=1000,
        samples_per_task=1,
        sampling=SamplingParams(max_new_tokens=4),
        validated_fraction=0.0,
        max_tasks_per_lease=2,
        max_leases_in_flight=1,
    )
    return PoolSpec(**{**fields, **overrides})


@pytest.fixture
def two(db_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two contexts (two processes' engines) over one fresh PostgreSQL database."""
    if not db_url:
        pytest.skip("several server processes need PostgreSQL")
    orch = KeyPair.generate()
    config = PoolConfig(db_url=db_url, store_url=str(tmp_path / "store"))
    config = config.model_copy(update={"join_rate_per_s": 100.0, "join_burst": 100})
    a = make_context(orch, tmp_path / "a", config)
    b = make_context(orch, tmp_path / "b", config)
    yield a, b
    audit(a.engine, orch.public_key_hex)  # the tables agree with a ledger that verifies
    a.engine.dispose()
    b.engine.dispose()


def join(ctx: Context, key: KeyPair, invite: Any = None) -> Any:
    req = JoinRequest(metadata=CPU_NODE, invite=invite)
    return joins.join(ctx, POOL, key.public_key_hex, key.node_id, req)


def signed_submission(key: KeyPair, lease: Any) -> tuple[Any, Submission]:
    sub = Submission(lease_id=lease.lease_id, samples=synthetic_samples(lease, 0))
    body = sub.model_dump_json().encode()
    path = f"/pools/{POOL}/submissions"
    headers = sign_request(key, "POST", path, body)
    verifier = RequestVerifier(MemoryNonceStore(), window_s=60, max_body_bytes=1 << 24)
    return verifier.verify("POST", path, body, headers), sub


def ledger_kinds(ctx: Context) -> list[str]:
    with ctx.engine.connect() as conn:
        return list(
            conn.execute(sa.select(ledger_table.c.kind).order_by(ledger_table.c.seq)).scalars()
        )


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_processes_append_to_one_unforked_ledger(two):
    a, b = two
    owner = KeyPair.generate()
    pause = Pause(a.engine, "INSERT INTO LEDGER")
    race(
        lambda: service.create_pool(a, spec(owner, pool_id="x")),
        pause,
        lambda: service.create_pool(b, spec(owner, pool_id="y")),
    )
    with a.engine.connect() as conn:
        rows = conn.execute(sa.select(ledger_table).order_by(ledger_table.c.seq)).all()
    # each pool's two entries, chained one after another (the fixture verifies the chain)
    assert [r.seq for r in rows] == [0, 1, 2, 3]
    assert sorted(r.pool_id for r in rows) == ["x", "x", "y", "y"]
    assert [r.prev_hash for r in rows[1:]] == [r.entry_hash for r in rows[:-1]]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_processes_leasing_one_node_keep_its_cap_and_counter(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate()))
    node = KeyPair.generate()
    join(a, node)
    pause = Pause(a.engine, "INSERT INTO LEASES")
    first, second = race(
        lambda: work.lease(a, POOL, node.node_id), pause, lambda: work.lease(b, POOL, node.node_id)
    )
    assert first.outcome == "work"
    assert second.outcome == "wait" and "cap 1" in second.reason  # one lease in flight at most
    with a.engine.connect() as conn:
        in_flight = service.leases_in_flight(conn, POOL, node.node_id)
        counter = service.node_row(conn, POOL, node.node_id).lease_counter
    assert (in_flight, counter) == (1, 1)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_processes_leasing_with_a_higher_cap_draw_different_tasks(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate(), max_leases_in_flight=2))
    node = KeyPair.generate()
    join(a, node)
    pause = Pause(a.engine, "INSERT INTO LEASES")
    first, second = race(
        lambda: work.lease(a, POOL, node.node_id), pause, lambda: work.lease(b, POOL, node.node_id)
    )
    # one lease counter value per unit: the same counter would draw the same tasks and seed
    assert {first.work.origin_counter, second.work.origin_counter} == {0, 1}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_lease_answered_at_two_processes_at_once_is_one_submission_and_a_409(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate()))
    node = KeyPair.generate()
    join(a, node)
    lease = work.lease(a, POOL, node.node_id).work
    pause = Pause(a.engine, "INSERT INTO SUBMISSIONS")
    first, second = race(
        lambda: work.submit(a, POOL, *signed_submission(node, lease)),
        pause,
        lambda: work.submit(b, POOL, *signed_submission(node, lease)),
    )
    assert first.status == "pending"
    assert isinstance(second, Conflict), second  # not a duplicate-key 500
    assert ledger_kinds(a).count("submission") == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_validators_claiming_at_two_processes_get_different_submissions(two):
    a, b = two
    v1, v2 = KeyPair.generate(), KeyPair.generate()
    validators = [v1.public_key_hex, v2.public_key_hex]
    service.create_pool(a, spec(KeyPair.generate(), validated_fraction=1.0, validators=validators))
    for _ in range(2):
        node = KeyPair.generate()
        join(a, node)
        work.submit(a, POOL, *signed_submission(node, work.lease(a, POOL, node.node_id).work))
    pause = Pause(a.engine, "UPDATE SUBMISSIONS")
    first, second = race(
        lambda: judging.claim(a, POOL, v1.public_key_hex, 1),
        pause,
        lambda: judging.claim(b, POOL, v2.public_key_hex, 1),
    )
    ids = [json.loads(reply)["submissions"][0]["submission_id"] for reply in (first, second)]
    assert ids[0] != ids[1]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_node_joining_at_two_processes_at_once_joins_once(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate()))
    node = KeyPair.generate()
    pause = Pause(a.engine, "INSERT INTO NODES")
    first, second = race(lambda: join(a, node), pause, lambda: join(b, node))
    assert first.node_id == second.node_id == node.node_id, (first, second)
    assert second.state == "healthy"
    assert ledger_kinds(a).count("node_joined") == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_node_rejoining_at_two_processes_at_once_rejoins_once(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate()))
    node = KeyPair.generate()
    join(a, node)
    with a.engine.begin() as conn:  # let go for silence (what the sweep does after dead_after_s)
        conn.execute(sa.update(db.nodes).values(state="ejected"))
    req = RejoinRequest(metadata=CPU_NODE)
    pause = Pause(a.engine, "UPDATE NODES")
    first, second = race(
        lambda: joins.rejoin(a, POOL, node.public_key_hex, node.node_id, req),
        pause,
        lambda: joins.rejoin(b, POOL, node.public_key_hex, node.node_id, req),
    )
    assert first.state == second.state == "healthy", (first, second)
    assert ledger_kinds(a).count("node_rejoined") == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_invite_used_at_two_processes_at_once_admits_one_node(two):
    a, b = two
    owner = KeyPair.generate()
    service.create_pool(a, spec(owner, open=False))
    invite = make_invite(owner, POOL, 600)
    x, y = KeyPair.generate(), KeyPair.generate()
    pause = Pause(a.engine, "INSERT INTO INVITES_USED")
    first, second = race(lambda: join(a, x, invite), pause, lambda: join(b, y, invite))
    assert first.node_id == x.node_id
    assert isinstance(second, Conflict) and "already used" in str(second), second
    assert ledger_kinds(a).count("node_joined") == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_join_rate_limit_is_one_bucket_for_all_processes(two):
    a, b = two
    slow = {"join_rate_per_s": 0.001, "join_burst": 2}
    a.config = a.config.model_copy(update=slow)
    b.config = b.config.model_copy(update=slow)
    service.create_pool(a, spec(KeyPair.generate()))
    join(a, KeyPair.generate())
    join(b, KeyPair.generate())
    # the burst of 2 is spent across both processes: a third identity waits, at either
    for ctx in (a, b):
        with pytest.raises(RateLimited):
            join(ctx, KeyPair.generate())


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_overdue_lease_is_expired_once_by_two_sweepers(two):
    a, b = two
    service.create_pool(a, spec(KeyPair.generate(), lease_timeout_s=5.0))
    node = KeyPair.generate()
    join(a, node)
    work.lease(a, POOL, node.node_id)
    later = time.time() + 60.0  # the lease's deadline has passed; the node is not yet silent
    a.clock = b.clock = lambda: later
    a.started_at = b.started_at = later
    pause = Pause(a.engine, "UPDATE LEASES")
    first, second = race(lambda: service.sweep(a), pause, lambda: service.sweep(b))
    assert first["leases"] + second["leases"] == 1, (first, second)
    assert ledger_kinds(a).count("invalidation") == 1
    with a.engine.connect() as conn:
        assert service.node_row(conn, POOL, node.node_id).soft == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_nonce_claimed_at_two_processes_is_accepted_once(two):
    a, b = two
    na, nb = DatabaseNonceStore(a.engine), DatabaseNonceStore(b.engine)
    na.claim("k" * 64, "warm", time.time() + 60)  # both stores purge on their first claim
    nb.claim("k" * 64, "warm2", time.time() + 60)
    pause = Pause(a.engine, "INSERT INTO NONCES")
    until = time.time() + 60
    first, second = race(
        lambda: na.claim("k" * 64, "n1", until), pause, lambda: nb.claim("k" * 64, "n1", until)
    )
    assert sorted([first, second]) == [False, True]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_expired_nonce_reused_at_two_processes_is_accepted_once(two):
    a, b = two
    clock = [time.time()]
    na = DatabaseNonceStore(a.engine, lambda: clock[0], purge_every_s=1e9)
    nb = DatabaseNonceStore(b.engine, lambda: clock[0], purge_every_s=1e9)
    na.claim("k" * 64, "warm", clock[0] + 1)  # first claims purge; later ones do not
    nb.claim("k" * 64, "warm2", clock[0] + 1)
    assert na.claim("k" * 64, "old", clock[0] + 5)
    clock[0] += 10  # the pair's window passed; it is still stored (no purge since)
    pause = Pause(a.engine, "UPDATE NONCES")
    until = clock[0] + 60
    first, second = race(
        lambda: na.claim("k" * 64, "old", until), pause, lambda: nb.claim("k" * 64, "old", until)
    )
    assert sorted([first, second]) == [False, True]


def test_workers_refuse_sqlite_in_one_line(tmp_path, capsys):
    from swarmrl.cli import main as swarmrl_main

    KeyPair.generate().save(tmp_path / "orch.json")
    code = swarmrl_main(
        ["orchestrator", "--key", str(tmp_path / "orch.json"), "--run-dir", str(tmp_path),
         "--workers", "2", "--port", "0"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and "PostgreSQL" in err[0] and "--workers" in err[0], err


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_two_server_processes_serve_one_pool_and_one_ledger(db_url, tmp_path):
    orch, owner = KeyPair.generate(), KeyPair.generate()
    orch.save(tmp_path / "orch.json")
    (tmp_path / "spec.json").write_text(spec(owner, max_leases_in_flight=2).model_dump_json())
    proc, url = spawn_orchestrator(
        tmp_path / "run",
        tmp_path / "orch.json",
        [tmp_path / "spec.json"],
        settings={"pool.join_rate_per_s": 1000, "pool.join_burst": 1000},
        args=["--db", db_url, "--store", str(tmp_path / "store"), "--workers", "2", "--no-ui"],
    )
    try:
        assert len(_children(proc.pid)) == 1  # the second server process

        def node_life(key: KeyPair) -> int:
            with PoolClient(url, key) as client:
                client.join(POOL, CPU_NODE)
                done = 0
                for _ in range(3):
                    units = [client.lease(POOL).work for _ in range(2)]
                    for unit in units:
                        sub = Submission(lease_id=unit.lease_id, samples=synthetic_samples(unit, 0))
                        client.submit(POOL, sub)
                        done += 1
                return done

        keys = [KeyPair.generate() for _ in range(12)]
        with ThreadPoolExecutor(len(keys)) as pool:
            assert list(pool.map(node_life, keys)) == [6] * len(keys)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert _children(proc.pid) == []
    engine = sa.create_engine(db_url)
    try:
        audit(engine, orch.public_key_hex)  # one chain, and the tables agree with it
        with engine.connect() as conn:
            kinds = list(conn.execute(sa.select(ledger_table.c.kind)).scalars())
    finally:
        engine.dispose()
    assert kinds.count("node_joined") == 12 and kinds.count("submission") == 72
