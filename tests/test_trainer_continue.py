"""A restarted trainer picks up the version numbering where the orchestrator and the origin left
it, against a real orchestrator and a real origin: whatever it resumes from (a checkpoint, or the
warm start when there is none) is published under a version number nobody has seen, instead of
failing on "older than the current"; the versions it skipped do not make the orchestrator refuse
its last steps' work."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from swarmrl.config import SwarmConfig
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.trainer.announce import Announcer
from swarmrl.roles.trainer.origin import Origin
from swarmrl.roles.trainer.process import continue_versions
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator

POOL = "resume"


@pytest.fixture
def trainer_side(tmp_path):
    orch, trainer = KeyPair.generate(), KeyPair.generate()
    config = SwarmConfig()
    config.swarm.give_up_s = 5.0
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url="")) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=trainer.public_key_hex,
            task_count=50,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validated_fraction=0.0,
        )
        PoolClient(server.url, orch).create_pool(spec)
        origin = Origin(tmp_path / "origin", trainer, config, "127.0.0.1", 0)
        tokenizer = build_char_tokenizer("0123456789+=")
        learner = SimpleNamespace(  # the part of a Learner the announcer reads: a real model
            version=0,
            first_step=0,
            versions=None,
            policy=create_tiny_model(TinyModelConfig(num_layers=1), tokenizer),
            tokenizer=tokenizer,
        )
        with PoolClient(server.url, trainer) as pool:
            log = logging.getLogger("test-trainer")
            status = StatusReporter("trainer", "trainer", None)
            announce = Announcer(origin, pool, POOL, learner, tmp_path, config, log, status)
            try:
                source = SimpleNamespace(announced=0, version_offset=0)
                yield pool, origin, learner, announce, source, log, server
            finally:
                announce.close()
                origin.stop()


def test_a_version_told_but_never_published_is_skipped(trainer_side):
    pool, origin, learner, announce, source, log, _ = trainer_side
    announce(0)
    announce.wait()
    learner.version = 1
    announce(1)
    announce.wait()
    pool.set_version(POOL, 2)  # told v2, then killed before its weights went out
    learner.version, learner.first_step = 1, 1  # the checkpoint is v1's
    continue_versions(learner, origin, source, announce, log, resumed=True)
    assert learner.version == 3 and source.announced == 3
    assert announce.version_offset == source.version_offset == 2
    assert origin.publisher.latest() == 3  # the checkpoint's weights, which a worker can fetch
    assert pool.pool(POOL).current_version == 3


def test_versions_published_after_the_checkpoint_are_never_reused(trainer_side):
    pool, origin, learner, announce, source, log, _ = trainer_side
    for version in range(3):
        learner.version = version
        announce(version)
        announce.wait()
    learner.version, learner.first_step = 1, 1  # the checkpoint is v1's; v2 went out after it
    continue_versions(learner, origin, source, announce, log, resumed=True)
    # v2 names the weights of the step after the checkpoint, lost with the killed trainer: the
    # checkpoint's weights are not v2, they go out as v3
    assert learner.version == 3 and source.announced == 3
    assert origin.versions == [0, 1, 2, 3]  # each published once
    assert pool.pool(POOL).current_version == 3


def test_a_trainer_without_a_checkpoint_publishes_the_warm_start_anew(trainer_side):
    """checkpoint_every = 0 (the default): the restarted trainer starts from the warm start at
    step 0, whose weights go out as a new version past the ones the killed trainer published
    (announcing v0 again was refused: "version 0 is older than the current 2")."""
    pool, origin, learner, announce, source, log, _ = trainer_side
    for version in range(3):
        learner.version = version
        announce(version)
        announce.wait()
    learner.version, learner.first_step = 0, 0  # a fresh learner: the warm start
    continue_versions(learner, origin, source, announce, log, resumed=False)
    assert learner.version == 3 and announce.version_offset == source.version_offset == 3
    assert origin.versions == [0, 1, 2, 3]
    assert pool.pool(POOL).current_version == 3


def test_a_first_trainer_publishes_version_0_and_a_resumed_newest_goes_on(trainer_side):
    pool, origin, learner, announce, source, log, _ = trainer_side
    continue_versions(learner, origin, source, announce, log, resumed=False)
    assert learner.version == 0 and origin.versions == [0]
    learner.version, learner.first_step = 0, 0
    # the checkpoint is of the newest version, published and told: it goes on under its number
    continue_versions(learner, origin, source, announce, log, resumed=True)
    assert learner.version == 0 and origin.versions == [0]
    assert pool.pool(POOL).current_version == 0


def test_the_last_steps_still_get_work_after_a_resume_skipped_a_version(trainer_side):
    """Resumed with one version skipped, the trainer's versions run one ahead of its steps: the
    orchestrator, told the run's length in steps, took the last step's version for the run's end
    and refused every lease ("the run's last step has its rollouts") while that step still
    needed its batch, so the run stalled until the trainer gave up."""
    pool, origin, learner, announce, source, log, server = trainer_side
    announce.config.rl.steps = 3
    announce(0)
    announce.wait()
    learner.version = 1  # step 0 trained
    announce(1)
    announce.wait()
    pool.set_version(POOL, 2)  # step 1 trained and told as v2, killed before its weights went out
    learner.version, learner.first_step = 1, 1  # the checkpoint after step 0
    continue_versions(learner, origin, source, announce, log, resumed=True)
    assert learner.version == 3
    learner.version = 4  # step 1 trained again: the last step, 2, is next and needs rollouts
    announce(4)
    announce.wait()
    with PoolClient(server.url, KeyPair.generate()) as worker:
        worker.join(POOL, CPU_NODE)
        reply = worker.lease(POOL)
    assert reply.outcome == "work", reply.reason


def test_a_trainer_resumed_from_the_last_steps_checkpoint_tells_the_run_is_over(trainer_side):
    """The orchestrator hears that the run is over only after the last step's checkpoint is
    saved; a trainer killed in between resumes with no step left to commit, so it says so."""
    pool, origin, learner, announce, source, log, _ = trainer_side
    announce.config.rl.steps = 2
    for version in range(3):
        learner.version = version
        announce(version)
        announce.wait()
    assert not pool.pool(POOL).run_finished
    learner.version, learner.first_step = 2, 2  # the last step's checkpoint
    continue_versions(learner, origin, source, announce, log, resumed=True)
    assert learner.version == 2 and origin.versions == [0, 1, 2]
    assert pool.pool(POOL).run_finished


def test_a_step_does_not_wait_for_the_orchestrators_answer_and_versions_are_told_in_order(
    trainer_side,
):
    """The orchestrator is told each version from the announcer's own thread: a step goes on
    while the answer is on its way (across a far link that was one round trip a step), the
    versions arrive in order, and ``wait`` returns once they are told and out."""
    pool, origin, learner, announce, *_ = trainer_side
    announce(0)
    announce.wait()
    real, gate, told = announce.pool.set_version, threading.Event(), []

    def slow_orchestrator(pool_id, version, **plan):
        told.append(version)
        gate.wait(30)  # the answer is held until the test lets it go
        return real(pool_id, version, **plan)

    announce.pool.set_version = slow_orchestrator
    for version in (1, 2):
        learner.version = version
        announce(version)  # returns with v1's answer still held
    assert pool.pool(POOL).current_version == 0 and not gate.is_set()
    gate.set()
    announce.wait()
    assert told == [1, 2] and pool.pool(POOL).current_version == 2
    assert origin.versions == [0, 1, 2]
