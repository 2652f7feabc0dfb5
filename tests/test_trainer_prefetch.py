"""The swarm trainer does not wait when work exists: while a step trains, the pool source leases
the next step's rollouts (a real orchestrator on loopback, a real validator key, the arith
environment's tasks)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.config.pool import PoolConfig
from swarmrl.envs import build_env
from swarmrl.errors import PeerError
from swarmrl.identity import KeyPair
from swarmrl.model import build_char_tokenizer
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import progress
from swarmrl.protocol.pool import PoolSpec, Sample, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.rolekit.supervisor import wait_until
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.trainer.source import PoolSource
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator
from swarmrl.trainer.source import held_through, tasks_to_ask

POOL = "pf"
G = 2


class GatedAcks:
    """A real client whose acknowledgements wait for ``gate`` (open unless closed): the test
    holds one in flight."""

    def __init__(self, client: PoolClient) -> None:
        self.client, self.gate, self.posted = client, threading.Event(), []
        self.gate.set()

    def ack_batch(self, pool_id: str, ids: list[str]):
        self.gate.wait(30)
        self.posted.append(list(ids))
        return self.client.ack_batch(pool_id, ids)


@pytest.fixture
def swarm(tmp_path):
    yield from _swarm(tmp_path, acks=False)


@pytest.fixture
def swarm_acked(tmp_path):
    """As ``swarm``, the acknowledgements posted off the step's path, on a client of their
    own (``source.acks_client``, gated)."""
    yield from _swarm(tmp_path, acks=True)


def _swarm(tmp_path, acks: bool):
    config = load_config(
        [EMBEDDED_DEFAULT],
        ["rl.prompts_per_step=2", f"rl.group_size={G}", "rl.online_filter=false", "rl.steps=3",
         "swarm.give_up_s=20"],
    )  # fmt: skip
    env = build_env(config.env)
    tokenizer = build_char_tokenizer(env.alphabet)
    orch, owner, node, validator = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(admission=False)) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=env.split_size("train"),
            open=True,
            samples_per_task=G,
            sampling=SamplingParams(max_new_tokens=4),
            validators=[validator.public_key_hex],
            max_tasks_per_lease=1,
            max_leases_in_flight=64,
        )
        PoolClient(server.url, orch).create_pool(spec)
        worker = PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        judge = PoolClient(server.url, validator)
        trainer = PoolClient(server.url, owner)
        announced: list[tuple[int, bool]] = []
        gated = GatedAcks(PoolClient(server.url, owner)) if acks else None
        source = PoolSource(
            trainer,
            POOL,
            env,
            tokenizer,
            config,
            logging.getLogger("test"),
            StatusReporter("trainer", "trainer", None),
            lambda version, final: announced.append((version, final)),
            gated,  # type: ignore[arg-type]
        )
        source.acks_client = gated

        def accepted(n: int, version: int = 0) -> None:
            """``n`` one-task units generated with ``version``, submitted and accepted by the
            validator."""
            digits = tokenizer.encode("123", add_special_tokens=False)
            for _ in range(n):
                work = worker.lease(POOL).work
                samples = [
                    Sample(task_index=t, prompt_tokens=digits, output_tokens=digits,
                           logprobs=[-0.5] * len(digits), finish_reason="length",
                           policy_version=version)
                    for t in work.task_indices for _ in range(G)
                ]  # fmt: skip
                worker.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))
            for sub in judge.claim(POOL, limit=64):
                judge.verdict(
                    POOL,
                    Verdict(
                        submission_id=sub.submission_id,
                        accept=True,
                        measured_tokens=sum(len(s.output_tokens) for s in sub.samples),
                        behaviour_logprobs=[s.logprobs for s in sub.samples],
                    ),
                )

        yield source, accepted, announced, server
        source.close()


def test_the_next_batch_is_leased_while_the_step_trains(swarm):
    source, accepted, announced, _ = swarm
    accepted(2)
    assert len(source.next_batch(0, 0).groups) == 2
    assert source.carry == []
    accepted(2)  # arrive while step 0 trains
    wait_until(lambda: len(source.carry) == 2, "the prefetch to lease step 1's rollouts", 20)
    source.commit(0, 1)
    rollouts = source.next_batch(1, 1)  # ready: no wait
    assert len(rollouts.groups) == 2 and source.carry == []
    source.commit(1, 2)
    accepted(2)
    source.next_batch(2, 2)
    source.commit(2, 3)
    assert announced == [(1, False), (2, False), (3, True)]  # the last step says the run ended
    assert len(source.consumed) == 6 and len(set(source.consumed)) == 6


def test_a_step_takes_what_it_lacks_and_leaves_the_rest_queued(swarm):
    """Work no step needs yet stays at the pool, where admission control counts it and the
    oldest is served first."""
    source, accepted, _, _ = swarm
    accepted(6)
    assert len(source.next_batch(0, 0).groups) == 2
    wait_until(lambda: len(source.carry) == 2, "the prefetch to lease step 1's rollouts", 20)
    time.sleep(0.5)  # the prefetch holds step 1's batch: it takes nothing more
    assert source.pool.metrics(POOL).submissions_by_status == {"leased": 4, "accepted": 2}


def test_a_step_asks_for_more_when_the_filter_has_been_dropping_groups(swarm):
    source, accepted, _, _ = swarm
    source._informative.extend([True] * 2 + [False] * 6)  # 2 of the last 8 groups kept
    accepted(10)
    assert len(source.next_batch(0, 0).groups) == 2  # asked for 4 × 2 tasks
    assert len(source.carry) == 6
    assert source.pool.metrics(POOL).submissions_by_status == {"leased": 8, "accepted": 2}


def _filter_dropped_most(source: PoolSource) -> None:
    """As if the filter had dropped nearly every recent group: the source then asks for eight
    times what its step lacks, and may hold more than the step needs."""
    source._informative.extend([False] * 64)


def test_a_submission_whose_groups_all_went_stale_is_counted_never_trained(swarm):
    """Acknowledged (the pool counts it trained), yet none of its groups was: the trainer
    lists it in ``stale_dropped``; the ones it trained are not listed."""
    source, accepted, _, _ = swarm
    _filter_dropped_most(source)
    accepted(4)
    assert len(source.next_batch(0, 0).groups) == 2
    carried = {sid for sid, _ in source.carry}
    assert len(carried) == 2  # one-task units: two submissions carried over
    source.commit(0, 1)
    trained = set(source.consumed)
    source.pool.set_version(POOL, 3)
    accepted(2, version=3)
    assert len(source.next_batch(3, 3).groups) == 2  # versions ≥ 1: the carried are too stale
    source.commit(3, 4)
    assert set(source.stale_dropped) == carried and source.stale_groups == 2
    assert not trained & set(source.stale_dropped)
    assert carried <= set(source.consumed)  # acknowledged all the same


def test_a_step_waiting_for_its_batch_hands_over_the_groups_it_holds(swarm):
    """While step 0 waits for its second group, the first goes to the learner (to compute its
    gradients meanwhile); the batch then starts with it, and nothing is handed over twice."""
    source, accepted, _, _ = swarm
    accepted(1)
    handed: list = []

    def early(groups):
        handed.append(list(groups))
        if len(handed) == 1:
            accepted(1)  # the rest of the batch arrives while the learner works

    rollouts = source.next_batch(0, 0, early)
    assert [len(h) for h in handed] == [1]
    assert len(rollouts.groups) == 2 and rollouts.groups[0] is handed[0][0]
    source.commit(0, 1)
    accepted(2)
    handed.clear()
    assert len(source.next_batch(1, 1, early).groups) == 2
    assert handed == []  # the batch was there whole: nothing to hand over early


def test_batches_held_beyond_the_next_step_are_told_to_the_pool(swarm):
    source, accepted, _, _ = swarm
    _filter_dropped_most(source)
    accepted(6)  # one served answer: step 0 takes 2, 4 carry over, enough for steps 1 and 2
    assert len(source.next_batch(0, 0).groups) == 2
    wait_until(lambda: source.told_through == 2, "the pool to be told steps up to 2 are held", 20)
    source.commit(0, 1)
    source.next_batch(1, 1)  # from the carry; what is left fills step 2, already told
    assert source.told_through == 2


def test_the_pool_is_told_once_the_runs_last_batch_is_held(swarm):
    """From then on no work leased can train (``swarmrl.pool.flow.admission``): whether the
    prefetch or the step itself gathered that batch, the pool hears of it before the step
    trains; earlier steps' batches, held no further than their own step, are not told."""
    source, accepted, _, server = swarm  # 3 steps: 0, 1 and 2
    accepted(2)
    source.next_batch(0, 0)
    source.commit(0, 1)
    accepted(2)
    source.next_batch(1, 1)
    assert source.told_through == -1
    source.commit(1, 2)
    accepted(2)
    assert len(source.next_batch(2, 2).groups) == 2
    assert source.told_through == 2
    with server.ctx.engine.connect() as conn:
        assert progress.plan(conn, POOL).batched_through == 2


