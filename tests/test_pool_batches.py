"""Trainer batches are leases acknowledged after the step commits, on SQLite and PostgreSQL:
a trainer that dies (or a reply that is lost) loses no unit, and no unit is trained twice."""

import pytest

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import NotFound
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "bt"
LEASE_S = 60.0


@pytest.fixture
def pool(db_url, tmp_path):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=db_url, batch_lease_s=LEASE_S)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validated_fraction=0.0,
            max_leases_in_flight=64,
        )
        PoolClient(server.url, orch).create_pool(spec)
        worker = PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        ids = []
        for _ in range(4):
            work = worker.lease(POOL).work
            sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            ids.append(worker.submit(POOL, sub).submission_id)
        yield server, PoolClient(server.url, owner), ids


def advance(server, seconds):
    """Move the orchestrator's pool clock ``seconds`` ahead (signatures keep the real clock)."""
    base = server.ctx.clock
    server.ctx.clock = lambda: base() + seconds


def served(reply):
    return sorted(s.submission_id for s in reply.submissions)


def test_units_of_a_trainer_that_dies_before_acknowledging_come_back(pool):
    server, trainer, ids = pool
    first = trainer.batch(POOL, step=0, limit=3, holder="a" * 32)  # then the trainer dies
    assert len(first.submissions) == 3
    restarted = "b" * 32
    assert served(trainer.batch(POOL, step=0, holder=restarted)) == sorted(
        set(ids) - set(served(first))
    )
    advance(server, LEASE_S + 1)
    again = trainer.batch(POOL, step=0, holder=restarted)
    assert served(again) == served(first)  # the dead trainer's units, none lost
    receipt = trainer.ack_batch(POOL, ids)
    assert receipt.acknowledged == 4 and receipt.already == 0
    advance(server, 3 * LEASE_S)
    assert trainer.batch(POOL, step=0, holder=restarted).submissions == []  # none trained twice
    assert trainer.metrics(POOL).submissions_by_status == {"trained": 4}


def test_acknowledged_units_are_never_served_again_and_acks_are_checked(pool):
    server, trainer, ids = pool
    got = served(trainer.batch(POOL, step=0))
    assert got == sorted(ids)
    assert trainer.ack_batch(POOL, got[:2]).acknowledged == 2
    assert trainer.ack_batch(POOL, got[:2]).already == 2  # a repeated ack is harmless
    advance(server, LEASE_S + 1)
    # a trainer restarted under another holder id gets only the unacknowledged units back
    assert served(trainer.batch(POOL, step=0, holder="e" * 32)) == got[2:]
    with pytest.raises(NotFound):
        trainer.ack_batch(POOL, ["f" * 32])


def test_a_live_trainer_keeps_what_it_carries(pool):
    server, trainer, ids = pool
    holder = "c" * 32
    got = served(trainer.batch(POOL, step=0, limit=2, holder=holder))
    advance(server, 0.75 * LEASE_S)
    trainer.batch(POOL, step=1, limit=1, holder=holder)  # asking again renews the others
    advance(server, 0.5 * LEASE_S)  # the first lease ran out, the renewed one has not
    rest = served(trainer.batch(POOL, step=1, holder="d" * 32))
    assert not set(got) & set(rest)  # still leased to the live trainer


def test_a_batch_stops_once_its_tasks_reach_what_was_asked(pool):
    """``max_tasks`` bounds an answer in tasks (at least one submission is served); the rest
    stays queued for the next request, oldest first."""
    server, trainer, ids = pool
    first = trainer.batch(POOL, step=0, max_tasks=1)
    assert len(first.submissions) == 1
    rest = trainer.batch(POOL, step=0, max_tasks=10_000)
    assert sorted(served(first) + served(rest)) == sorted(ids)
    advance(server, LEASE_S + 1)  # that trainer is gone: all four queued again
    sizes = {s.submission_id: len(s.task_indices) for s in first.submissions + rest.submissions}
    oldest = [s.submission_id for s in first.submissions + rest.submissions]
    again = trainer.batch(POOL, step=0, max_tasks=sizes[oldest[0]] + 1, holder="c" * 32)
    assert [s.submission_id for s in again.submissions] == oldest[:2]
