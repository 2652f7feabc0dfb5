"""A ban's recheck of the twins' copies through the real pool (``swarmrl.pool.trust.penalties``,
``swarmrl.pool.flow.twins.repeats_served``): the matched answers to the banned node's twins go
to validators, an accomplice's copy fails and bans it, an honest copy keeps its credit and trains
in place of the dropped original, or stays ``matched`` where the original trained already; an
answer that differs from its original is a sample of its own and trains. The ledger re-derives
every recheck list. The "model" is ``synthetic_samples``, as in tests/test_pool_twins.py."""

from __future__ import annotations

import copy

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.spotchecks import SpotCheckReplay
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.protocol.pool import Heartbeat, InvalidateRequest, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples
from test_pool_release import _judge, _reverifies, _serve, _until
from test_pool_spotcheck import POOL, entries, replay, statuses
from test_pool_twins import _answer, _pool


def _credits_kept(server, sid: str) -> bool:
    with server.ctx.engine.connect() as conn:
        return not conn.execute(
            sa.select(db.credits.c.dropped).where(db.credits.c.submission_id == sid)
        ).scalar_one()


@pytest.mark.parametrize("pair", [True, False], ids=["accomplice", "honest"])
def test_a_ban_sends_the_matched_answers_of_its_units_twins_to_validators(tmp_path, pair, db_url):
    """A party holding two identities answers its own falsified unit's twin alike: the match
    credits the copy unchecked. Once the unit's node is banned, the copy goes to validators
    (``recheck`` in the ban's entry): the accomplice's fails and bans it, its credit taken
    back; an honest node's copy of an honest unit passes and keeps its credit."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        a, b, checker = _pool(server, orch, owner, validator)
        _, receipt = _answer(a, falsified=pair)
        _, answer = _answer(b, falsified=pair)  # the copy: equal to a's unit
        copy_id = answer.submission_id
        assert statuses(server)[copy_id] == "matched" and _credits_kept(server, copy_id)
        admin = PoolClient(server.url, owner)
        admin.invalidate(POOL, a.keypair.node_id, InvalidateRequest(severity="hard", reason="x"))
        [ban] = [e["body"] for e in entries(server, "invalidation")]
        assert ban["recheck"] == [copy_id] and statuses(server)[copy_id] == "pending"
        _judge(checker)
        states = {v.node_id: v.state for v in admin.nodes(POOL)}
        if pair:
            assert statuses(server)[copy_id] == "rejected"
            assert states[b.keypair.node_id] == "banned" and not _credits_kept(server, copy_id)
            # b's ban rechecks nothing: the copies of its units' twins were by a, banned
            assert [e["body"]["recheck"] for e in entries(server, "invalidation")] == [
                [copy_id],
                [],
            ]
        else:
            assert statuses(server)[copy_id] == "accepted"
            assert states[b.keypair.node_id] == "healthy" and _credits_kept(server, copy_id)
        _reverifies(server, orch, owner)
        log = read_entries(server.ctx.engine)
    # an orchestrator that leaves a copy out of the recheck, or adds one, is caught
    for forged_recheck in ([], [copy_id, receipt.submission_id]):
        forged = copy.deepcopy(log)
        for e in forged:
            if e["kind"] == "invalidation" and e["node_id"] == a.keypair.node_id:
                e["body"]["recheck"] = forged_recheck
        spot = SpotCheckReplay()
        reasons = [r for e in forged if (r := spot.feed(e))]
        assert reasons and "matched answers of its twins" in reasons[0], reasons


def test_a_rechecked_copy_whose_original_trained_is_credited_and_never_trained(tmp_path, db_url):
    """The banned node's unit trained before its ban (an honest unit; the ban was for
    something else): the honest copy of it passes its recheck and keeps its credit, but stays
    a twin's answer (``matched``): its samples are the ones that trained already, so no trainer
    is served them a second time."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        a, b, checker = _pool(server, orch, owner, validator, validated_fraction=0.5)
        unit = _until(server, a, "unchecked")[-1]
        _judge(checker)
        _, answer = _answer(b)
        copy_id = answer.submission_id
        assert statuses(server)[copy_id] == "matched"
        trainer, served = PoolClient(server.url, owner), set()
        _until(server, a, "pending")
        _judge(checker)
        _serve(trainer, served)
        assert unit in served and statuses(server)[unit] == "trained"
        trainer.invalidate(POOL, a.keypair.node_id, InvalidateRequest(severity="hard", reason="x"))
        [ban] = [e["body"] for e in entries(server, "invalidation")]
        assert ban["recheck"] == [copy_id] and unit not in ban["dropped_submissions"]
        _judge(checker)
        assert statuses(server)[copy_id] == "matched" and _credits_kept(server, copy_id)
        _serve(trainer, served)
        assert copy_id not in served
        _reverifies(server, orch, owner)


def test_a_twins_answer_on_another_version_trains_even_after_its_original_did(tmp_path):
    """An answer that differs from its original (here: generated on another version) is a
    sample of its own: accepted after the original trained, it trains too; only an equal
    copy (a ban's recheck) stays ``matched``."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        a, b, checker = _pool(server, orch, owner, validator)
        admin = PoolClient(server.url, owner)
        admin.invalidate(POOL, b.keypair.node_id, InvalidateRequest(severity="hard", reason="x"))
        c = PoolClient(server.url, KeyPair.generate())  # young: its submissions are checked
        c.join(POOL, CPU_NODE)
        c.heartbeat(POOL, Heartbeat(status="ok"))
        _, receipt = _answer(a)  # unchecked, its twin drawn for c (the only other healthy)
        unit = receipt.submission_id
        admin.set_version(POOL, 1)
        c.heartbeat(POOL, Heartbeat(status="ok"))
        twin = c.lease(POOL).work
        answer = c.submit(
            POOL, Submission(lease_id=twin.lease_id, samples=synthetic_samples(twin, 1))
        )
        assert statuses(server)[unit] == "pending"
        assert statuses(server)[answer.submission_id] == "pending"  # c's rate is 1
        pending = {p.submission_id: p for p in checker.claim(POOL, limit=16)}
        checker.verdict(POOL, replay(pending[unit]))
        served: set[str] = set()
        _serve(admin, served)
        assert unit in served and statuses(server)[unit] == "trained"
        want = synthetic_samples(twin, 1)
        checker.verdict(
            POOL,
            Verdict(
                submission_id=answer.submission_id,
                accept=True,
                measured_tokens=sum(len(w.output_tokens) for w in want),
                behaviour_logprobs=[w.logprobs for w in want],
            ),
        )
        assert statuses(server)[answer.submission_id] == "accepted"
        _serve(admin, served)
        assert answer.submission_id in served
