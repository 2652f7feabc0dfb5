"""Admission control where validators check a share of the units: unchecked work trains only
after a later passed check of its node, so a node whose unchecked work waits is leased the unit
that can release it, while a step is left to train them both, and a node never checked is not.
The pool on loopback as nodes reach it; the rest of admission is in ``test_pool_admission``."""

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "adm"


def _spot_checked_pool(db_url, tmp_path, floor: float):
    """A pool whose one validator checks a node's first unit, then a share ``floor`` of them."""
    orch, owner, node_key, checker_key = (KeyPair.generate() for _ in range(4))
    server = local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url))
    url = server.__enter__().url
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=500,
        open=True,
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=2),
        async_level=1,
        validators=[checker_key.public_key_hex],
        validated_fraction=floor,
        check_rate_decay=0.0,
        min_tasks_per_lease=1,
        max_tasks_per_lease=1,
    )
    PoolClient(url, orch).create_pool(spec)
    trainer, worker = PoolClient(url, owner), PoolClient(url, node_key)
    worker.join(POOL, CPU_NODE)
    return server, trainer, worker, PoolClient(url, checker_key)


def _submit_and_judge(worker: PoolClient, checker: PoolClient) -> bool:
    """Lease, submit, and pass whatever the validator is given; True when it was checked."""
    work = worker.lease(POOL).work
    assert work is not None
    worker.submit(POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0)))
    pending = checker.claim(POOL, limit=8)
    for p in pending:
        samples = synthetic_samples(p.work, 0)
        checker.verdict(POOL, Verdict(
            submission_id=p.submission_id, accept=True, measured_tokens=4,
            behaviour_logprobs=[s.logprobs for s in samples],
        ))  # fmt: skip
    return bool(pending)


def test_a_node_whose_unchecked_work_waits_gets_the_unit_that_can_release_it(db_url, tmp_path):
    """Unchecked work trains only after a later passed check of its node; a node refused work
    because that very work counts as supply would leave it to go stale."""
    server, trainer, worker, checker = _spot_checked_pool(db_url, tmp_path, floor=0.5)
    try:
        _train_all_but_two_unchecked(trainer, worker, checker, steps=5)
        # the trainer now says it takes 1 task per step: steps 0 and 1 need 2, and the
        # supply (what step 0 used + the 2 unchecked) covers that; the unchecked work still
        # needs this node's next checked unit, so it gets the smallest one (1 ≤ 0.5 · 2)
        trainer.set_version(POOL, 0, steps=5, tasks_per_step=1)
        reply = worker.lease(POOL)
        assert reply.outcome == "work", reply.reason
        assert len(reply.work.task_indices) == 1
        assert worker.lease(POOL).outcome == "wait"  # one such unit at a time
    finally:
        server.__exit__(None, None, None)


def _train_all_but_two_unchecked(trainer, worker, checker, steps: int) -> None:
    """A run of ``steps`` steps at version 0 whose step 0 trained all the node's work but its
    last two units, which went unchecked (each waits for a later passed check)."""
    trainer.set_version(POOL, 0, steps=steps, tasks_per_step=100)
    assert _submit_and_judge(worker, checker)  # a new node's first unit is checked
    unchecked_in_a_row = 0
    for _ in range(60):  # until two units in a row went unchecked (1 in 4 per pair)
        unchecked_in_a_row = 0 if _submit_and_judge(worker, checker) else unchecked_in_a_row + 1
        if unchecked_in_a_row == 2:
            break
    assert unchecked_in_a_row == 2
    served = trainer.batch(POOL, step=0, limit=256).submissions  # all but the unchecked
    trainer.ack_batch(POOL, [s.submission_id for s in served])


def test_nothing_is_leased_once_the_trainer_holds_the_last_steps_batch(db_url, tmp_path):
    """Not even the unit that could release a node's unchecked work: no step is left to train
    it (nor the work it would release)."""
    server, trainer, worker, checker = _spot_checked_pool(db_url, tmp_path, floor=0.5)
    try:
        _train_all_but_two_unchecked(trainer, worker, checker, steps=2)
        trainer.set_version(POOL, 1, tasks_per_step=1)  # step 1, the last, trains versions ≥ 0
        trainer.set_progress(POOL, 1)  # ... and its batch is held
        reply = worker.lease(POOL)
        assert reply.outcome == "wait"
        assert "holds the batch of the run's last step (1)" in reply.reason
        trainer.set_progress(POOL, 0)  # a trainer started again holds less: its word counts
        assert worker.lease(POOL).outcome == "work"  # the unit that releases the unchecked
    finally:
        server.__exit__(None, None, None)


def test_a_node_that_is_never_checked_gets_no_unit_to_release_its_work(db_url, tmp_path):
    server, trainer, worker, checker = _spot_checked_pool(db_url, tmp_path, floor=0.0)
    try:
        trainer.set_version(POOL, 0, steps=5, tasks_per_step=100)
        assert _submit_and_judge(worker, checker)  # a new node's first unit is checked
        assert not _submit_and_judge(worker, checker)  # then its rate is 0
        assert not _submit_and_judge(worker, checker)
        served = trainer.batch(POOL, step=0, limit=256).submissions
        trainer.ack_batch(POOL, [s.submission_id for s in served])
        trainer.set_version(POOL, 0, steps=5, tasks_per_step=1)
        reply = worker.lease(POOL)
        assert reply.outcome == "wait" and "enough" in reply.reason
    finally:
        server.__exit__(None, None, None)
