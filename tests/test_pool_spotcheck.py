"""Spot-check validation through the real pool, on SQLite and PostgreSQL: which submissions are
checked cannot be told or predicted by the worker, a node's rate falls with a clean record and
rises after a failed check (not after a soft drop), a cheater is caught and none of its unvouched work trains, a quorum
decides disputed verdicts, and the ledger alone re-derives every selection.

The "model" here is ``synthetic_samples``: a deterministic function of the work unit's seed, so
a validator really replays it (recomputes the tokens) and a falsified sample really differs."""

from __future__ import annotations

import copy

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict, Invalid, LedgerMismatch
from swarmrl.identity import KeyPair
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.spotchecks import SpotCheckReplay, check_rate, draw, is_checked
from swarmrl.ledger.verify import export_lines, verify_lines
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import spotcheck
from swarmrl.pool.state import db
from swarmrl.pool.trust.audit import audit
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import PendingSubmission, Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "sc"
OWNER, VALIDATOR = KeyPair.generate(), KeyPair.generate()


def make_spec(owner: KeyPair, validators: list[KeyPair], **over) -> PoolSpec:
    fields = dict(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=1000,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[v.public_key_hex for v in validators],
        max_tasks_per_lease=1,
        max_leases_in_flight=64,
    )
    return PoolSpec(**{**fields, **over})


def submit(node: PoolClient, falsified: bool = False):
    """Lease a unit and answer it honestly, or with one output token changed."""
    node.heartbeat(POOL, Heartbeat(status="ok"))  # long loops outlast unhealthy_after_s
    work = node.lease(POOL).work
    samples = synthetic_samples(work, 0)
    if falsified:
        samples[0].output_tokens[0] = (samples[0].output_tokens[0] + 1) % 1000
    return node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))


def replay(p: PendingSubmission, severity: str = "hard") -> Verdict:
    """A validator's replay of the deterministic synthetic model."""
    want = synthetic_samples(p.work, 0)
    ok = [s.output_tokens for s in p.samples] == [w.output_tokens for w in want]
    return Verdict(
        submission_id=p.submission_id,
        accept=ok,
        severity=severity,
        reasons=[] if ok else ["sampling replay mismatch"],
        measured_tokens=sum(len(w.output_tokens) for w in want) if ok else 0,
        behaviour_logprobs=[w.logprobs for w in want] if ok else None,
    )


def judge_all(checker: PoolClient, severity: str = "hard") -> list[Verdict]:
    verdicts = [replay(p, severity) for p in checker.claim(POOL, limit=256)]
    for v in verdicts:
        checker.verdict(POOL, v)
    return verdicts


def entries(server, kind: str) -> list[dict]:
    return [e for e in read_entries(server.ctx.engine) if e["kind"] == kind]


def statuses(server) -> dict[str, str]:
    with server.ctx.engine.connect() as conn:
        rows = conn.execute(sa.select(db.submissions.c.submission_id, db.submissions.c.status))
        return dict(rows.all())


# --- the arithmetic --------------------------------------------------------------------------


def test_rate_starts_at_one_falls_geometrically_to_the_floor():
    assert [check_rate(n, 0.25, 0.5) for n in range(5)] == [1.0, 0.5, 0.25, 0.25, 0.25]
    assert check_rate(0, 0.25, 0.0) == 1.0 and check_rate(1, 0.25, 0.0) == 0.25
    assert check_rate(7, 1.0, 0.5) == 1.0  # floor 1: everything is checked


def test_the_draw_is_uniform_and_the_submission_id_alone_does_not_determine_it():
    ids = [f"{i:032x}" for i in range(4000)]
    a, b = "ab" * 32, "cd" * 32
    share = sum(is_checked(a, POOL, i, 0.25) for i in ids) / len(ids)
    assert 0.22 < share < 0.28
    assert all(0.0 <= draw(a, POOL, i) < 1.0 for i in ids[:100])
    assert [draw(a, POOL, i) for i in ids[:50]] == [draw(a, POOL, i) for i in ids[:50]]
    # everything the worker sees (pool, submission id) with another secret: independent choices
    same = sum(is_checked(a, POOL, i, 0.5) == is_checked(b, POOL, i, 0.5) for i in ids)
    assert 0.45 < same / len(ids) < 0.55


