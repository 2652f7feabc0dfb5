"""Twins through the real pool (``swarmrl.pool.flow.twins``): an unchecked unit leased again to
another node waits for the usual release when the two outputs are equal (the twin never trains),
and is sent to validators with its twin when they differ, whichever of the two lied; a node never gets its own unit's twin; a
twin nobody answers lapses and the unit goes back to the usual release, at once when no other
node is healthy any more; a node with no healthy peer gets no twin at all. The ledger alone
re-derives every twin draw and every match, and the start-up audit agrees with the tables.

The "model" is ``synthetic_samples`` (as in tests/test_pool_spotcheck.py): a function of the
unit's seed, so two honest nodes given one unit produce equal samples, and a falsified sample
really differs."""

from __future__ import annotations

import copy
import json
import time

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.spotchecks import SpotCheckReplay
from swarmrl.ledger.verify import export_lines, verify_lines
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import twins
from swarmrl.pool.state import db
from swarmrl.pool.trust.audit import audit
from swarmrl.pool.trust.service import sweep
from swarmrl.protocol.pool import Heartbeat, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples
from test_pool_release import _judge, _reverifies, _serve, _until
from test_pool_spotcheck import POOL, entries, make_spec, statuses, submit


def _answer(node: PoolClient, falsified: bool = False):
    """Lease one unit and answer it (honestly, or with one output token changed); the work
    and the receipt."""
    node.heartbeat(POOL, Heartbeat(status="ok"))
    work = node.lease(POOL).work
    samples = synthetic_samples(work, 0)
    if falsified:
        samples[0].output_tokens[0] = (samples[0].output_tokens[0] + 1) % 1000
    return work, node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))


def _pool(server, orch, owner, validator, **over):
    """A pool where a node's first unit is checked and every later one unchecked and
    twinned; two members whose first units passed their checks."""
    over = {"validated_fraction": 0.0, "check_rate_decay": 0.0, "twin_fraction": 1.0, **over}
    PoolClient(server.url, orch).create_pool(make_spec(owner, [validator], **over))
    a, b = PoolClient(server.url, KeyPair.generate()), PoolClient(server.url, KeyPair.generate())
    checker = PoolClient(server.url, validator)
    for node in (a, b):
        node.join(POOL, CPU_NODE)
        submit(node)
        _judge(checker)
    return a, b, checker


def _twin_entries(server) -> list[dict]:
    return [e["body"] for e in entries(server, "release") if e["body"].get("twin")]


