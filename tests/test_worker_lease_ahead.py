"""A worker asks for its next unit while its submission is on the way (``swarm.lease_ahead``,
``swarmrl.roles.worker.leases``): one round trip a unit instead of two across a slow link. A
``wait`` answered ahead (the pool counted the unit still being submitted) is asked again after
the submission, without the pause; nothing is asked ahead when it is off, or when the next unit
would first wait for a newer version. A real orchestrator; generation is synthetic."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from swarmrl.config import load_config
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.worker import node as worker_node
from swarmrl.roles.worker.node import WorkerNode, WorkerSettings
from swarmrl.testing.pool_nodes import local_orchestrator, synthetic_samples
from test_worker_stale import POOL, spec


def _run(tmp_path, monkeypatch, cap: int, units: int, *settings: str) -> SimpleNamespace:
    """``units`` units worked by one worker (``settings``: config overrides); what it leased,
    from which thread, and what it generated. Each submission is held until a lease asked
    ahead of it has its answer, so the order is the same on any machine."""
    orch, owner, key = (KeyPair.generate() for _ in range(3))
    seen = SimpleNamespace(leases=[], generated=[], waits=0)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(
            spec(owner, async_level=2, max_leases_in_flight=cap)
        )
        config = load_config([], ["swarm.retry_s=0.1", "swarm.version_wait_s=0.1", *settings])
        where = WorkerSettings(server.url, POOL, ["http://127.0.0.1:9"], "ab" * 32, tmp_path)
        status = StatusReporter("worker", "w0", None, node_id=key.node_id)
        worker = WorkerNode(config, where, key, status, logging.getLogger("test.ahead"))
        lease, submit = worker.pool.lease, worker.pool.submit
        answered = threading.Event()

        def leasing(pool_id):
            reply = lease(pool_id)
            ahead = threading.current_thread() is not threading.main_thread()
            seen.leases.append((ahead, reply.outcome, reply.reason, reply.work))
            if ahead:
                answered.set()
            return reply

        def submitting(pool_id, submission):
            if worker.ahead.asking:
                assert answered.wait(10), "the lease asked ahead was not answered"
            seen.leases.append(("submitted", submission.lease_id))
            answered.clear()
            return submit(pool_id, submission)

        def generate(engine, env, tokenizer, work, policy_version, prove=None, saved=None):
            seen.generated.append(work.lease_id)
            return synthetic_samples(work, policy_version)

        monkeypatch.setattr(worker.pool, "lease", leasing)
        monkeypatch.setattr(worker.pool, "submit", submitting)
        monkeypatch.setattr(worker_node, "generate_samples", generate)
        worker.policy = SimpleNamespace(version=0, engine=None, tokenizer=None)
        try:
            worker.membership.join()
            for _ in range(units):
                worker._work_once()
        finally:
            worker.pool.close()
            worker.weights.close()
        seen.waits = status.metric("waits")
        seen.submitted = worker.submitted
    return seen


def _lease_ids(seen: SimpleNamespace, ahead: bool) -> list[str]:
    return [row[3].lease_id for row in seen.leases if row[0] is ahead and row[3] is not None]


def test_the_next_unit_is_leased_while_the_submission_is_on_its_way(tmp_path, monkeypatch):
    seen = _run(tmp_path, monkeypatch, 2, 3)
    assert seen.submitted == 3 and seen.waits == 0
    first, *later = seen.generated
    assert _lease_ids(seen, False) == [first]  # the only lease asked for on its own
    assert _lease_ids(seen, True)[:2] == later  # each later unit was leased ahead
    # ... before the submission it follows was sent: lease, submitted, lease, submitted, ...
    order = [row[0] for row in seen.leases]
    assert order[:6] == [False, True, "submitted", True, "submitted", True]


def test_a_wait_answered_ahead_is_asked_again_at_once_after_the_submission(tmp_path, monkeypatch):
    seen = _run(tmp_path, monkeypatch, 1, 2)  # the pool lets a node hold one lease
    assert seen.submitted == 2
    waits = [row for row in seen.leases if row[0] is True]
    assert waits and all(row[1] == "wait" and "leases in flight" in row[2] for row in waits)
    assert _lease_ids(seen, False) == seen.generated  # asked again on the work thread ...
    assert seen.waits == 0  # ... without pausing for the wait answered ahead


@pytest.mark.parametrize(
    "setting", ["swarm.lease_ahead=false", "swarm.units_per_version=1"], ids=["off", "paced"]
)
def test_no_lease_is_asked_ahead_when_off_or_when_the_next_unit_waits(
    tmp_path, monkeypatch, setting
):
    seen = _run(tmp_path, monkeypatch, 2, 2, setting)
    assert seen.submitted == 2
    assert not any(row[0] is True for row in seen.leases)
    assert _lease_ids(seen, False) == seen.generated
