"""Admission control as a pool on loopback serves it: the orchestrator leases only what the
trainer can train while fresh, tells a node to wait (typed, with a retry-after) otherwise, and
tells it the run is finished once the trainer says so. The rules on plain numbers are in
``test_pool_admission_rules``; admission where validators check a share of the units is in
``test_pool_admission_unchecked``."""

import time

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict, PeerError
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.batches import TrainerProgress
from swarmrl.protocol.pool import Heartbeat, LeaseReply, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "adm"


@pytest.fixture
def pool(db_url, tmp_path):
    yield from _pool(db_url, tmp_path)


def _spec(owner: KeyPair, **settings) -> PoolSpec:
    """An open pool of one-task units, unchecked work accepted as it arrives (``settings``
    override; ``async_level`` 1 unless given)."""
    return PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=50,
        open=True,
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=2),
        validated_fraction=0.0,
        min_tasks_per_lease=1,
        max_tasks_per_lease=1,
        max_leases_in_flight=64,
        **({"async_level": 1} | settings),
    )


def _pool(db_url, tmp_path, **spec_settings):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=db_url, admission_retry_s=0.25)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(_spec(owner, **spec_settings))
        worker = PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        yield PoolClient(server.url, owner), worker


def _lease_all(worker: PoolClient, most: int = 40) -> tuple[list, LeaseReply]:
    """Lease until told to wait; returns the units and the refusal."""
    units = []
    for _ in range(most):
        reply = worker.lease(POOL)
        if reply.work is None:
            return units, reply
        units.append(reply.work)
    raise AssertionError(f"still leasing after {most} units")


def _submit(worker: PoolClient, units: list, version: int = 0) -> None:
    for work in units:
        samples = synthetic_samples(work, version)
        worker.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))


def test_leases_stop_at_what_the_trainer_can_train_while_fresh(pool):
    trainer, worker = pool
    trainer.set_version(POOL, 0, steps=3, tasks_per_step=4)
    units, wait = _lease_all(worker)
    # version 0, async_level 1: steps 0 and 1 can train it, 4 tasks each
    assert len(units) == 8
    assert wait.outcome == "wait" and wait.retry_after_s == 0.25
    assert "admission" in wait.reason
    _submit(worker, units)
    assert worker.lease(POOL).outcome == "wait"  # accepted, untrained: still the supply
    batch = trainer.batch(POOL, step=0, limit=4)
    trainer.set_version(POOL, 1)
    trainer.ack_batch(POOL, [s.submission_id for s in batch.submissions])
    more, _ = _lease_all(worker)
    assert len(more) == 4  # step 0 consumed 4: steps 1 and 2 need 8, 4 are queued
    _submit(worker, more, version=1)
    trainer.batch(POOL, step=1, limit=4)
    trainer.set_version(POOL, 2)
    # the last step (2) can use 4 tasks, and 4 fresh ones (version 1) are queued for it
    last = worker.lease(POOL)
    assert last.outcome == "wait" and last.work is None


def test_a_trainer_waiting_for_work_gets_it_whatever_the_estimate(pool):
    trainer, worker = pool
    trainer.set_version(POOL, 0, steps=3, tasks_per_step=1)
    units, _ = _lease_all(worker)
    assert len(units) == 2  # 2 steps × 1 declared task
    _submit(worker, units)
    assert len(trainer.batch(POOL, step=0).submissions) == 2  # all of it filtered out, say
    assert worker.lease(POOL).outcome == "wait"  # the estimate: the trainer holds 2 steps
    trainer.batch(POOL, step=0)  # nothing more to serve: the trainer waits, nothing on its way
    assert worker.lease(POOL).outcome == "work"