def test_equal_twins_leave_the_unit_to_the_usual_release_and_the_twin_trains_nowhere(
    tmp_path, db_url
):
    """The match releases nothing (a party with two identities could answer its own unit's
    twin alike): the unit trains once a later check of its node passed, the twin never."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        a, b, checker = _pool(server, orch, owner, validator, validated_fraction=0.5)
        unit = _until(server, a, "unchecked")[-1]
        _judge(checker)
        work = _work_of(server, unit)
        mine, _ = _answer(a)  # the node that submitted it never gets its twin
        assert mine.origin_node_id == a.keypair.node_id
        assert (mine.task_indices, mine.seed) != (work["task_indices"], work["seed"])
        twin, answer = _answer(b)
        assert (twin.task_indices, twin.seed) == (work["task_indices"], work["seed"])
        assert twin.origin_node_id == a.keypair.node_id and twin.lease_id != work["lease_id"]
        assert statuses(server)[answer.submission_id] == "matched"
        [body] = [t for t in _twin_entries(server) if t["by"] == answer.submission_id]
        assert body["matched"] and body["submission_ids"] == []
        served: set[str] = set()
        trainer = PoolClient(server.url, owner)
        _serve(trainer, served)
        assert statuses(server)[unit] == "unchecked" and unit not in served
        _until(server, a, "pending")
        _judge(checker)
        _serve(trainer, served)
        assert unit in served and answer.submission_id not in served
        _reverifies(server, orch, owner)


def _work_of(server, sid: str) -> dict:
    """The work unit submission ``sid`` answered."""
    subs, leases = db.submissions, db.leases
    with server.ctx.engine.connect() as conn:
        work = conn.execute(
            sa.select(leases.c.work)
            .join(subs, subs.c.lease_id == leases.c.lease_id)
            .where(subs.c.submission_id == sid)
        ).scalar_one()
    return json.loads(work)


@pytest.mark.parametrize("liar", ["original", "twin"])
def test_different_twins_go_to_validators_and_the_liar_is_banned(tmp_path, liar, db_url):
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        a, b, checker = _pool(server, orch, owner, validator)
        _, receipt = _answer(a, falsified=liar == "original")
        _, answer = _answer(b, falsified=liar == "twin")
        unit, other = receipt.submission_id, answer.submission_id
        assert statuses(server)[unit] == statuses(server)[other] == "pending"
        [body] = _twin_entries(server)
        assert not body["matched"] and body["replay"] == [unit, other]
        _judge(checker)
        lied, honest = (unit, other) if liar == "original" else (other, unit)
        assert statuses(server)[lied] == "rejected" and statuses(server)[honest] == "accepted"
        banned = a if liar == "original" else b
        states = {v.node_id: v.state for v in PoolClient(server.url, owner).nodes(POOL)}
        assert states[banned.keypair.node_id] == "banned"
        served: set[str] = set()
        _serve(PoolClient(server.url, owner), served)
        assert honest in served and lied not in served
        _reverifies(server, orch, owner)


def test_a_twin_on_another_version_is_not_compared_and_its_unit_goes_to_validators(tmp_path):
    """A node could declare another policy version than its twin's node will hold, to dodge
    the comparison: the unit then goes to validators, and the twin's answer is drawn for a
    spot check like any submission (here at its node's rate 0: unchecked)."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        a, b, checker = _pool(server, orch, owner, validator)
        _, receipt = _answer(a)
        unit = receipt.submission_id
        PoolClient(server.url, owner).set_version(POOL, 1)
        b.heartbeat(POOL, Heartbeat(status="ok"))
        twin = b.lease(POOL).work
        samples = synthetic_samples(twin, 1)  # the same unit on version 1
        answer = b.submit(POOL, Submission(lease_id=twin.lease_id, samples=samples))
        assert statuses(server)[unit] == "pending"
        assert statuses(server)[answer.submission_id] == "unchecked"
        [body] = _twin_entries(server)
        assert body["apart"] and body["replay"] == [unit] and not body["matched"]
        [entry] = [
            e["body"]
            for e in entries(server, "submission")
            if e["body"]["submission_id"] == answer.submission_id
        ]
        assert entry["twin_of"] == unit and "by_twin" not in entry["check"]
        _judge(checker)
        assert statuses(server)[unit] == "accepted"
        PoolClient(server.url, owner).set_version(POOL, 2)  # reveals the epoch's secret
        report = verify_lines(export_lines(read_entries(server.ctx.engine)), orch.public_key_hex)
        assert report.ok, report.reason
        assert report.spot_checks_unrevealed == 0
        audit(server.ctx.engine, orch.public_key_hex)


def _taker_of(server, sid: str) -> str | None:
    """The node the twin of submission ``sid`` is offered to first."""
    with server.ctx.engine.connect() as conn:
        return conn.execute(
            sa.select(db.leases.c.twin_taker).where(db.leases.c.twin_of == sid)
        ).scalar_one()


def test_a_twin_goes_to_its_drawn_taker_first_and_to_anyone_after_a_leases_time(tmp_path, db_url):
    """Asking first does not win a twin: it is offered to a node drawn among the healthy
    others, and to the rest only once it waited ``lease_target_s`` or the drawn node fell
    silent (the pool's clock, moved here; signatures keep the real one)."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    config = PoolConfig(db_url=db_url, sweep_interval_s=3600)
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]
        a, b, checker = _pool(
            server, orch, owner, validator, lease_target_s=30.0, max_leases_in_flight=8
        )
        c = PoolClient(server.url, KeyPair.generate())
        c.join(POOL, CPU_NODE)
        submit(c)
        _judge(checker)
        others = {b.keypair.node_id: b, c.keypair.node_id: c}
        origin = a.keypair.node_id
        for late in (False, True):
            _, receipt = _answer(a)  # unchecked from now on, and twinned
            taker = _taker_of(server, receipt.submission_id)
            assert taker in others
            [other] = [n for n in others if n != taker]
            if late:
                now[0] += 31  # the drawn taker did not ask within a lease's time
            others[other].heartbeat(POOL, Heartbeat(status="ok"))
            asked_first = others[other].lease(POOL).work
            assert (asked_first.origin_node_id == origin) is late, late
            if not late:
                twin = others[taker].lease(POOL).work
                assert twin.origin_node_id == origin
        # a drawn taker gone silent (unhealthy) does not hold the twin for its turn either
        _, receipt = _answer(a)
        taker = _taker_of(server, receipt.submission_id)
        [other] = [n for n in others if n != taker]
        now[0] += 16  # past unhealthy_after_s (15), well within lease_target_s (30)
        for node in (a, others[other]):
            node.heartbeat(POOL, Heartbeat(status="ok"))
        sweep(server.ctx)
        states = {v.node_id: v.state for v in PoolClient(server.url, owner).nodes(POOL)}
        assert states[taker] == "unhealthy" and states[other] == "healthy"
        assert others[other].lease(POOL).work.origin_node_id == origin
        _reverifies(server, orch, owner)


def _held_beside_an_idle_node(server, orch, owner, validator, **over):
    """A pool with twins on every unchecked unit (floor 0.5, no decay) and two members: one
    that works and one that joined (healthy) but never asks for work. The worker's first
    unchecked unit, its twin waiting, after a later unit's check passed: the worker, the
    validator's client and the unit."""
    spec = {"validated_fraction": 0.5, "check_rate_decay": 0.0, "twin_fraction": 1.0, **over}
    PoolClient(server.url, orch).create_pool(make_spec(owner, [validator], **spec))
    node, idle, checker = (
        PoolClient(server.url, KeyPair.generate()),
        PoolClient(server.url, KeyPair.generate()),
        PoolClient(server.url, validator),
    )
    node.join(POOL, CPU_NODE)
    idle.join(POOL, CPU_NODE)
    submit(node)
    _judge(checker)
    held = _until(server, node, "unchecked")[-1]
    _until(server, node, "pending")
    _judge(checker)
    return node, checker, held


def test_a_twin_nobody_answers_lapses_and_the_unit_waits_for_the_usual_release(tmp_path, db_url):
    """k = 1: a passed check of a later unit releases nothing while the unit's twin is out;
    once the twin lapsed (nobody took it by its deadline), the next passed check does."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        node, checker, held = _held_beside_an_idle_node(
            server, orch, owner, validator, lease_timeout_s=3.0
        )
        assert statuses(server)[held] == "unchecked"  # its twin is out
        time.sleep(3.2)
        sweep(server.ctx)
        _until(server, node, "pending")
        _judge(checker)
        assert statuses(server)[held] == "accepted"
        _reverifies(server, orch, owner)


def test_a_twin_nobody_healthy_can_take_lapses_before_its_deadline(tmp_path, db_url):
    """The only other node goes silent (unhealthy) while a unit's twin waits for it: the sweep
    lapses the twin at once, not at its deadline, and the next passed check releases the unit.
    Silence is measured on the orchestrator's clock, moved here (signatures keep the real one)."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    config = PoolConfig(db_url=db_url, unhealthy_after_s=10, sweep_interval_s=3600)
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]
        node, checker, held = _held_beside_an_idle_node(
            server, orch, owner, validator, lease_timeout_s=600.0
        )
        sweep(server.ctx)
        assert statuses(server)[held] == "unchecked"  # its twin waits for the idle node
        now[0] += 11  # the idle node has been silent 11 s; the node beats on
        node.heartbeat(POOL, Heartbeat(status="ok"))
        sweep(server.ctx)
        _until(server, node, "pending")
        _judge(checker)
        assert statuses(server)[held] == "accepted"
        _reverifies(server, orch, owner)