# --- the target case: 1 in 4 falsified at a 25 % rate ----------------------------------------


def run_cheater(server, cheater: PoolClient, honest: PoolClient, served: set[str]) -> dict:
    """Let ``cheater`` falsify every 4th unit, beside an honest worker, a validator and the
    trainer, until it is banned; returns {submission id: falsified}."""
    checker = PoolClient(server.url, VALIDATOR)
    trainer = PoolClient(server.url, OWNER)
    falsified: dict[str, bool] = {}
    for n in range(400):  # P(surviving 400) ≤ (1 − 1/16)^399 < 1e-11
        falsified[submit(cheater, falsified=n % 4 == 3).submission_id] = n % 4 == 3
        submit(honest)
        judge_all(checker)
        batch = trainer.batch(POOL, step=0, holder="t" * 32)
        served |= {s.submission_id for s in batch.submissions}
        if batch.submissions:
            trainer.ack_batch(POOL, [s.submission_id for s in batch.submissions])
        if _banned(trainer, cheater):
            return falsified
    raise AssertionError("a cheater falsifying 1 in 4 survived 400 submissions at a 25 % rate")


def _banned(trainer: PoolClient, node: PoolClient) -> bool:
    return {v.node_id: v.state for v in trainer.nodes(POOL)}[node.keypair.node_id] == "banned"


def test_cheater_falsifying_one_in_four_at_rate_25pct_is_caught_before_its_unvouched_work_trains(
    db_url, tmp_path
):
    """A cheater falsifies every 4th unit at a 25 % check rate, beside an honest worker, a
    validator and the trainer. It is caught; at that moment all its work no passed check
    vouched for is dropped (never served), named in its ban and slashed; what it had trained
    was each vouched for by a passed check of it. Fresh cheaters are run until one is caught
    with such work outstanding (each is with probability about 3/4)."""
    orch, honest_key = KeyPair.generate(), KeyPair.generate()
    # decay 0: rate 1 for the first submission, then the 25 % floor for as long as checks pass
    spec = make_spec(OWNER, [VALIDATOR], validated_fraction=0.25, check_rate_decay=0.0)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        honest = PoolClient(server.url, honest_key)
        honest.join(POOL, CPU_NODE)
        trainer = PoolClient(server.url, OWNER)
        served: set[str] = set()
        unvouched: set[str] = set()
        for _ in range(12):  # P(no cheater had unvouched work when caught) ≈ 0.25^12
            cheater = PoolClient(server.url, KeyPair.generate())
            cheater.join(POOL, CPU_NODE)
            mine = run_cheater(server, cheater, honest, served)
            now = statuses(server)
            [rejected] = [s for s in mine if now[s] == "rejected"]
            assert mine[rejected]  # the check that failed caught a falsified unit
            passed = {e["body"]["submission_id"] for e in entries(server, "verdict")}
            released = {s for e in entries(server, "release") for s in e["body"]["submission_ids"]}
            # what reached the trainer was vouched for by a passed check: its own, or a later
            # one of the same node (a release); everything else was dropped, never served
            for sid in set(mine) & served:
                assert sid in passed or sid in released
            unvouched = {s for s in mine if s not in served and s != rejected}
            assert all(now[s] == "dropped" for s in unvouched)
            [ban] = [
                e["body"]
                for e in entries(server, "invalidation")
                if e["node_id"] == cheater.keypair.node_id
            ]
            assert ban["severity"] == "hard"
            assert set(ban["dropped_submissions"]) == unvouched
            slashed = {s for e in entries(server, "slash") for s in e["body"]["submission_ids"]}
            assert slashed >= unvouched  # their locked credit is taken back too
            after = trainer.batch(POOL, step=0, holder="u" * 32)
            assert not {s.submission_id for s in after.submissions} & set(mine)
            if unvouched:
                break
        assert unvouched
        assert _banned(trainer, honest) is False

        # anyone holding the ledger recomputes every choice once the epoch's secret is revealed
        trainer.set_version(POOL, 1)
        report = verify_lines(export_lines(read_entries(server.ctx.engine)), orch.public_key_hex)
        assert report.ok, report.reason
        assert report.spot_checks_verified == len(entries(server, "submission"))
        assert report.spot_checks_unrevealed == 0
        audit(server.ctx.engine, orch.public_key_hex)


