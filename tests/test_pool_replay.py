"""Signed-request replay: nonces survive an orchestrator restart, and requests dated more than a
few seconds ahead are refused, on SQLite and PostgreSQL."""

import time

import httpx
import sqlalchemy as sa
from starlette.testclient import TestClient

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import HEADER_NONCE as NONCE
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.server import make_context
from swarmrl.pool.state import db
from swarmrl.pool.web.app import build_app
from swarmrl.protocol.pool import PoolSpec, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "rp"


def _send(url, path, headers, body):
    headers = headers | {"Content-Type": "application/json"}
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def test_a_request_captured_before_a_restart_is_refused_after_it(db_url, tmp_path):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=db_url)
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path, body = f"/pools/{POOL}/lease", b""
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        # dated 4 s ahead (inside the accepted skew), so it is still fresh after the restart
        captured = sign_request(node, "POST", path, body, now_s=time.time() + 4)
        first = _send(server.url, path, captured, body)
        assert first.status_code == 200 and first.json()["work"] is not None
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        replay = _send(server.url, path, captured, body)
        assert replay.status_code == 401, replay.text
        assert "already used" in replay.json()["error"]["message"]
        leases = PoolClient(server.url, owner).nodes(POOL)[0].leases_in_flight
        assert leases == 1  # the replay gave the node no lease it never asked for


def test_requests_dated_ahead_beyond_the_skew_are_refused(tmp_path):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path, body = f"/pools/{POOL}/heartbeat", b'{"status":"ok"}'
    with local_orchestrator(tmp_path / "run", orch, PoolConfig()) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        ahead = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() + 45), body
        )
        assert ahead.status_code == 401 and "window" in ahead.json()["error"]["message"], ahead.text
        near = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() + 2), body
        )
        assert near.status_code == 200, near.text
        old = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() - 45), body
        )
        assert old.status_code == 200, old.text


def test_the_database_nonce_store_refuses_reuse_until_expiry(db_url, tmp_path):
    from swarmrl.pool.state.db import make_engine, sqlite_url
    from swarmrl.pool.state.nonces import DatabaseNonceStore

    engine = make_engine(db_url or sqlite_url(tmp_path / "n.db"))
    now = [1000.0]
    store = DatabaseNonceStore(engine, clock=lambda: now[0])
    key, other = "a" * 64, "b" * 64
    assert store.claim(key, "n" * 16, expires_at_s=1060.0)
    assert not store.claim(key, "n" * 16, expires_at_s=1060.0)
    assert store.claim(other, "n" * 16, expires_at_s=1060.0)  # per key
    now[0] = 1061.0  # expired: the window check alone refuses it now, so it may be forgotten
    assert store.claim(key, "n" * 16, expires_at_s=1121.0)
    assert not DatabaseNonceStore(engine, clock=lambda: now[0]).claim(key, "n" * 16, 1121.0)
    engine.dispose()


