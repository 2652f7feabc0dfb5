"""Hostile requests against a live orchestrator: each is a 4xx with a clear message and leaves
no trace in the database or the rollout store."""

import json
import time

import httpx
import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import (
    Conflict,
    Expired,
    Invalid,
    Malformed,
    NotFound,
    Rejected,
    StaleWork,
    Unauthorized,
)
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.pool.rejections import BY_CODE, STATUS
from swarmrl.pool.state import db
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import (
    Heartbeat,
    JoinRequest,
    PoolSpec,
    Requirements,
    Submission,
)
from swarmrl.testing.pool_nodes import (
    CPU_NODE,
    NEVER_SILENT,
    local_orchestrator,
    synthetic_samples,
)

POOL = "secure"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    run = tmp_path_factory.mktemp("sec")
    orch, owner, validator = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    # beats written at once: the tests compare the database before and after refused requests,
    # which a flush of an earlier test's beats in between would change; and silence never moves
    # a node during the module (a loaded machine can take longer than the default 15 s)
    cfg = PoolConfig(
        max_body_bytes=64 << 10, request_window_s=30, heartbeat_flush_s=0, **NEVER_SILENT
    )
    with local_orchestrator(run, orch, cfg) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            samples_per_task=1,
            sampling=SamplingParams(max_new_tokens=4),
            validators=[validator.public_key_hex],
            async_level=1,
            requirements=Requirements(engines=["torch"], min_memory_gb=4),
        )
        PoolClient(server.url, orch).create_pool(spec)
        node = KeyPair.generate()
        PoolClient(server.url, node).join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
        yield server, owner, node, run


def snapshot(server, run):
    """Every table, plus the store's files."""
    with server.ctx.engine.connect() as conn:
        tables = {
            t.name: sorted(map(tuple, conn.execute(sa.select(t)).all()))
            for t in db.metadata.sorted_tables
            if t.name != "nonces"
        }
    files = sorted(str(p) for p in (run / "rollouts").rglob("*") if p.is_file())
    return tables, files


def raw(url, key, method, path, body=b"", headers=None, **sign_kw):
    signed = sign_request(key, method, path, body, **sign_kw)
    signed.update(headers or {})
    signed["Content-Type"] = "application/json"
    return httpx.request(method, url + path, content=body, headers=signed, timeout=10)