# --- what the worker sees --------------------------------------------------------------------


def test_the_worker_is_not_told_which_submissions_are_checked(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.5, check_rate_decay=0.0)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        submit(node)
        judge_all(checker)  # one pass: the rate is now the 0.5 floor
        receipts = [submit(node) for _ in range(40)]
        checked = {
            e["body"]["submission_id"]: e["body"]["check"]["checked"]
            for e in entries(server, "submission")
        }
        kinds = {checked[r.submission_id] for r in receipts}
        assert kinds == {True, False}  # both happened ...
        # ... and the receipts look alike: same status, and nothing else differs by kind
        assert {r.status for r in receipts} == {"pending"}
        assert {tuple(sorted(r.model_dump())) for r in receipts} == {
            ("status", "submission_id", "tokens")
        }
        # the public ledger holds only the commitment of the secret that decides, not the secret
        commit = entries(server, "assignment_commit")[-1]["body"]
        assert not entries(server, "assignment_reveal")
        secret = (
            server.ctx.engine.connect()
            .execute(sa.select(db.assignment_secrets.c.secret))
            .scalar_one()
        )
        assert secret not in str(read_entries(server.ctx.engine)) and commit["commitment"]


# --- rates fall and rise ---------------------------------------------------------------------


def climb_to_the_floor(node: PoolClient, checker: PoolClient) -> tuple[list[float], int]:
    """Honest units judged until four checks passed; the rates they must have been drawn at
    (1, .5, .25, .125 at floor .1 and decay .5) and the clean record reached."""
    want, clean = [], 0
    while clean < 4:
        want.append(check_rate(clean, 0.1, 0.5))
        submit(node)
        clean += len(judge_all(checker))
    return want, clean


def test_rate_falls_with_each_passed_check_and_returns_to_one_after_a_failure(db_url, tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.1, check_rate_decay=0.5)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        want, clean = climb_to_the_floor(node, checker)
        while True:  # falsify until a check catches it
            want.append(check_rate(clean, 0.1, 0.5))
            sid = submit(node, falsified=True).submission_id
            if judge_all(checker):
                break
        rates = [e["body"]["check"]["rate"] for e in entries(server, "submission")]
        assert rates == want
        assert rates[:2] == [1.0, 0.5] and 0.1 in rates  # fell to the floor on a clean record
        assert statuses(server)[sid] == "rejected"
        with server.ctx.engine.connect() as conn:  # back to 1 (the failure also banned it)
            assert spotcheck.node_rate(conn, spec, key.node_id) == 1.0
        assert {v.state for v in PoolClient(server.url, owner).nodes(POOL)} == {"banned"}


def test_a_soft_drop_is_no_failed_check_and_leaves_the_rate(db_url, tmp_path):
    """A unit dropped without blame (the validator cannot replay its version) neither passes
    nor fails a check: the node's rate stays where its clean record put it."""
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.1, check_rate_decay=0.5)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        want, clean = climb_to_the_floor(node, checker)
        while True:  # honest units until one is checked; it is dropped softly
            want.append(check_rate(clean, 0.1, 0.5))
            sid = submit(node).submission_id
            claimed = checker.claim(POOL, limit=256)
            if claimed:
                break
        gone = Verdict(
            submission_id=claimed[0].submission_id,
            accept=False,
            severity="soft",
            reasons=["cannot be replayed: version 0 is gone"],
            measured_tokens=0,
        )
        assert checker.verdict(POOL, gone).status == "rejected"
        submit(node)
        want.append(check_rate(clean, 0.1, 0.5))
        rates = [e["body"]["check"]["rate"] for e in entries(server, "submission")]
        assert rates == want and rates[-1] == 0.1  # still at the floor, not back to 1
        assert statuses(server)[sid] == "rejected"
        assert {v.state for v in PoolClient(server.url, owner).nodes(POOL)} == {"healthy"}
        report = verify_lines(export_lines(read_entries(server.ctx.engine)), orch.public_key_hex)
        assert report.ok, report.reason  # the ledger re-derives the same rates
        audit(server.ctx.engine, orch.public_key_hex)