def test_a_submission_claims_its_nonce_with_it_and_a_replay_is_refused(db_url, tmp_path):
    """The hot lane claims a submission's nonce in the submission's transaction: a replay of a
    stored one is refused (and stores nothing), a refused one (another lease's, then a lease
    already answered) keeps its nonce used, and the FastAPI route claims it once, as before."""
    orch, node = KeyPair.generate(), KeyPair.generate()
    spec = PoolSpec(
        pool_id=POOL, owner_key=orch.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path = f"/pools/{POOL}/submissions"

    def send(url, body, target=path):
        headers = sign_request(node, "POST", target, body)
        return headers, _send(url, target, headers, body)

    def replayed(url, headers, body, target=path):
        again = _send(url, target, headers, body)
        return again.status_code == 401 and again.json()["error"]["code"] == "replayed_request"

    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        client = PoolClient(server.url, orch)
        client.create_pool(spec)
        worker = PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        bodies = []
        for _ in range(2):
            work = worker.lease(POOL).work
            sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            bodies.append(sub.model_dump_json().encode())
        headers, first = send(server.url, bodies[0])
        assert first.status_code == 200, first.text
        assert replayed(server.url, headers, bodies[0])
        headers, twice = send(server.url, bodies[0])  # freshly signed: a refused submission
        assert twice.status_code == 409
        assert replayed(server.url, headers, bodies[0])
        unknown = b'{"lease_id":"' + b"f" * 32 + bodies[1][45:]  # a lease nobody holds
        headers, refused = send(server.url, unknown)
        assert refused.status_code == 404, refused.text
        assert replayed(server.url, headers, unknown)
        slow_lane = path + "?via=fastapi"
        headers, second = send(server.url, bodies[1], slow_lane)
        assert second.status_code == 200, second.text
        assert replayed(server.url, headers, bodies[1], slow_lane)
        with server.ctx.engine.connect() as conn:
            stored = conn.execute(sa.select(sa.func.count()).select_from(db.submissions)).scalar()
        assert stored == 2


def test_a_lease_replay_is_refused_and_a_refused_lease_stays_used(db_url, tmp_path):
    """A replay of a granted lease is refused and grants nothing; a lease refused (a node that
    never joined) keeps its nonce used; the FastAPI route claims it once."""
    orch, node, stranger = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL, owner_key=orch.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path = f"/pools/{POOL}/lease"
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        for key, target, status in (
            (node, path, 200),
            (stranger, path, 404),  # join first: refused, its nonce used all the same
            (node, path + "?via=fastapi", 200),
        ):
            headers = sign_request(key, "POST", target, b"")
            answer = _send(server.url, target, headers, b"")
            assert answer.status_code == status, answer.text
            again = _send(server.url, target, headers, b"")
            assert again.status_code == 401, again.text
            assert again.json()["error"]["code"] == "replayed_request"
        with server.ctx.engine.connect() as conn:
            granted = conn.execute(sa.select(sa.func.count()).select_from(db.leases)).scalar()
        assert granted == 2  # the replays granted nothing


def _beat_pool(tmp_path, cfg):
    """An orchestrator key, a node, and a run directory whose pool the node joined (the
    orchestrator stopped cleanly)."""
    orch, node = KeyPair.generate(), KeyPair.generate()
    spec = PoolSpec(
        pool_id=POOL, owner_key=orch.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
    return orch, node


BEAT_PATH, BEAT_BODY = f"/pools/{POOL}/heartbeat", b'{"status":"ok"}'


def _refused_as_replay(answer):
    return answer.status_code == 401 and answer.json()["error"]["code"] == "replayed_request"


def test_a_beat_claimed_in_memory_is_refused_again_in_the_process_and_after_a_clean_restart(
    db_url, tmp_path
):
    """One server process claims a beat's nonce in memory and writes it with the buffered
    beats: a replay is refused at once, by the FastAPI route too, and after a clean restart."""
    cfg = PoolConfig(db_url=db_url, heartbeat_flush_s=3600)  # written only by the clean stop
    orch, node = _beat_pool(tmp_path, cfg)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        assert server.app.state.hot_nonces.refused_before_s == 0.0  # the stop before was clean
        captured = sign_request(node, "POST", BEAT_PATH, BEAT_BODY, now_s=time.time() + 4)
        assert _send(server.url, BEAT_PATH, captured, BEAT_BODY).status_code == 200
        assert _refused_as_replay(_send(server.url, BEAT_PATH, captured, BEAT_BODY))
        slow = BEAT_PATH + "?via=fastapi"
        headers = sign_request(node, "POST", slow, BEAT_BODY)
        assert _send(server.url, slow, headers, BEAT_BODY).status_code == 200
        assert _refused_as_replay(_send(server.url, slow, headers, BEAT_BODY))
        with server.ctx.engine.connect() as conn:  # no write of its own: it waits for a flush
            count = sa.select(sa.func.count()).select_from(db.nonces)
            assert conn.execute(count.where(db.nonces.c.nonce == captured[NONCE])).scalar() == 0
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        assert server.app.state.hot_nonces.refused_before_s == 0.0
        assert _refused_as_replay(_send(server.url, BEAT_PATH, captured, BEAT_BODY))
        fresh = sign_request(node, "POST", BEAT_PATH, BEAT_BODY)
        assert _send(server.url, BEAT_PATH, fresh, BEAT_BODY).status_code == 200


def test_after_an_unclean_stop_beats_signed_before_the_restart_and_its_skew_are_refused(
    db_url, tmp_path
):
    """A process that crashed may have answered beats whose nonces it never wrote: the next one
    refuses every beat signed before its start plus the accepted skew, and only those."""
    cfg = PoolConfig(db_url=db_url, heartbeat_flush_s=3600)
    orch, node = _beat_pool(tmp_path, cfg)
    crashed = TestClient(build_app(make_context(orch, tmp_path / "run", cfg)))  # no lifespan:
    captured = sign_request(node, "POST", BEAT_PATH, BEAT_BODY, now_s=time.time() + 4)
    headers = captured | {"Content-Type": "application/json"}
    assert crashed.post(BEAT_PATH, content=BEAT_BODY, headers=headers).status_code == 200
    # ... its process ends here without a clean stop (the beat and its nonce are not written)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        guard_s = server.app.state.hot_nonces.refused_before_s
        assert guard_s >= time.time() - 60 + cfg.request_future_skew_s  # this start's
        replay = _send(server.url, BEAT_PATH, captured, BEAT_BODY)
        assert _refused_as_replay(replay) and "unclean stop" in replay.json()["error"]["message"]
        early = sign_request(node, "POST", BEAT_PATH, BEAT_BODY, now_s=guard_s - 0.01)
        assert _refused_as_replay(_send(server.url, BEAT_PATH, early, BEAT_BODY))
        on_time = sign_request(
            node, "POST", BEAT_PATH, BEAT_BODY, now_s=guard_s + 0.001
        )  # (in whole ms)
        assert _send(server.url, BEAT_PATH, on_time, BEAT_BODY).status_code == 200
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:  # that stop was clean
        assert server.app.state.hot_nonces.refused_before_s == 0.0
        assert _refused_as_replay(_send(server.url, BEAT_PATH, on_time, BEAT_BODY))


def test_a_lease_is_claimed_in_memory_like_a_beat_and_refused_after_an_unclean_stop(
    db_url, tmp_path
):
    """A lease's nonce costs no write of its own either; a process that crashed before writing
    it leaves the next one refusing the captured lease (and granting nothing for it)."""
    cfg = PoolConfig(db_url=db_url, heartbeat_flush_s=3600)
    orch, node = _beat_pool(tmp_path, cfg)
    path = f"/pools/{POOL}/lease"
    ctx = make_context(orch, tmp_path / "run", cfg)
    crashed = build_app(ctx)  # run without its lifespan
    captured = sign_request(node, "POST", path, b"", now_s=time.time() + 4)
    headers = captured | {"Content-Type": "application/json"}
    granted = TestClient(crashed).post(path, content=b"", headers=headers)
    assert granted.status_code == 200 and granted.json()["work"] is not None, granted.text
    with ctx.engine.connect() as conn:
        count = sa.select(sa.func.count()).select_from(db.nonces)
        assert conn.execute(count.where(db.nonces.c.nonce == captured[NONCE])).scalar() == 0
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        replay = _send(server.url, path, captured, b"")
        assert _refused_as_replay(replay) and "unclean stop" in replay.json()["error"]["message"]
        with server.ctx.engine.connect() as conn:
            leases = sa.select(sa.func.count()).select_from(db.leases)
            assert conn.execute(leases).scalar() == 1  # the replay was granted nothing


def test_server_processes_sharing_a_database_claim_beats_in_it(db_url, tmp_path):
    cfg = PoolConfig(db_url=db_url)
    orch, node = _beat_pool(tmp_path, cfg)
    apps = [build_app(make_context(orch, tmp_path / "run", cfg), shared=True) for _ in range(2)]
    assert all(app.state.hot_nonces is None for app in apps)
    headers = sign_request(node, "POST", BEAT_PATH, BEAT_BODY) | {
        "Content-Type": "application/json"
    }
    first, second = (
        TestClient(app).post(BEAT_PATH, content=BEAT_BODY, headers=headers) for app in apps
    )
    assert first.status_code == 200, first.text
    assert _refused_as_replay(second)