def test_the_run_finished_reply_is_typed_and_final(pool):
    trainer, worker = pool
    trainer.set_version(POOL, 0, steps=1, tasks_per_step=1)
    assert worker.lease(POOL).outcome == "work"
    assert trainer.pool(POOL).run_finished is False
    assert worker.heartbeat(POOL, Heartbeat(status="ok")).run_finished is False
    trainer.set_version(POOL, 1, finished=True)
    reply = worker.lease(POOL)
    assert reply.outcome == "finished" and reply.work is None
    assert trainer.pool(POOL).run_finished is True
    # a node busy with something else (waiting for a version) learns it from its next beat
    assert worker.heartbeat(POOL, Heartbeat(status="ok")).run_finished is True
    assert trainer.set_version(POOL, 1) == 1  # a repeated announcement does not revive it
    assert worker.lease(POOL).outcome == "finished"


def test_a_pool_whose_trainer_never_told_its_plan_leases_as_before(pool):
    _, worker = pool
    assert all(worker.lease(POOL).outcome == "work" for _ in range(30))


def test_a_pool_whose_leases_may_lag_asks_for_the_version_before_and_takes_its_work(
    db_url, tmp_path
):
    for trainer, worker in _pool(db_url, tmp_path, async_level=2, lease_version_lag=1):
        trainer.set_version(POOL, 3)
        work = worker.lease(POOL).work
        assert work.min_version == 2  # V + 2 − a = 3, one version less
        worker.submit(POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 2)))
        [served] = trainer.batch(POOL, step=3).submissions
        assert served.samples[0].policy_version == 2


def test_the_trainer_is_served_what_goes_stale_first(pool):
    trainer, worker = pool
    older = worker.lease(POOL).work
    trainer.set_version(POOL, 1)
    newer = worker.lease(POOL).work
    _submit(worker, [newer], version=1)
    _submit(worker, [older], version=0)  # received later, but stale after step 1
    first = trainer.batch(POOL, step=1, limit=1).submissions[0]
    assert first.samples[0].policy_version == 0


def test_a_lease_asks_for_the_current_policy_when_a_lagging_one_could_only_waste_it(pool):
    trainer, worker = pool  # async_level 1
    trainer.set_version(POOL, 3)
    work = worker.lease(POOL).work
    assert work.min_version == 3
    stale = synthetic_samples(work, 2)  # steps 2 and 3 could train it: both have batches
    with pytest.raises(Conflict, match="stale .need ≥ 3: the lease's min_version"):
        worker.submit(POOL, Submission(lease_id=work.lease_id, samples=stale))
    assert trainer.batch(POOL, step=4).submissions == []  # a prefetch finds nothing: normal
    assert worker.lease(POOL).work.min_version == 3
    assert trainer.batch(POOL, step=3).submissions == []  # step 3 itself waits for work
    assert worker.lease(POOL).work.min_version == 2


def test_groups_the_trainer_filtered_out_count_as_consumed_supply(pool):
    """T counts the groups a step filters out, so the supply does too: otherwise every step
    whose batch is taken looks short by them and the difference is leased again, to arrive
    after the steps that could train it have their batches."""
    trainer, worker = pool
    trainer.set_version(POOL, 0, steps=4, tasks_per_step=2)
    units, _ = _lease_all(worker)
    assert len(units) == 4  # version 0, async_level 1: steps 0 and 1, 2 declared tasks each
    _submit(worker, units)
    served = [s.submission_id for s in trainer.batch(POOL, step=0, limit=4).submissions]
    trainer.ack_batch(POOL, served[2:])  # filtered out: used up at once
    trainer.set_version(POOL, 1)
    trainer.ack_batch(POOL, served[:2])  # step 0 trained on the other two
    # measured: step 0 consumed 4 tasks; at version 1 steps 1 and 2 can train new work (8)
    units, _ = _lease_all(worker)
    assert len(units) == 8
    _submit(worker, units, version=1)
    served = [s.submission_id for s in trainer.batch(POOL, step=1, limit=8).submissions]
    assert len(served) == 8  # step 1's groups and step 2's, carried over
    trainer.ack_batch(POOL, served[:2])  # step 1 filtered two out at once
    # 8 tasks served for steps 1 and 2 cover both steps' 2 × 4: nothing more is leased
    refusal = worker.lease(POOL)
    assert refusal.outcome == "wait", "leased again what the filter used up"
    assert "enough" in refusal.reason