# --- quorum ----------------------------------------------------------------------------------


def test_a_quorum_of_two_decides_a_disputed_verdict(db_url, tmp_path):
    orch, owner, va, vb, honest_key, cheat_key = (KeyPair.generate() for _ in range(6))
    spec = make_spec(owner, [va, vb], quorum=2)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        a, b = PoolClient(server.url, va), PoolClient(server.url, vb)
        trainer = PoolClient(server.url, owner)
        honest, cheater = PoolClient(server.url, honest_key), PoolClient(server.url, cheat_key)
        for node in (honest, cheater):
            node.join(POOL, CPU_NODE)
        good = submit(honest).submission_id
        bad = submit(cheater, falsified=True).submission_id
        claimed = {p.submission_id: p for p in a.claim(POOL)}
        assert set(claimed) == {good, bad}
        # validator a wrongly rejects the honest unit, rightly rejects the falsified one
        wrong = replay(claimed[good]).model_copy(
            update={"accept": False, "reasons": ["spurious"], "behaviour_logprobs": None}
        )
        assert a.verdict(POOL, wrong).status == "disputed"
        assert a.verdict(POOL, replay(claimed[bad])).status == "disputed"
        with pytest.raises(Conflict):  # one vote per validator
            a.verdict(POOL, replay(claimed[bad]))
        assert a.claim(POOL) == []  # a does not get back what it voted on
        states = {v.node_id: v.state for v in trainer.nodes(POOL)}
        assert set(states.values()) == {"healthy"}  # nobody is punished on one vote
        assert trainer.batch(POOL, step=0).submissions == []  # nor is disputed work trained
        second = {p.submission_id: p for p in b.claim(POOL)}
        assert set(second) == {good, bad}
        assert b.verdict(POOL, replay(second[good])).status == "accepted"  # 1 of 2: not enough
        assert b.verdict(POOL, replay(second[bad])).status == "rejected"  # 2 of 2 reject
        states = {v.node_id: v.state for v in trainer.nodes(POOL)}
        assert states == {honest_key.node_id: "healthy", cheat_key.node_id: "banned"}
        assert [s.submission_id for s in trainer.batch(POOL, step=0).submissions] == [good]
        assert len(entries(server, "vote")) == 4 and len(entries(server, "verdict")) == 2
        audit(server.ctx.engine, orch.public_key_hex)  # tables agree with the ledger


def test_a_quorum_larger_than_the_validators_is_refused(tmp_path):
    orch, owner, va = (KeyPair.generate() for _ in range(3))
    with local_orchestrator(tmp_path / "run", orch) as server:
        with pytest.raises(Invalid, match="quorum 2"):
            PoolClient(server.url, orch).create_pool(make_spec(owner, [va], quorum=2))


# --- peers misbehaving, and the ledger as the record -----------------------------------------


def test_verdicts_on_unchecked_or_settled_work_are_refused_and_change_nothing(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.0, check_rate_decay=0.0)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        first = submit(node).submission_id
        [p] = checker.claim(POOL)
        checker.verdict(POOL, replay(p))
        later = submit(node).submission_id  # rate 0 now: unchecked
        assert statuses(server)[later] == "unchecked"
        for target in (later, first):
            for accept in (True, False):
                v = Verdict(
                    submission_id=target,
                    accept=accept,
                    measured_tokens=0,
                    behaviour_logprobs=[[-1.0, -1.0]] if accept else None,
                )
                with pytest.raises(Conflict):
                    checker.verdict(POOL, v)
        assert statuses(server) == {first: "accepted", later: "unchecked"}
        audit(server.ctx.engine, orch.public_key_hex)


