"""Coming back after an ejection for silence: a node the health sweep let go rejoins a closed
pool with its own key and no new invite, keeps every part of its record (counters, credits,
spot-check rate, joining time), and cannot be brought back by a stranger, a replayed request,
or after a ban. The worker role does it by itself, backing off, without dying or spamming."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from swarmrl.config import load_config
from swarmrl.config.pool import PoolConfig
from swarmrl.errors import NodeBanned, NotFound, NotMember, PeerUnavailable, Unauthorized
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.ledger.export import read_entries
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import spotcheck
from swarmrl.pool.invites import make_invite
from swarmrl.pool.state import db
from swarmrl.pool.trust.audit import audit
from swarmrl.protocol.pool import (
    Heartbeat,
    InvalidateRequest,
    PoolSpec,
    RejoinRequest,
    SamplingParams,
    Submission,
)
from swarmrl.protocol.verdicts import Verdict
from swarmrl.rolekit.toolkit import StatusReporter, retry
from swarmrl.roles.worker.node import WorkerNode, WorkerSettings
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "rj"
WAIT_S = 60.0  # generous bound on every wait for the sweeper (loaded machines are slow)


def closed_spec(owner: KeyPair, validator: KeyPair) -> PoolSpec:
    return PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=100,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
        validated_fraction=0.1,
        check_rate_decay=0.5,
        max_tasks_per_lease=1,
        max_leases_in_flight=8,
    )


def advance(server, seconds: float) -> None:
    base = server.ctx.clock
    server.ctx.clock = lambda: base() + seconds


def wait_state(admin: PoolClient, node_id: str, want: str) -> None:
    end = time.monotonic() + WAIT_S
    while (state := {v.node_id: v.state for v in admin.nodes(POOL)}[node_id]) != want:
        assert time.monotonic() < end, f"node never became {want} (is {state})"
        time.sleep(0.05)


def eject(server, admin: PoolClient, node_id: str) -> None:
    """Let eject_after_s of silence pass on the orchestrator's clock; wait for the sweep."""
    advance(server, server.ctx.config.eject_after_s + 10)
    wait_state(admin, node_id, "ejected")


def record(server, node_id: str) -> dict:
    """Everything about a node a rejoin must leave as it was."""
    spec = closed_spec(KeyPair.generate(), KeyPair.generate())
    with server.ctx.engine.connect() as conn:
        row = conn.execute(sa.select(db.nodes).where(db.nodes.c.node_id == node_id)).one()
        credits = conn.execute(sa.select(db.credits).where(db.credits.c.node_id == node_id)).all()
        return {
            "counters": (row.accepted, row.soft, row.hard),
            "joined_at": row.joined_at,
            "lease_counter": row.lease_counter,
            "credits": sorted(tuple(c) for c in credits),
            "rate": spotcheck.node_rate(conn, spec, node_id),
        }


def rejoined(server) -> list[dict]:
    return [e for e in read_entries(server.ctx.engine) if e["kind"] == "node_rejoined"]


def test_an_ejected_node_rejoins_a_closed_pool_with_its_key_and_keeps_its_record(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(sweep_interval_s=0.05)) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        admin = PoolClient(server.url, owner)
        node.join(POOL, CPU_NODE, make_invite(owner, POOL, 600))
        work = node.lease(POOL).work  # the first unit is always checked (rate 1)
        node.submit(POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0)))
        [pending] = checker.claim(POOL)
        checker.verdict(
            POOL,
            Verdict(
                submission_id=pending.submission_id,
                accept=True,
                measured_tokens=sum(len(s.output_tokens) for s in pending.samples),
                behaviour_logprobs=[s.logprobs for s in pending.samples],
            ),
        )
        node.lease(POOL)  # in flight when the node goes silent: released for reassignment
        before = record(server, key.node_id)
        assert before["counters"] == (1, 0, 0) and before["rate"] == 0.5 and before["credits"]

        eject(server, admin, key.node_id)
        with pytest.raises(NotMember, match="ejected"):
            node.heartbeat(POOL, Heartbeat(status="ok"))
        with pytest.raises(NotMember):
            node.lease(POOL)
        view = node.rejoin(POOL, CPU_NODE)  # no invite
        assert view.state == "healthy" and view.leases_in_flight == 0

        assert record(server, key.node_id) == before  # nothing reset, nothing forgiven
        [entry] = rejoined(server)
        assert entry["node_id"] == key.node_id and entry["body"]["from_state"] == "ejected"
        assert node.heartbeat(POOL, Heartbeat(status="ok")).state == "healthy"
        assert node.lease(POOL).work is not None  # working again
        with server.ctx.engine.connect() as conn:  # the invite was spent once, by the join
            assert (
                conn.execute(sa.select(sa.func.count()).select_from(db.invites_used)).scalar() == 1
            )
        assert node.rejoin(POOL, CPU_NODE).state == "healthy"  # a member: its view, no entry
        assert len(rejoined(server)) == 1
        audit(server.ctx.engine, orch.public_key_hex)  # the tables agree with the ledger


