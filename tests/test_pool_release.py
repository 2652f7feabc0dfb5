"""When unchecked work trains, through the real pool: an unchecked unit is released only once
``release_after_checks`` checks of its node's later units passed, a share
``release_replay_fraction`` of what a passed check would release is checked instead, and a
sparse cheater's unchecked falsified unit that either rule holds back is dropped at its ban,
never trained. The ledger alone re-derives both rules (``swarmrl.ledger.spotchecks``) and the
start-up audit agrees with the tables.

The "model" is ``synthetic_samples`` (as in tests/test_pool_spotcheck.py): a validator really
replays it, and a falsified sample really differs."""

from __future__ import annotations

import copy

import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict
from swarmrl.identity import KeyPair
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.spotchecks import SpotCheckReplay, is_replayed
from swarmrl.ledger.verify import export_lines, verify_lines
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.pool.trust.audit import audit
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator
from test_pool_spotcheck import POOL, entries, make_spec, replay, statuses, submit

NODES = 40  # fresh nodes tried until one's falsified unit is unchecked: P(none) = 2^-40


def _serve(trainer: PoolClient, served: set[str]) -> None:
    batch = trainer.batch(POOL, step=0, holder="t" * 32, limit=256)
    ids = [s.submission_id for s in batch.submissions]
    served.update(ids)
    if ids:
        trainer.ack_batch(POOL, ids)


def _until(server, node: PoolClient, status: str, falsified: bool = False) -> list[str]:
    """Submit units until one is stored with ``status``; all their ids, that one last."""
    ids: list[str] = []
    while not ids or statuses(server)[ids[-1]] != status:
        ids.append(submit(node, falsified=falsified).submission_id)
    return ids


def _judge(checker: PoolClient) -> None:
    """Judge every pending unit, those a release sends to a check included; a unit whose node
    a verdict before it banned is dropped, and a verdict on it refused."""
    while pending := checker.claim(POOL, limit=256):
        for unit in pending:
            try:
                checker.verdict(POOL, replay(unit))
            except Conflict as exc:
                assert "is dropped" in str(exc)


def _reverifies(server, orch: KeyPair, owner: KeyPair) -> None:
    """The ledger re-derives every draw once the epoch's secret is revealed; the tables agree
    with it."""
    PoolClient(server.url, owner).set_version(POOL, 1)
    report = verify_lines(export_lines(read_entries(server.ctx.engine)), orch.public_key_hex)
    assert report.ok, report.reason
    assert report.spot_checks_unrevealed == 0
    audit(server.ctx.engine, orch.public_key_hex)


def _credits(server) -> dict[str, int]:
    with server.ctx.engine.connect() as conn:
        rows = conn.execute(sa.select(db.credits.c.submission_id, db.credits.c.tokens)).all()
    return {r.submission_id: r.tokens for r in rows}


def test_an_unchecked_unit_is_released_only_after_k_later_checks_passed(tmp_path):
    """k = 2: one passed check of a later unit does not release it, the second does, and the
    ``release`` entry names it and the check that released it."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(
        owner, [validator], validated_fraction=0.5, check_rate_decay=0.0, release_after_checks=2
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        trainer, served = PoolClient(server.url, owner), set()
        node.join(POOL, CPU_NODE)
        submit(node)
        _judge(checker)  # rate 1 for the first, then the 0.5 floor
        held = _until(server, node, "unchecked")[-1]
        _judge(checker)  # checked ones before it release nothing it needs
        first = _until(server, node, "pending")[-1]
        _judge(checker)
        _serve(trainer, served)
        assert statuses(server)[held] == "unchecked" and held not in served
        second = _until(server, node, "pending")[-1]
        _judge(checker)
        _serve(trainer, served)
        assert statuses(server)[held] == "trained" and held in served
        [release] = [
            e["body"] for e in entries(server, "release") if held in e["body"]["submission_ids"]
        ]
        assert release["by"] == second != first
        _reverifies(server, orch, owner)


def test_a_young_nodes_unchecked_work_waits_until_it_has_passed_n_checks(tmp_path):
    """n = 4: nothing of the node is released before its fourth passed check; from then every
    unchecked unit that has a passed check after it is; a ledger claiming n = 5 for the same
    pool is a reason (the release came too early)."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(
        owner, [validator], validated_fraction=0.5, check_rate_decay=0.0, release_young_checks=4
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        held: list[str] = []
        for _ in range(3):  # three passed checks (unchecked work, if any, before each)
            units = _until(server, node, "pending")
            held += [s for s in units if statuses(server)[s] == "unchecked"]
            _judge(checker)
            assert not entries(server, "release")
            assert all(statuses(server)[s] == "unchecked" for s in held)
        units = _until(server, node, "unchecked") + _until(server, node, "pending")
        held += [s for s in units if statuses(server)[s] == "unchecked"]
        _judge(checker)  # the fourth, and any after it
        released = [s for e in entries(server, "release") for s in e["body"]["submission_ids"]]
        assert sorted(released) == sorted(held)
        assert all(statuses(server)[s] == "accepted" for s in held)
        log = read_entries(server.ctx.engine)
    spot = SpotCheckReplay()
    assert not [r for e in log if (r := spot.feed(e))]
    for e in log:
        if e["kind"] == "pool_created":
            e["body"]["spec"]["release_young_checks"] = 5
    spot = SpotCheckReplay()
    reasons = [r for e in log if (r := spot.feed(e))]
    assert reasons and "releases none before 5" in reasons[0]