def test_a_node_that_asks_the_moment_it_submits_does_not_take_every_opening(pool):
    """Room for more work opens when the trainer takes a step. A node asking on the retry it was
    told, before the node that just submitted asks, is served first: first come, first served."""
    trainer, fast = pool
    slow = PoolClient(fast.url, KeyPair.generate())
    slow.join(POOL, CPU_NODE)
    trainer.set_version(POOL, 0, steps=20, tasks_per_step=1)
    units = [fast.lease(POOL).work for _ in range(2)]  # async_level 1: two steps of one task
    assert None not in units  # fast now generates: it asks again once it submits
    refused = slow.lease(POOL)  # the demand is covered: slow waits from now on
    assert refused.outcome == "wait" and "enough" in refused.reason
    _submit(fast, units)
    served = trainer.batch(POOL, step=0, limit=1).submissions
    trainer.set_version(POOL, 1)
    trainer.ack_batch(POOL, [s.submission_id for s in served])  # room for one task opens
    first = fast.lease(POOL)  # asks the moment it can, but slow has waited longer
    assert first.outcome == "wait" and "waiting longer" in first.reason
    assert slow.lease(POOL).outcome == "work"
    assert fast.lease(POOL).outcome == "wait"  # the room is taken
    served = trainer.batch(POOL, step=1, limit=1).submissions
    trainer.set_version(POOL, 2)
    trainer.ack_batch(POOL, [s.submission_id for s in served])
    assert fast.lease(POOL).outcome == "work"  # slow was served last: fast's turn


def test_a_lease_nobody_submits_holds_a_starving_trainer_only_until_it_is_overdue(db_url, tmp_path):
    """A node that took a unit and stalls must not hold the run until its lease times out. Time
    is the orchestrator's clock, moved here: on a loaded machine the real one could pass the
    overdue mark between the grant and the first "wait" this test expects."""
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=db_url, admission_retry_s=0.25)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]  # signatures keep the real clock
        spec = _spec(owner, lease_target_s=0.5, lease_timeout_s=600)  # overdue after 2 × 0.5 s
        PoolClient(server.url, orch).create_pool(spec)
        trainer, worker = PoolClient(server.url, owner), PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        trainer.set_version(POOL, 0, steps=3, tasks_per_step=1)
        stalled, _ = _lease_all(worker)  # leased, never submitted
        assert len(stalled) == 2
        assert trainer.batch(POOL, step=0).submissions == []  # the trainer starves
        assert worker.lease(POOL).outcome == "wait"  # the leased work is on its way
        deadline = now[0] + 30
        while now[0] < deadline:
            assert trainer.batch(POOL, step=0).submissions == []
            reply = worker.lease(POOL)
            if reply.outcome == "work":
                break
            now[0] += 0.2
        assert reply.outcome == "work", reply.reason
        assert now[0] - deadline + 30 >= 1.0  # not before the leases were overdue (2 × 0.5 s)


def test_a_lease_counts_the_backlog_only_when_the_decision_needs_it(tmp_path):
    """Counting the supply reads every fresh submission of the pool (tens of thousands in a
    large pool): a lease whose answer does not depend on it (the trainer's pace unknown, the
    run's last step taken) must not pay for it."""
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig()) as server:
        spec = PoolSpec(pool_id=POOL, owner_key=owner.public_key_hex, task_count=50, open=True,
                        sampling=SamplingParams(max_new_tokens=2), validated_fraction=0.0)  # fmt: skip
        PoolClient(server.url, orch).create_pool(spec)
        worker, trainer = PoolClient(server.url, node), PoolClient(server.url, owner)
        worker.join(POOL, CPU_NODE)
        seen: list[str] = []

        def record(conn, cursor, statement, *_) -> None:  # type: ignore[no-untyped-def]
            seen.append(statement.lower())

        sa.event.listen(server.ctx.engine, "before_cursor_execute", record)
        _submit(worker, [worker.lease(POOL).work])
        assert worker.lease(POOL).outcome == "work"  # pace unknown: granted as asked
        counted = [s for s in seen if "sum(submissions.n_samples)" in s and "group by" in s]
        assert counted == []
        trainer.set_version(POOL, 0, steps=10, tasks_per_step=4)
        assert worker.lease(POOL).outcome in ("work", "wait")
        assert any("sum(submissions.n_samples)" in s and "group by" in s for s in seen)


