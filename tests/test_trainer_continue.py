"""A resumed trainer picks up the version numbering where the orchestrator and the origin left it,
against a real orchestrator and a real origin: a trainer killed after telling the orchestrator a
version but before its weights went out resumes instead of failing on "older than the current",
and the versions it skipped do not make the orchestrator refuse its last steps' work."""

from __future__ import annotations

import logging
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
from swarmrl.roles.trainer.process import Origin, continue_versions
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
                yield pool, origin, learner, announce, SimpleNamespace(announced=0), log, server
            finally:
                announce.close()
                origin.stop()


def test_a_version_told_but_never_published_is_published_from_the_checkpoint(trainer_side):
    pool, origin, learner, announce, source, log, _ = trainer_side
    announce(0)
    announce.wait()
    learner.version = 1
    announce(1)
    announce.wait()
    pool.set_version(POOL, 2)  # told v2, then killed before its weights went out
    learner.version = 1  # the checkpoint is v1's
    continue_versions(learner, origin, source, announce, log)
    assert learner.version == 2 and source.announced == 2
    assert origin.publisher.latest() == 2  # a worker told v2 can fetch it
    assert pool.pool(POOL).current_version == 2


def test_versions_published_after_the_checkpoint_are_skipped(trainer_side):
    pool, origin, learner, announce, source, log, _ = trainer_side
    for version in range(3):
        learner.version = version
        announce(version)
        announce.wait()
    learner.version = 1  # the checkpoint is v1's; v2 went out after it
    continue_versions(learner, origin, source, announce, log)
    assert learner.version == 2 and source.announced == 2
    assert origin.versions == [0, 1, 2]  # nothing published twice
    assert pool.pool(POOL).current_version == 2


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
    continue_versions(learner, origin, source, announce, log)
    assert learner.version == 2
    learner.version = 3  # step 1 trained again: the last step, 2, is next and needs rollouts
    announce(3)
    announce.wait()
    with PoolClient(server.url, KeyPair.generate()) as worker:
        worker.join(POOL, CPU_NODE)
        reply = worker.lease(POOL)
    assert reply.outcome == "work", reply.reason