def test_the_steps_held_groups_fill_are_counted_as_a_step_takes_them():
    # async_level 2, 2 groups a step; versions in the order the groups are held
    assert held_through(3, [], 2, 2) == 2
    assert held_through(3, [3, 3], 2, 2) == 3
    assert held_through(3, [3, 3, 3, 3, 3], 2, 2) == 4
    # step 4 drops versions < 2 before it takes its groups, as a step's batch is taken
    assert held_through(3, [1, 1, 1, 1, 3, 3], 2, 2) == 4
    assert held_through(3, [1, 1, 1, 1, 1, 3], 2, 2) == 3
    assert held_through(3, [0, 3, 3], 2, 2) == 3  # version 0 is too old for step 3 already


def test_a_request_asks_for_the_shortfall_over_the_share_the_filter_kept():
    assert tasks_to_ask(0, [True]) == 0
    assert tasks_to_ask(5, []) == 5  # nothing drawn yet: every group counted informative
    assert tasks_to_ask(5, [True, False]) == 10
    assert tasks_to_ask(3, [True, False, False]) == 9
    assert tasks_to_ask(4, [False] * 10) == 32  # never more than 8× the shortfall


def test_acknowledgements_are_posted_off_the_steps_path(swarm_acked):
    """A step's commit does not wait for its acknowledgement; until it is posted a checkpoint
    keeps the ids among those to acknowledge; the run's last commit waits for every one."""
    source, accepted, _, _ = swarm_acked
    gated = source.acks_client
    accepted(2)
    assert len(source.next_batch(0, 0).groups) == 2
    gated.gate.clear()  # the acknowledgement stays in flight
    started = time.monotonic()
    source.commit(0, 1)
    assert time.monotonic() - started < 1.0  # not held up by it
    used = set(source.state()["finished"])
    assert len(used) == 2 and source.consumed == []
    assert source.pool.metrics(POOL).submissions_by_status == {"leased": 2}
    accepted(2)
    source.next_batch(1, 1)  # the next step goes on meanwhile
    gated.gate.set()
    wait_until(lambda: len(source.consumed) == 2, "the acknowledgement", 20)
    assert set(source.consumed) == used
    assert not used & set(source.state()["finished"])  # only step 1's, used and uncommitted
    source.commit(1, 2)
    accepted(2)
    source.next_batch(2, 2)
    gated.gate.clear()
    releaser = threading.Timer(0.5, gated.gate.set)
    releaser.start()
    source.commit(2, 3)  # the last: returns once its acknowledgement is posted
    assert len(source.consumed) == 6
    assert source.pool.metrics(POOL).submissions_by_status == {"trained": 6}


def test_a_refused_acknowledgement_stops_the_trainer_at_its_next_commit(swarm_acked):
    source, accepted, _, _ = swarm_acked
    accepted(2)
    source.next_batch(0, 0)
    source._acknowledge(["0" * 32], "an id the pool never served")
    wait_until(lambda: source._acker._error is not None, "the refusal", 20)
    with pytest.raises(PeerError, match="no submissions"):
        source.commit(0, 1)