def test_no_work_is_leased_that_only_steps_with_a_held_batch_could_train(pool):
    """A trainer whose carried-over groups fill the batches of steps beyond the one it gathers
    for says so; work generated with a version only those steps could train is not leased."""
    trainer, worker = pool  # async_level 1
    trainer.set_version(POOL, 2, steps=10, tasks_per_step=4)
    assert worker.lease(POOL).work.min_version == 2  # told nothing: as before
    trainer.set_progress(POOL, 2)  # step 3, the first short, trains versions ≥ 2: as before
    assert worker.lease(POOL).work.min_version == 2
    assert trainer.set_progress(POOL, 3) == 3  # step 4 is the first short: versions ≥ 3
    wait = worker.lease(POOL)
    assert wait.outcome == "wait" and wait.retry_after_s == 0.25
    assert "holds the batches of steps up to 3" in wait.reason and "≥ 3" in wait.reason
    trainer.set_version(POOL, 3)
    assert worker.lease(POOL).work.min_version == 3
    trainer.set_progress(POOL, 5)
    trainer.set_version(POOL, 4)
    assert worker.lease(POOL).outcome == "wait"
    trainer.set_version(POOL, 5)
    assert worker.lease(POOL).work.min_version == 5
    # a trainer started again that holds less says so, and its word replaces the old one
    trainer.set_progress(POOL, 9)
    assert worker.lease(POOL).outcome == "wait"
    trainer.set_progress(POOL, 4)
    assert worker.lease(POOL).work.min_version == 5


def test_a_starving_trainer_is_served_whatever_it_said_it_held(pool):
    trainer, worker = pool  # async_level 1
    trainer.set_version(POOL, 1, steps=10, tasks_per_step=4)
    trainer.set_progress(POOL, 6)  # e.g. told by a trainer process that has since died
    assert worker.lease(POOL).outcome == "wait"
    assert trainer.batch(POOL, step=1).submissions == []  # step 1 waits for work: starving
    assert worker.lease(POOL).work.min_version == 0  # any version step 1 can train


def test_a_trainer_served_since_its_empty_request_no_longer_starves(pool):
    """Starving means the trainer's *last* request came back empty: once a later one is
    served, leases go back to the versions the steps still gathering can train (a fast
    worker, leasing as that step's batch completed, made work only that step could use)."""
    trainer, worker = pool  # async_level 1
    trainer.set_version(POOL, 2, steps=10, tasks_per_step=100)
    assert worker.lease(POOL).work.min_version == 2  # not starving: the current version
    assert trainer.batch(POOL, step=2).submissions == []  # step 2 waits for work
    unit = worker.lease(POOL).work
    assert unit.min_version == 1  # any version step 2 can train
    _submit(worker, [unit], version=2)
    assert len(trainer.batch(POOL, step=2).submissions) == 1  # served: it waits no more
    assert worker.lease(POOL).work.min_version == 2
    assert trainer.batch(POOL, step=3).submissions == []  # an empty prefetch: not step 2's
    assert worker.lease(POOL).work.min_version == 2


def test_the_trainers_progress_is_its_own_to_tell(pool, tmp_path):
    _, worker = pool
    with pytest.raises(PeerError):
        worker.set_progress(POOL, 3)  # a node is not the pool's owner
    with pytest.raises(ValueError):
        TrainerProgress(batched_through=-1)