def test_a_restarted_worker_joining_with_its_spent_invite_is_taken_back(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(sweep_interval_s=0.05)) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        node, admin = PoolClient(server.url, key), PoolClient(server.url, owner)
        invite = make_invite(owner, POOL, 600)
        node.join(POOL, CPU_NODE, invite)
        joined_at = admin.nodes(POOL)[0].joined_at
        eject(server, admin, key.node_id)
        view = node.join(POOL, CPU_NODE, invite)  # what a restarted worker sends
        assert view.state == "healthy" and view.joined_at == joined_at
        assert [e["body"]["from_state"] for e in rejoined(server)] == ["ejected"]
        stranger = PoolClient(server.url, KeyPair.generate())
        with pytest.raises(Unauthorized, match="invite"):  # the pool is still closed to others
            stranger.join(POOL, CPU_NODE)
        with pytest.raises(NotFound, match="join first"):  # a rejoin admits nobody new
            stranger.rejoin(POOL, CPU_NODE)
        assert len(admin.nodes(POOL)) == 1


def test_a_banned_node_can_neither_rejoin_nor_join(tmp_path):
    orch, owner, validator, key, other = (KeyPair.generate() for _ in range(5))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(sweep_interval_s=0.05)) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        admin = PoolClient(server.url, owner)
        node, ejected_then_banned = PoolClient(server.url, key), PoolClient(server.url, other)
        node.join(POOL, CPU_NODE, make_invite(owner, POOL, 600))
        ejected_then_banned.join(POOL, CPU_NODE, make_invite(owner, POOL, 600))
        admin.invalidate(POOL, key.node_id, InvalidateRequest(severity="hard", reason="cheat"))
        with pytest.raises(NodeBanned):
            node.rejoin(POOL, CPU_NODE)
        with pytest.raises(NodeBanned):
            node.join(POOL, CPU_NODE, make_invite(owner, POOL, 600))
        eject(server, admin, other.node_id)
        admin.invalidate(POOL, other.node_id, InvalidateRequest(severity="hard", reason="late"))
        with pytest.raises(NodeBanned):
            ejected_then_banned.rejoin(POOL, CPU_NODE)
        assert {v.state for v in admin.nodes(POOL)} == {"banned"}
        assert rejoined(server) == []


