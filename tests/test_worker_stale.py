"""A unit that went stale while it was generated is generated again on the newer policy and
submitted to the same lease: the pool answers ``stale_work`` (nothing stored, the lease still
the node's), and the worker does not sit out the lease's deadline with its one lease slot
taken (at ``async_level`` 0 that had stalled a run ~1 min per stale unit)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from swarmrl.config import load_config
from swarmrl.errors import StaleWork, WaitTimeout
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.worker import node as worker_node
from swarmrl.roles.worker.node import WorkerNode, WorkerSettings
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "st"


def spec(owner: KeyPair, **settings: object) -> PoolSpec:
    """The pool of these tests (``settings``: keys to change)."""
    defaults: dict[str, object] = {
        "pool_id": POOL,
        "owner_key": owner.public_key_hex,
        "task_count": 40,
        "open": True,
        "sampling": SamplingParams(max_new_tokens=2),
        "validated_fraction": 0.0,
        "async_level": 0,
        "max_leases_in_flight": 1,
        "lease_timeout_s": 120.0,
    }
    return PoolSpec(**(defaults | settings))


def test_a_stale_submission_is_refused_as_stale_work_and_the_lease_stays_open(tmp_path):
    orch, owner, key = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec(owner))
        node = PoolClient(server.url, key)
        node.join(POOL, CPU_NODE)
        work = node.lease(POOL).work
        PoolClient(server.url, owner).set_version(POOL, 1)  # the trainer moved on
        stale = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
        with pytest.raises(StaleWork, match="stale"):
            node.submit(POOL, stale)
        assert node.lease(POOL).work is None  # the one lease slot is still this unit's
        again = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 1))
        node.submit(POOL, again)
        with server.ctx.engine.connect() as conn:
            rows = conn.execute(sa.select(db.submissions.c.min_version)).all()
        assert [r.min_version for r in rows] == [1]  # the stale one stored nothing


def test_the_worker_generates_a_stale_unit_again_on_the_newer_policy(tmp_path, monkeypatch):
    orch, owner, key = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec(owner))
        trainer = PoolClient(server.url, owner)
        config = load_config([], ["swarm.retry_s=0.1", "swarm.units_per_version=0"])
        settings = WorkerSettings(server.url, POOL, ["http://127.0.0.1:9"], "ab" * 32, tmp_path)
        status = StatusReporter("worker", "w0", None, node_id=key.node_id)
        worker = WorkerNode(config, settings, key, status, logging.getLogger("test.stale"))
        generated: list[int] = []

        def generate(engine, env, tokenizer, work, policy_version, prove=None, saved=None):
            generated.append(policy_version)
            if len(generated) == 1:  # the trainer publishes v1 while v0's unit is generated
                trainer.set_version(POOL, 1)
                threading.Timer(0.2, lambda: ready(1)).start()  # downloaded a moment later
            return synthetic_samples(work, policy_version)

        def ready(version):
            worker.versions.offer(version, tmp_path / f"v{version}")

        def swap(loaded, path, version):
            loaded.version = version
            return loaded

        monkeypatch.setattr(worker_node, "generate_samples", generate)
        monkeypatch.setattr(worker_node, "swap_version", swap)
        worker.policy = SimpleNamespace(version=0, engine=None, tokenizer=None)
        try:
            worker.membership.join()
            started = time.monotonic()
            worker._work_once()
            took = time.monotonic() - started
        finally:
            worker.pool.close()
            worker.weights.close()
        assert generated == [0, 1]  # the same unit again, on the newer policy
        assert worker.submitted == 1 and worker.units_by_version == {1: 1}
        assert status.metric("stale") == 1
        assert took < 60  # not the lease's 120 s deadline
        with server.ctx.engine.connect() as conn:
            rows = conn.execute(sa.select(db.submissions.c.min_version)).all()
        assert [r.min_version for r in rows] == [1]


@contextmanager
def beating_worker(tmp_path, monkeypatch, generate, **spec_settings):
    """An orchestrator on loopback and a worker of a fresh pool there, holding v0, its
    heartbeat thread beating every half second; ``generate(trainer, worker, work, version)``
    makes its samples (``trainer``: the pool owner's client). Yields the server and the worker;
    both closed on exit."""
    orch, owner, key = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec(owner, **spec_settings))
        trainer = PoolClient(server.url, owner)
        config = load_config(
            [], ["swarm.retry_s=0.1", "swarm.units_per_version=0", "pool.heartbeat_interval_s=1"]
        )
        settings = WorkerSettings(server.url, POOL, ["http://127.0.0.1:9"], "ab" * 32, tmp_path)
        status = StatusReporter("worker", "w0", None, node_id=key.node_id)
        worker = WorkerNode(config, settings, key, status, logging.getLogger("test.finished"))
        monkeypatch.setattr(
            worker_node,
            "generate_samples",
            lambda engine, env, tokenizer, work, version, *_: generate(
                trainer, worker, work, version
            ),
        )
        worker.policy = SimpleNamespace(version=0, engine=None, tokenizer=None)
        beats = threading.Thread(target=worker.membership.heartbeats, daemon=True)
        try:
            worker.membership.join()
            beats.start()
            yield server, worker
        finally:
            worker.stop.set()
            beats.join(5)
            worker.pool.close()
            worker.weights.close()


def test_a_worker_waiting_for_a_version_that_never_comes_stops_when_the_run_finishes(
    tmp_path, monkeypatch
):
    # the trainer publishes its last version and finishes while the unit is generated, then
    # leaves with its weight server: the stale unit's newer version never downloads, and the
    # heartbeat's reply, not the lease's 120 s deadline, ends the wait
    def generate(trainer, worker, work, version):
        trainer.set_version(POOL, 1, finished=True)
        return synthetic_samples(work, version)

    with beating_worker(tmp_path, monkeypatch, generate) as (_, worker):
        started = time.monotonic()
        with pytest.raises(WaitTimeout):  # the wait ends because the node stops
            worker._work_once()
        took = time.monotonic() - started
    assert worker.finished.is_set() and not worker.banned.is_set()
    assert worker.status.metric("stale") == 1
    assert took < 30  # within a few beats, not the lease's 120 s deadline


def test_a_unit_in_hand_when_a_heartbeat_says_the_run_is_finished_is_still_handed_in(
    tmp_path, monkeypatch
):
    # the beat ends waits, not a submission: the unit generated in good faith is submitted
    # (and credited), and the node then stops without leasing again
    def generate(trainer, worker, work, version):
        trainer.set_version(POOL, 1, finished=True)  # v0 is still fresh at async_level 1
        assert worker.finished.wait(15), "no heartbeat said the run is finished"
        return synthetic_samples(work, version)

    with beating_worker(tmp_path, monkeypatch, generate, async_level=1) as (server, worker):
        worker._work_once()
        assert worker.submitted == 1 and not worker.stop.is_set()
        worker._work_once()  # the next unit is never leased: the node stops
        assert worker.stop.is_set()
        with server.ctx.engine.connect() as conn:
            count = sa.select(sa.func.count())
            assert conn.execute(count.select_from(db.submissions)).scalar() == 1
            assert conn.execute(count.select_from(db.leases)).scalar() == 1