def test_a_node_with_no_healthy_peer_gets_no_twin_and_its_unit_is_not_held(tmp_path, db_url):
    """Drawn for a twin while no other node could answer it: no twin is leased (the entry says
    ``alone``), the next passed check releases the unit, and the ledger re-derives the draw; a
    ledger that calls a unit alone whose draw made no twin, or twinned and alone, fails."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(
            make_spec(
                owner, [validator], validated_fraction=0.5, check_rate_decay=0.0, twin_fraction=1.0
            )  # fmt: skip
        )
        node, checker = (
            PoolClient(server.url, KeyPair.generate()),
            PoolClient(server.url, validator),
        )
        node.join(POOL, CPU_NODE)
        submit(node)
        _judge(checker)
        held = _until(server, node, "unchecked")[-1]
        with server.ctx.engine.connect() as conn:
            twin_rows = conn.execute(
                sa.select(sa.func.count()).where(db.leases.c.twin_of.is_not(None))
            ).scalar_one()
        assert twin_rows == 0
        [record] = [
            e["body"]["check"]
            for e in entries(server, "submission")
            if e["body"]["submission_id"] == held
        ]
        assert record["alone"] is True and record["twin"] is False
        _until(server, node, "pending")
        _judge(checker)
        assert statuses(server)[held] == "accepted"  # not held for a twin nobody could answer
        _reverifies(server, orch, owner)
        log = read_entries(server.ctx.engine)
    for forge, reason in (
        ({"twin": True}, "both twinned and without a node"),
        ({"alone": False}, "recorded twin = False, but the draw"),
    ):
        forged = copy.deepcopy(log)
        for e in forged:
            if e["kind"] == "submission" and e["body"]["submission_id"] == held:
                e["body"]["check"].update(forge)
        spot = SpotCheckReplay()
        reasons = [r for e in forged if (r := spot.feed(e))] + [spot.finish()]
        assert reasons and reason in reasons[0], (forge, reasons)


def test_a_ledger_whose_match_joins_different_digests_does_not_reverify(tmp_path):
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        a, b, _ = _pool(server, orch, owner, validator)
        _answer(a)
        _, answer = _answer(b)
        log = read_entries(server.ctx.engine)
    spot = SpotCheckReplay()
    assert not [r for e in log if (r := spot.feed(e))]
    forged = copy.deepcopy(log)
    for e in forged:
        if e["kind"] == "submission" and e["body"]["submission_id"] == answer.submission_id:
            e["body"]["digest"] = "0" * 64
    spot = SpotCheckReplay()
    reasons = [r for e in forged if (r := spot.feed(e))]
    assert reasons and "digest differs" in reasons[0]
    # the comparison's entry left out: the answer went unchecked and was never compared
    cut = [e for e in log if not (e["kind"] == "release" and e["body"].get("twin"))]
    spot = SpotCheckReplay()
    assert not [r for e in cut if (r := spot.feed(e))]
    assert "never compared" in spot.finish()


def test_compare_needs_equal_tokens_and_log_probs_within_the_tolerance():
    from swarmrl.protocol.pool import WorkUnit  # noqa: PLC0415

    work = WorkUnit(
        lease_id="a" * 32,
        pool_id=POOL,
        node_id="n" * 32,
        task_indices=[3, 5],
        samples_per_task=2,
        sampling={"max_new_tokens": 4},
        seed=7,
        min_version=0,
        deadline=1e12,
        origin_node_id="n" * 32,
        origin_counter=0,
        assignment_epoch=0,
    )
    ours = synthetic_samples(work, 0)
    assert twins.compare(ours, synthetic_samples(work, 0)) == "equal"
    near = synthetic_samples(work, 0)
    near[1].logprobs[0] += twins.LOGPROB_TOLERANCE / 2
    assert twins.compare(ours, near) == "equal"
    for change in ("token", "logprob", "nan", "version"):
        theirs = synthetic_samples(work, 0)
        if change == "token":
            theirs[2].output_tokens[-1] += 1
        elif change == "logprob":
            theirs[0].logprobs[0] -= 2 * twins.LOGPROB_TOLERANCE
        elif change == "nan":
            theirs[3].logprobs[0] = float("nan")
        want = "different"
        if change == "version":
            theirs = synthetic_samples(work, 1)
            want = "apart"
        assert twins.compare(ours, theirs) == want, change


def test_a_database_made_before_drawn_takers_gets_the_column_empty(tmp_path):
    """Opened again by this version, a database without ``leases.twin_taker`` gets it, empty:
    its waiting twins stay open to any node but their own, as they were."""
    url = db.sqlite_url(tmp_path / "pool.db")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE leases DROP COLUMN twin_taker")
    engine.dispose()
    engine = db.make_engine(url)
    try:
        columns = {c["name"]: c for c in sa.inspect(engine).get_columns("leases")}
        assert "twin_taker" in columns and columns["twin_taker"]["nullable"]
    finally:
        engine.dispose()