def test_a_ledger_releasing_before_k_checks_does_not_reverify(tmp_path):
    """A pool created with k = 1 releases after one passed check; the same ledger claiming
    k = 2 in its ``pool_created`` entry is a reason (the release came too early)."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.5, check_rate_decay=0.0)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        submit(node)
        _judge(checker)
        while not entries(server, "release"):
            submit(node)
            _judge(checker)
        log = read_entries(server.ctx.engine)
    honest = SpotCheckReplay()
    assert not any(honest.feed(e) for e in log)
    forged = copy.deepcopy(log)
    for e in forged:
        if e["kind"] == "pool_created":
            e["body"]["spec"]["release_after_checks"] = 2
    spot = SpotCheckReplay()
    reasons = [r for e in forged if (r := spot.feed(e))]
    assert reasons and "passed checks of later submissions" in reasons[0]


def _sparse_cheater_held_back(tmp_path, db_url: str = "", **rule) -> None:
    """A node passes its first check, then submits a falsified unit. When that unit is
    unchecked, honest units follow until one of them is checked and passes (today that check
    would release the falsified one to the trainer), then falsified ones until one is checked
    and fails. The falsified unit must never reach the trainer: it is dropped at the ban and its
    credit taken back. Fresh nodes are tried until one's falsified unit is unchecked."""
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = make_spec(owner, [validator], validated_fraction=0.5, check_rate_decay=0.0, **rule)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        checker, trainer, served = (
            PoolClient(server.url, validator),
            PoolClient(server.url, owner),
            set(),
        )
        for _ in range(NODES):
            node = PoolClient(server.url, KeyPair.generate())
            node.join(POOL, CPU_NODE)
            submit(node)
            _judge(checker)
            cheat = submit(node, falsified=True).submission_id
            if statuses(server)[cheat] == "pending":  # checked: caught at once, no residual
                _judge(checker)
                continue
            honest = _until(server, node, "pending")
            _judge(checker)
            _serve(trainer, served)
            if statuses(server)[cheat] == "rejected":  # a replay at release caught it
                break
            assert statuses(server)[cheat] == "unchecked" and cheat not in served
            _until(server, node, "pending", falsified=True)
            _judge(checker)
            break
        else:
            raise AssertionError(f"no falsified unit of {NODES} nodes went unchecked")
        _serve(trainer, served)
        assert cheat not in served
        assert statuses(server)[cheat] in ("dropped", "rejected")
        banned = {v.node_id: v.state for v in trainer.nodes(POOL)}[node.keypair.node_id]
        assert banned == "banned"
        slashed = {s for e in entries(server, "slash") for s in e["body"]["submission_ids"]}
        assert cheat in slashed  # credited when it arrived unchecked, taken back
        assert set(honest[:-1]) <= slashed | served  # the rest of its unvouched work too
        _reverifies(server, orch, owner)


def test_a_sparse_cheaters_unchecked_falsified_unit_is_not_trained_with_k_2(db_url, tmp_path):
    _sparse_cheater_held_back(tmp_path, db_url, release_after_checks=2)


def test_a_sparse_cheaters_unchecked_falsified_unit_is_replayed_at_release(tmp_path):
    """q = 1: every unit a passed check would release is checked instead, so the falsified
    one is replayed, fails and bans its node."""
    _sparse_cheater_held_back(tmp_path, release_replay_fraction=1.0)


def test_units_replayed_at_release_train_once_passed_and_are_credited_once(tmp_path):
    """q = 0.5 on an honest node: the units the release draw picks wait for their own check
    (``replay`` in the ``release`` entry, exactly those the draw gives), the others train at
    once; every unit is credited once, when it arrived; ledger and tables agree."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(
        owner, [validator], validated_fraction=0.2, check_rate_decay=0.0,
        release_replay_fraction=0.5,
    )  # fmt: skip
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        trainer, served = PoolClient(server.url, owner), set()
        node.join(POOL, CPU_NODE)
        mine = []

        def count(key: str) -> int:
            return sum(len(e["body"].get(key, [])) for e in entries(server, "release"))

        while count("replay") < 3 or count("submission_ids") < 3:
            mine.append(submit(node).submission_id)
            _judge(checker)
            _serve(trainer, served)
        releases = entries(server, "release")
        replayed = {s for e in releases for s in e["body"].get("replay", [])}
        released = {s for e in releases for s in e["body"]["submission_ids"]}
        assert replayed and released and not replayed & released
        with server.ctx.engine.connect() as conn:
            secrets = dict(
                conn.execute(
                    sa.select(db.assignment_secrets.c.epoch, db.assignment_secrets.c.secret)
                ).all()
            )
        for e in releases:
            secret = secrets[e["body"]["epoch"]]
            for sid in e["body"]["submission_ids"] + e["body"].get("replay", []):
                assert is_replayed(secret, POOL, sid, 0.5) == (sid in replayed)
        verdicts = {e["body"]["submission_id"] for e in entries(server, "verdict")}
        assert replayed <= verdicts and replayed <= served  # checked, passed, trained
        credits = _credits(server)
        assert set(credits) == set(mine)
        assert len(entries(server, "credit")) == len(mine)
        _reverifies(server, orch, owner)


def test_a_database_made_before_the_release_count_gets_it_at_zero(tmp_path):
    """An unchecked unit stored before ``submissions.passes_after`` existed gets the column at
    0 when the orchestrator opens the database again, so it waits for the next passed check."""
    url = sqlite_url(tmp_path / "pool.db")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE submissions DROP COLUMN passes_after")
    engine.dispose()
    engine = make_engine(url)
    try:
        columns = {c["name"]: c for c in sa.inspect(engine).get_columns("submissions")}
        assert "passes_after" in columns and not columns["passes_after"]["nullable"]
    finally:
        engine.dispose()