def expect(response, status, words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert STATUS[BY_CODE[error["code"]]] == status, error
    assert words in error["message"], error


def test_forged_stale_replayed_and_unsigned_requests(env):
    server, owner, node, run = env
    before = snapshot(server, run)
    path, body = f"/pools/{POOL}/heartbeat", b'{"status":"ok"}'
    # forged: signature by another key under this node's public key
    h = sign_request(KeyPair.generate(), "POST", path, body)
    h["X-Swarm-Key"] = node.public_key_hex
    r = httpx.post(server.url + path, content=body, headers=h)
    expect(r, 401, "does not verify")
    # body altered after signing
    h = sign_request(node, "POST", path, body)
    expect(
        httpx.post(server.url + path, content=b'{"status":"error"}', headers=h),
        401,
        "does not verify",
    )
    # path altered after signing
    h = sign_request(node, "POST", f"/pools/{POOL}/lease", body)
    expect(httpx.post(server.url + path, content=body, headers=h), 401, "does not verify")
    # stale and future timestamps
    expect(raw(server.url, node, "POST", path, body, now_s=time.time() - 120), 401, "window")
    expect(raw(server.url, node, "POST", path, body, now_s=time.time() + 120), 401, "window")
    # missing and malformed headers
    expect(httpx.post(server.url + path, content=body), 401, "missing header")
    expect(
        raw(server.url, node, "POST", path, body, headers={"X-Swarm-Nonce": "xyz"}),
        401,
        "X-Swarm-Nonce",
    )
    assert snapshot(server, run) == before
    # replayed nonce: the first use works, the second is refused
    h = sign_request(node, "POST", path, body) | {"Content-Type": "application/json"}
    assert httpx.post(server.url + path, content=body, headers=h).status_code == 200
    expect(httpx.post(server.url + path, content=body, headers=h), 401, "already used")


def test_a_weak_key_whose_signatures_anyone_can_make_cannot_join_an_open_pool(env):
    # the identity point as public key: R = identity, S = 0 verifies under it for every message
    # in a cofactorless check, so whoever joined with it could send (and deny) anything
    server, owner, node, run = env
    orch = server.ctx.key
    spec = PoolSpec(
        pool_id="open-weak",
        owner_key=owner.public_key_hex,
        task_count=5,
        open=True,
        validators=[KeyPair.generate().public_key_hex],
    )
    PoolClient(server.url, orch).create_pool(spec)
    before = snapshot(server, run)
    path = "/pools/open-weak/join"
    body = JoinRequest(metadata=CPU_NODE).model_dump_json().encode()
    headers = {
        "X-Swarm-Key": "01" + "00" * 31,
        "X-Swarm-Timestamp": str(int(time.time() * 1000)),
        "X-Swarm-Nonce": "ab" * 16,
        "X-Swarm-Signature": "01" + "00" * 63,
        "Content-Type": "application/json",
    }
    expect(httpx.post(server.url + path, content=body, headers=headers), 401, "small-order")
    assert snapshot(server, run) == before
    PoolClient(server.url, KeyPair.generate()).join("open-weak", CPU_NODE)  # a real key joins


def test_oversized_body_is_refused_before_parsing(env):
    server, owner, node, run = env
    before = snapshot(server, run)
    big = json.dumps({"status": "ok", "log_tail": ["x" * 1000] * 100}).encode()
    r = raw(server.url, node, "POST", f"/pools/{POOL}/heartbeat", big)
    expect(r, 413, "exceeds the limit")
    assert snapshot(server, run) == before


def test_invites_expired_reused_forged_or_for_another_node(env):
    server, owner, node, run = env
    url = server.url
    before = snapshot(server, run)
    n1, n2 = KeyPair.generate(), KeyPair.generate()
    cases = [
        (None, Unauthorized, "invite from its owner is required"),
        (make_invite(owner, POOL, -1), Expired, "expired"),
        (make_invite(KeyPair.generate(), POOL, 60), Unauthorized, "not signed by the pool owner"),
        (make_invite(owner, "other-pool", 60), Unauthorized, "is for pool"),
        (make_invite(owner, POOL, 60, node_id=n2.node_id), Unauthorized, "for another node"),
    ]
    for invite, kind, words in cases:
        with pytest.raises(Rejected) as err:
            PoolClient(url, n1).join(POOL, CPU_NODE, invite)
        assert type(err.value) is kind and words in str(err.value), err.value
    # tampered invite: expiry pushed out after signing
    good = make_invite(owner, POOL, 60)
    forged = good.model_copy(update={"expires_at": good.expires_at + 1e6})
    with pytest.raises(Unauthorized, match="not signed by the pool owner"):
        PoolClient(url, n1).join(POOL, CPU_NODE, forged)
    # requirements are checked before the invite is spent
    weak = CPU_NODE.model_copy(update={"memory_gb": 1.0, "engine": "llama.cpp"})
    with pytest.raises(Unauthorized, match="engine .* not in .*; memory 1 GiB < 4 GiB"):
        PoolClient(url, n1).join(POOL, weak, good)
    assert snapshot(server, run) == before
    PoolClient(url, n1).join(POOL, CPU_NODE, good)
    with pytest.raises(Conflict, match="already used"):
        PoolClient(url, n2).join(POOL, CPU_NODE, good)


def test_unknown_nodes_and_non_admins_are_refused(env):
    server, owner, node, run = env
    stranger = PoolClient(server.url, KeyPair.generate())
    before = snapshot(server, run)
    for call, kind, words in [
        (lambda: stranger.lease(POOL), NotFound, "join first"),
        (lambda: stranger.heartbeat(POOL, Heartbeat(status="ok")), NotFound, "join first"),
        (lambda: stranger.lease("no-such-pool"), NotFound, "unknown pool"),
        (lambda: stranger.nodes(POOL), Unauthorized, "admin"),
        (lambda: stranger.set_version(POOL, 5), Unauthorized, "admin"),
        (lambda: stranger.claim(POOL), Unauthorized, "not a validator"),
        (lambda: PoolClient(server.url, node).batch(POOL, 0), Unauthorized, "admin"),
    ]:
        with pytest.raises(Rejected) as err:
            call()
        assert type(err.value) is kind and words in str(err.value), err.value
    assert snapshot(server, run) == before


def test_submissions_for_another_nodes_lease_or_bad_samples(env):
    server, owner, node, run = env
    client = PoolClient(server.url, node)
    other = KeyPair.generate()
    other_client = PoolClient(server.url, other)
    other_client.join(POOL, CPU_NODE, make_invite(owner, POOL, 60))
    work = client.lease(POOL).work
    good = synthetic_samples(work, 0)
    before = snapshot(server, run)

    def refused(c, samples, kind, words, lease_id=work.lease_id):
        with pytest.raises(Rejected) as err:
            c.submit(POOL, Submission(lease_id=lease_id, samples=samples))
        assert type(err.value) is kind and words in str(err.value), err.value

    refused(other_client, good, Unauthorized, "belongs to another node")
    refused(client, good, NotFound, "unknown lease", lease_id="f" * 32)
    refused(client, good[:-1], Invalid, "do not match the lease")
    refused(
        client, [good[0].model_copy(update={"logprobs": [-1.0]})] + good[1:], Invalid, "logprobs"
    )
    refused(client, [good[0].model_copy(update={"logprobs": [0.5] * 4})] + good[1:], Invalid, "≤ 0")
    long = good[0].model_copy(update={"output_tokens": [1] * 9, "logprobs": [-1.0] * 9})
    refused(client, [long] + good[1:], Invalid, "max_new_tokens")
    refused(client, [good[0].model_copy(update={"proof": "zz"})] + good[1:], Malformed, "hex")
    refused(
        client, [good[0].model_copy(update={"policy_version": 3})] + good[1:], Conflict, "> current"
    )
    assert snapshot(server, run) == before
    PoolClient(server.url, owner).set_version(POOL, 5)
    before = snapshot(server, run)
    refused(client, good, StaleWork, "stale")  # the lease stays open: below
    assert snapshot(server, run) == before
    fresh = [s.model_copy(update={"policy_version": 4}) for s in good]
    assert (
        client.submit(POOL, Submission(lease_id=work.lease_id, samples=fresh)).tokens
        == len(good) * 4
    )
    refused(client, fresh, Conflict, "already answered")


def test_malformed_json_and_schema_violations(env):
    server, owner, node, run = env
    before = snapshot(server, run)
    path = f"/pools/{POOL}/join"
    expect_status = {b"{": 422, b'{"metadata": 5}': 422, b"[]": 422}
    for body, status in expect_status.items():
        assert raw(server.url, node, "POST", path, body).status_code == status
    bad = JoinRequest(metadata=CPU_NODE).model_dump()
    bad["metadata"]["memory_gb"] = float("nan")
    r = raw(server.url, KeyPair.generate(), "POST", path, json.dumps(bad).encode())
    assert r.status_code == 422
    assert snapshot(server, run) == before