def test_a_rejoin_is_signed_by_the_node_and_cannot_be_replayed(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    cfg = PoolConfig(
        sweep_interval_s=0.05,
        unhealthy_after_s=0.2,
        dead_after_s=0.5,
        eject_after_s=1.0,
        request_window_s=3600.0,  # only the nonce, not the window, may refuse the replay
    )
    path = f"/pools/{POOL}/rejoin"
    body = RejoinRequest(metadata=CPU_NODE).model_dump_json().encode()
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        admin = PoolClient(server.url, owner)
        PoolClient(server.url, key).join(POOL, CPU_NODE, make_invite(owner, POOL, 600))
        wait_state(admin, key.node_id, "ejected")  # silent for eject_after_s of real time

        def send(headers: dict[str, str], content: bytes = body) -> httpx.Response:
            headers = headers | {"Content-Type": "application/json"}
            return httpx.post(server.url + path, content=content, headers=headers, timeout=30)

        captured = sign_request(key, "POST", path, body)
        forged = send(captured, body.replace(b"cpu", b"gpu"))  # another body under its signature
        assert forged.status_code == 401, forged.text
        first = send(captured)
        assert first.status_code == 200 and first.json()["state"] == "healthy", first.text
        wait_state(admin, key.node_id, "ejected")  # silent again
        replay = send(captured)
        assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_request"
        assert "already used" in replay.json()["error"]["message"]
        assert {v.state for v in admin.nodes(POOL)} == {"ejected"}  # the replay changed nothing
        assert len(rejoined(server)) == 1


def test_retry_backs_off_when_given_a_longest_pause():
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 5:
            raise PeerUnavailable("away")
        return "back"

    log = logging.getLogger("test.rejoin")
    assert retry(flaky, "come back", log, give_up_s=60, pause_s=0.05, max_pause_s=0.2) == "back"
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    # pauses of at least .05, .1, .2, .2 s (plus jitter); a fixed pause would be .05 each
    assert [g >= want for g, want in zip(gaps, [0.05, 0.1, 0.2, 0.2], strict=True)] == [True] * 4


def make_worker(url: str, key: KeyPair, invite, tmp_path: Path) -> WorkerNode:
    config = load_config([], ["pool.heartbeat_interval_s=0.2", "swarm.retry_s=0.1"])
    settings = WorkerSettings(url, POOL, ["http://127.0.0.1:9"], "ab" * 32, tmp_path, invite)
    status = StatusReporter("worker", "w0", tmp_path / "status", node_id=key.node_id)
    return WorkerNode(config, settings, key, status, logging.getLogger("test.worker"))


def test_a_worker_the_pool_does_not_know_joins_it_anew(tmp_path):
    """A pool whose database was replaced does not know the node: its rejoin becomes a join
    with the node's invite (unspent in that database), not a crash."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        worker = make_worker(server.url, key, make_invite(owner, POOL, 600), tmp_path)
        try:
            worker.membership.rejoin(NotMember("gone"))
            [view] = PoolClient(server.url, owner).nodes(POOL)
            assert view.node_id == key.node_id and view.state == "healthy"
            assert rejoined(server) == [] and worker.membership.rejoins == 0
        finally:
            worker.pool.close()
            worker.weights.close()


def test_an_ejected_worker_rejoins_by_itself_once(tmp_path):
    """The worker's heartbeat loop meets the ejection, rejoins without an invite (its own was
    spent), logs it once, and goes on beating; it neither stops nor asks again and again."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(sweep_interval_s=0.05)) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        admin = PoolClient(server.url, owner)
        worker = make_worker(server.url, key, make_invite(owner, POOL, 600), tmp_path)
        worker.membership.join()
        eject(server, admin, key.node_id)  # before its heartbeats start
        beats = threading.Thread(target=worker.membership.heartbeats, daemon=True)
        beats.start()
        try:
            wait_state(admin, key.node_id, "healthy")
            end = time.monotonic() + 2.0  # ten more beat intervals: still one rejoin
            while time.monotonic() < end:
                assert beats.is_alive() and not worker.stop.is_set()
                time.sleep(0.1)
            assert worker.membership.rejoins == 1 and len(rejoined(server)) == 1
            assert {v.state for v in admin.nodes(POOL)} == {"healthy"}
        finally:
            worker.stop.set()
            beats.join(timeout=WAIT_S)
            worker.pool.close()
            worker.weights.close()


def test_a_beat_cut_short_by_the_workers_own_stop_is_not_logged_as_failed(tmp_path, caplog):
    """A stopping worker closes its pool client while a beat may be in flight (the beat then
    fails with a closed socket): that is the stop, not a failed heartbeat, and the loop ends
    without a warning that would read as a lost orchestrator."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(closed_spec(owner, validator))
        worker = make_worker(server.url, key, make_invite(owner, POOL, 600), tmp_path)
        worker.membership.join()
        beats = []

        def closed_under_the_beat(pool_id, beat):
            beats.append(beat)
            worker.stop.set()  # the worker stops and closes its client while this beat is out
            raise PeerUnavailable("POST /pools/swarm/heartbeat: [Errno 9] Bad file descriptor")

        worker.pool.heartbeat = closed_under_the_beat
        try:
            with caplog.at_level(logging.WARNING, logger="test.worker"):
                beating = threading.Thread(target=worker.membership.heartbeats, daemon=True)
                beating.start()
                beating.join(timeout=WAIT_S)
            assert not beating.is_alive() and len(beats) == 1
            assert [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()] == []
        finally:
            worker.stop.set()
            worker.pool.close()
            worker.weights.close()