def test_a_node_not_at_its_turn_for_a_starving_grant_gets_what_the_ordinary_rules_allow(
    db_url, tmp_path
):
    """The grant a starving trainer forces goes by turns, but it only adds to the ordinary
    rules: a node whose turn it is not, asking while the demand leaves room, is served as it
    would be were the trainer fed, not told to wait for the other node (which, across a slow
    link, held each node back a retry and a round trip at every other unit)."""
    orch, owner, a_key, b_key = (KeyPair.generate() for _ in range(4))
    cfg = PoolConfig(db_url=db_url, admission_retry_s=0.25)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]  # one instant: the trainer starves throughout
        PoolClient(server.url, orch).create_pool(_spec(owner))
        trainer = PoolClient(server.url, owner)
        a, b = PoolClient(server.url, a_key), PoolClient(server.url, b_key)
        for node in (a, b):
            node.join(POOL, CPU_NODE)
        trainer.set_version(POOL, 0, steps=10, tasks_per_step=100)  # room for far more
        assert trainer.batch(POOL, step=0).submissions == []  # the trainer starves
        first_a = a.lease(POOL).work  # nothing leased or pending: the forced grant, a's turn
        first_b = b.lease(POOL).work  # a's lease is on its way: b by the ordinary rules
        assert first_a is not None and first_b is not None
        _submit(a, [first_a])
        _submit(b, [first_b])
        # nothing leased or pending again: the forced grant's turn is b's (never given one),
        # and a, asking first, still has the room the demand leaves
        again = a.lease(POOL)
        assert again.work is not None, again.reason
        assert b.lease(POOL).work is not None


def test_a_pack_of_fresh_identities_cannot_take_every_grant_a_starving_trainer_forces(
    db_url, tmp_path
):
    """While the trainer starves and every lease is overdue, the pool grants one unit at a time;
    a pack of fresh identities asking just before the established honest node each time must
    not take them all: the honest node, with accepted work behind it, is served within its
    budget. Time is the orchestrator's clock, moved here round by round: on a loaded machine a
    round of six requests can take longer than the window a node stays waiting in, and the honest
    node would seem gone to the pool."""
    orch, owner, validator, honest = (KeyPair.generate() for _ in range(4))
    cfg = PoolConfig(db_url=db_url, admission_retry_s=0.25)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]  # signatures keep the real clock
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            open=True,
            samples_per_task=2,
            sampling=SamplingParams(max_new_tokens=2),
            async_level=1,
            validators=[validator.public_key_hex],
            min_tasks_per_lease=1,
            max_tasks_per_lease=1,
            max_leases_in_flight=64,
            lease_target_s=0.5,  # a granted lease closes the gate until overdue, 2 × 0.5 s
            lease_timeout_s=600,
        )
        PoolClient(server.url, orch).create_pool(spec)
        trainer, checker = PoolClient(server.url, owner), PoolClient(server.url, validator)
        node = PoolClient(server.url, honest)
        node.join(POOL, CPU_NODE)
        trainer.set_version(POOL, 0, steps=40, tasks_per_step=1)
        work = node.lease(POOL).work
        _submit(node, [work])
        (pending,) = checker.claim(POOL)
        logprobs = [s.logprobs for s in pending.samples]
        checker.verdict(
            POOL,
            Verdict(submission_id=pending.submission_id, accept=True, measured_tokens=4,
                    behaviour_logprobs=logprobs),
        )  # fmt: skip
        # the honest unit is now stale, and one leased task covers the last step's demand: the
        # trainer starves, and only its override grants units
        trainer.set_version(POOL, 5, steps=6, tasks_per_step=1)
        pack = [PoolClient(server.url, KeyPair.generate()) for _ in range(4)]
        for member in pack:
            member.join(POOL, CPU_NODE)
        grants: list[str] = []
        served_at = None
        started = now[0]
        while now[0] - started < 10.0:  # the honest node's budget
            assert trainer.batch(POOL, step=5).submissions == []  # the trainer starves
            for member in pack:  # the pack asks just before the honest node, every time
                if member.lease(POOL).outcome == "work":
                    grants.append(f"pack {now[0] - started:.2f}")
            if node.lease(POOL).outcome == "work":
                served_at = now[0] - started
                break
            now[0] += 0.2
        assert served_at is not None, f"the honest node waited its whole budget; grants {grants}"
        assert len(grants) <= 1, grants  # at most the grant made before it had asked