def test_an_unchecked_unit_made_trainable_behind_the_ledgers_back_stops_the_orchestrator(
    tmp_path,
):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.0, check_rate_decay=0.0)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        submit(node)
        judge_all(checker)
        later = submit(node).submission_id
        engine = server.ctx.engine
        with engine.begin() as conn:
            conn.execute(
                db.submissions.update()
                .where(db.submissions.c.submission_id == later)
                .values(status="accepted")
            )
        with pytest.raises(LedgerMismatch, match="never released"):
            audit(engine, orch.public_key_hex)


def test_a_ledger_that_misstates_a_selection_does_not_reverify(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    spec = make_spec(owner, [validator], validated_fraction=0.5, check_rate_decay=0.5)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        for _ in range(12):
            submit(node)
            judge_all(checker)
        PoolClient(server.url, owner).set_version(POOL, 1)  # reveals the epoch's secret
        log = read_entries(server.ctx.engine)
    replay_ok = SpotCheckReplay()
    assert not any(replay_ok.feed(e) for e in log) and not replay_ok.finish()
    assert replay_ok.verified == 12
    subs = [i for i, e in enumerate(log) if e["kind"] == "submission"]
    for i, change in ((subs[-1], "checked"), (subs[-1], "rate"), (subs[0], "epoch")):
        forged = copy.deepcopy(log)
        check = forged[i]["body"]["check"]
        check[change] = not check["checked"] if change == "checked" else check[change] + 1
        spot = SpotCheckReplay()
        reasons = [r for e in forged if (r := spot.feed(e))] + [spot.finish()]
        assert any(reasons), change


def test_odd_spot_check_fields_are_a_reason_not_a_crash():
    spot = SpotCheckReplay()
    created = {"kind": "pool_created", "pool_id": POOL, "node_id": None, "seq": 0}
    assert spot.feed({**created, "body": {"spec": {"validators": ["v"]}}}) == ""
    sub = {"kind": "submission", "pool_id": POOL, "node_id": "n", "seq": 1}
    for check in ({"epoch": "x", "rate": 1.0, "checked": True}, [], "\ud800", {"epoch": None}):
        assert spot.feed({**sub, "body": {"submission_id": "s", "check": check}})  # a reason
    release = {"kind": "release", "pool_id": POOL, "node_id": "n", "seq": 2}
    assert spot.feed({**release, "body": {"by": "s", "submission_ids": 5}})


def test_a_check_that_releases_unchecked_work_is_claimed_before_older_ones(db_url, tmp_path):
    """Among fresh pending submissions a validator gets first the one whose passed check
    releases its node's earlier unchecked work (older, nearer to going stale), even when
    another node's pending submission arrived before it."""
    orch, owner, validator, early, other = (KeyPair.generate() for _ in range(5))
    spec = make_spec(owner, [validator], validated_fraction=0.1, check_rate_decay=0.5)
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(db_url=db_url)) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, early), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        climb_to_the_floor(node, checker)  # its rate is now 0.1: most units go unchecked

        def status_of_next(client: PoolClient) -> tuple[str, str]:
            sid = submit(client).submission_id
            return sid, statuses(server)[sid]

        while status_of_next(node)[1] != "unchecked":
            judge_all(checker)  # a checked one before any unchecked one releases nothing
        newcomer = PoolClient(server.url, other)
        newcomer.join(POOL, CPU_NODE)
        first = submit(newcomer).submission_id  # a new node's rate is 1: checked
        assert statuses(server)[first] == "pending"
        releasing, status = status_of_next(node)
        while status != "pending":
            releasing, status = status_of_next(node)
        assert [p.submission_id for p in checker.claim(POOL, limit=1)] == [releasing]
        assert [p.submission_id for p in checker.claim(POOL, limit=2)] == [releasing, first]
