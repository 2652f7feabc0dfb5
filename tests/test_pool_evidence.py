"""The pool keeps each node's evidence: measurements that two validators post with their
verdicts add to one record per node in the database, a restarted orchestrator goes on from it,
the unit that takes it past the limit is rejected (hard, the node banned), ``ledger verify``
re-derives it, and measurements out of bounds are refused with a 422 in the pool's error form."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from swarmrl.cli import main as swarmrl_main
from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.ledger.chain import Ledger
from swarmrl.ledger.export import open_ledger_db, write_export
from swarmrl.ledger.verify import verify_export
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "ev"
OFF = {"logprobs": 0.9, "mantissa": 0.3}  # S(logprobs) grows 0.4 a unit: past 5 at the 13th
FAIR = {"logprobs": 0.3, "mantissa": 0.2, "exponents": 0.1}  # below the drift: S stays 0


def _spec(owner: KeyPair, validators: list[KeyPair], **extra) -> PoolSpec:
    return PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=50,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[v.public_key_hex for v in validators],
        validated_fraction=1.0,  # every unit is checked
        **extra,
    )


def _submit(url: str, node: KeyPair) -> str:
    client = PoolClient(url, node)
    client.heartbeat(POOL, Heartbeat(status="ok"))  # a slow loop outlasts a beat
    reply = client.lease(POOL)
    assert reply.work is not None, reply.reason
    work = reply.work
    sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    return client.submit(POOL, sub).submission_id


def _accept(url: str, validator: KeyPair, sid: str, measures: dict[str, float]):
    """``validator`` claims submission ``sid`` and accepts it with ``measures``; the receipt."""
    checker = PoolClient(url, validator)
    (pending,) = [p for p in checker.claim(POOL) if p.submission_id == sid]
    verdict = Verdict(
        submission_id=sid,
        accept=True,
        measured_tokens=sum(len(s.output_tokens) for s in pending.samples),
        behaviour_logprobs=[s.logprobs for s in pending.samples],
        evidence=measures,
    )
    return checker.verdict(POOL, verdict)


def test_two_validators_add_to_one_record_that_a_restart_keeps(tmp_path, db_url, capsys):
    orch, owner, va, vb, off, fair = (KeyPair.generate() for _ in range(6))
    config = PoolConfig(db_url=db_url) if db_url else None
    receipts = []
    for part, units in enumerate((range(0, 6), range(6, 16))):  # a restart between the parts
        with local_orchestrator(tmp_path / "run", orch, config) as server:
            if part == 0:
                PoolClient(server.url, orch).create_pool(_spec(owner, [va, vb]))
                for key in (off, fair):
                    PoolClient(server.url, key).join(POOL, CPU_NODE)
            for n in units:
                validator = (va, vb)[n % 2]  # each validator judges every other unit
                if n < 13:
                    receipts.append(_accept(server.url, validator, _submit(server.url, off), OFF))
                _accept(server.url, (vb, va)[n % 2], _submit(server.url, fair), FAIR)
            trainer = PoolClient(server.url, owner)
            states = {n.node_id: n.state for n in trainer.nodes(POOL)}
            trained = {s.node_id for s in trainer.batch(POOL, step=0, limit=64).submissions}
    assert [r.status for r in receipts] == ["accepted"] * 12 + ["rejected"]
    assert receipts[-1].credited_tokens == 0
    (reason,) = receipts[-1].reasons
    assert reason.startswith("evidence: logprobs consistently off over 13 accepted units")
    assert states == {off.node_id: "banned", fair.node_id: "healthy"}
    assert trained == {fair.node_id}  # the banned node's accepted work was dropped untrained

    engine = open_ledger_db(db_url or sqlite_url(tmp_path / "run" / "pool.db"))
    with engine.connect() as conn:
        rows = conn.execute(sa.select(db.node_evidence)).all()
    engine_out = tmp_path / "ledger.jsonl"
    write_export(engine, engine_out)
    engine.dispose()
    record = {(r.node_id, r.measure): (r.units, r.value) for r in rows}
    assert record[(off.node_id, "logprobs")] == (13, pytest.approx(5.2))
    assert record[(off.node_id, "mantissa")] == (13, 0.0)
    assert record[(fair.node_id, "exponents")] == (16, 0.0)
    report = verify_export(engine_out, orch.public_key_hex)
    assert report.ok, report.reason
    assert (report.evidence_verdicts, report.evidence_flagged) == (13 + 16, 1)
    assert report.contributions[off.node_id].banned
    argv = ["ledger", "verify", str(engine_out), "--orchestrator-key", orch.public_key_hex]
    assert swarmrl_main(argv) == 0
    assert "evidence: 29 verdicts' measurements re-derive" in capsys.readouterr().out


@pytest.fixture
def pool(tmp_path):
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(_spec(owner, [validator]))
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        yield server, validator, node, tmp_path / "run" / "pool.db"


@pytest.mark.parametrize(
    ("evidence", "accept"),
    [
        ('{"logprobs": NaN}', True),
        ('{"logprobs": Infinity}', True),
        ('{"logprobs": -0.1}', True),
        ('{"logprobs": 1e300}', True),
        ('{"logprobs": 2.01}', True),
        ('{"speed": 0.1}', True),
        ("[0.1, 0.2]", True),
        ('{"logprobs": 0.1}', False),  # measurements come with acceptances only
    ],
)
def test_measurements_out_of_bounds_are_refused_and_leave_the_record(pool, evidence, accept):
    server, validator, node, db_path = pool
    sid = _submit(server.url, node)
    (pending,) = PoolClient(server.url, validator).claim(POOL)
    verdict = {
        "submission_id": sid,
        "accept": accept,
        "measured_tokens": 2 if accept else 0,
        "behaviour_logprobs": [s.logprobs for s in pending.samples] if accept else None,
        "evidence": "@EVIDENCE@",
    }
    body = json.dumps(verdict).replace('"@EVIDENCE@"', evidence).encode()
    path = f"/pools/{POOL}/verdicts"
    headers = sign_request(validator, "POST", path, body) | {"Content-Type": "application/json"}
    answer = httpx.post(server.url + path, content=body, headers=headers, timeout=30)
    assert answer.status_code == 422, answer.text
    assert set(answer.json()) == {"error"} and answer.json()["error"]["message"]
    engine = make_engine(sqlite_url(db_path))
    with engine.connect() as conn:
        assert conn.execute(sa.select(db.node_evidence)).all() == []
    engine.dispose()
    receipt = _accept(server.url, validator, sid, {"logprobs": 0.1})  # still pending, judged
    assert receipt.status == "accepted"


def _signed_ledger(
    tmp_path: Path, story: list[tuple[str, dict]], **spec_extra
) -> tuple[KeyPair, Path]:
    """An export of a ledger signed by a fresh orchestrator key: a pool whose evidence limit is
    1 (drift 0.5; ``spec_extra`` added to its spec), then ``story``'s (kind, body) entries of
    one node."""
    key = KeyPair.generate()
    engine = make_engine(sqlite_url(tmp_path / "l.db"))
    ledger = Ledger(key)
    spec = {"pool_id": "p", "evidence_drift": 0.5, "evidence_limit": 1.0, **spec_extra}
    with engine.begin() as conn:
        ledger.append(conn, "pool_created", {"spec": spec}, pool_id="p")
        for kind, body in story:
            ledger.append(conn, kind, body, pool_id="p", node_id="a" * 32)
    out = tmp_path / "ledger.jsonl"
    write_export(engine, out)
    engine.dispose()
    return key, out


def _verdict(sid: str, accept: bool, x: float) -> tuple[str, dict]:
    reasons = [] if accept else ["evidence: logprobs consistently off"]
    body = {"submission_id": sid, "accept": accept, "severity": "hard", "reasons": reasons,
            "measured_tokens": 0, "evidence": {"logprobs": x}}  # fmt: skip
    return "verdict", body


BAN = ("invalidation", {"severity": "hard", "reason": "evidence", "submission_id": "s2"})


@pytest.mark.parametrize(
    ("story", "wrong"),
    [
        # S = 0.75, then 1.5 > 1: the second unit flags the node
        ([_verdict("s1", True, 1.25), _verdict("s2", False, 1.25), BAN], None),
        (
            [_verdict("s1", True, 1.25), _verdict("s2", True, 1.25)],
            "verdict accepts submission s2 of node",
        ),
        ([_verdict("s1", False, 1.25)], "does not pass the limit"),
        ([_verdict("s1", True, 1.25), _verdict("s2", False, 1.25)], "is not banned"),
    ],
    ids=["consistent", "flagged-but-accepted", "rejected-without-evidence", "flagged-never-banned"],
)
def test_ledger_verify_re_derives_each_nodes_evidence(tmp_path, story, wrong):
    key, out = _signed_ledger(tmp_path, story)
    report = verify_export(out, key.public_key_hex)
    if wrong is None:
        assert report.ok, report.reason
        assert (report.evidence_verdicts, report.evidence_flagged) == (2, 1)
    else:
        assert not report.ok
        assert wrong in report.reason


def test_ledger_verify_takes_each_measures_own_limit_from_the_spec(tmp_path):
    """``evidence_measure_limits`` gives log-probs a limit of 3: two units at S 0.75 and 1.5
    accepted are consistent with it (they would not be at the pool's limit of 1), and the fourth
    (S 3.0) is not yet past it."""
    story = [_verdict(f"s{n}", True, 1.25) for n in range(1, 5)]
    key, out = _signed_ledger(tmp_path, story, evidence_measure_limits={"logprobs": 3.0})
    report = verify_export(out, key.public_key_hex)
    assert report.ok, report.reason
    assert (report.evidence_verdicts, report.evidence_flagged) == (4, 0)
    (tmp_path / "five").mkdir()
    key, out = _signed_ledger(tmp_path / "five", [*story, _verdict("s5", True, 1.25)],
                              evidence_measure_limits={"logprobs": 3.0})  # fmt: skip
    report = verify_export(out, key.public_key_hex)
    assert not report.ok and "verdict accepts submission s5 of node" in report.reason


def test_a_measure_with_a_limit_of_its_own_flags_the_node_by_it(tmp_path):
    """A pool whose spec gives the mantissa a limit of 0.5 (the others keep 5): a node whose
    mantissa sits at 0.9 (S 0.4, then 0.8) is rejected at its second unit for it."""
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    spec = _spec(owner, [validator], evidence_measure_limits={"mantissa": 0.5})
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        measures = {"logprobs": 0.9, "mantissa": 0.9}
        receipts = [_accept(server.url, validator, _submit(server.url, node), measures)]
        receipts.append(_accept(server.url, validator, _submit(server.url, node), measures))
        states = {n.node_id: n.state for n in PoolClient(server.url, owner).nodes(POOL)}
    assert [r.status for r in receipts] == ["accepted", "rejected"]
    (reason,) = receipts[-1].reasons
    assert reason.startswith("evidence: mantissa consistently off over 2 accepted units"), reason
    assert "> 0.5 at drift 0.5" in reason
    assert states[node.node_id] == "banned"


def test_a_measure_at_a_limit_of_0_is_recorded_and_never_judged(tmp_path):
    """Below float32 the exponent share is recorded, not judged (``{exponents = 0}``): a node
    whose exponents sit at the cap for three units (S 1.5, 3, 4.5, past the pool's limit of 1)
    keeps every unit and its place, its record holds the sum, and ``ledger verify`` accepts
    the same story while a limit of its own of 2 would have flagged it."""
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    limits = {"exponents": 0.0}
    spec = _spec(owner, [validator], evidence_limit=1.0, evidence_measure_limits=limits)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        measures = {"logprobs": 0.1, "mantissa": 0.1, "exponents": 2.0}
        receipts = [
            _accept(server.url, validator, _submit(server.url, node), measures) for _ in range(3)
        ]
        states = {n.node_id: n.state for n in PoolClient(server.url, owner).nodes(POOL)}
        with server.ctx.engine.connect() as conn:
            rows = conn.execute(sa.select(db.node_evidence)).mappings().all()
    assert [r.status for r in receipts] == ["accepted"] * 3
    assert states[node.node_id] != "banned"
    (row,) = [r for r in rows if r["measure"] == "exponents"]
    assert row["units"] == 3 and row["value"] == pytest.approx(4.5)

    story = [_verdict(f"s{n}", True, 0.1) for n in range(1, 4)]
    for _, body in story:
        body["evidence"] = {"logprobs": 0.1, "exponents": 2.0}
    key, out = _signed_ledger(tmp_path, story, evidence_measure_limits=limits)
    report = verify_export(out, key.public_key_hex)
    assert report.ok and (report.evidence_verdicts, report.evidence_flagged) == (3, 0)
    (tmp_path / "judged").mkdir()
    key, out = _signed_ledger(
        tmp_path / "judged", story, evidence_measure_limits={"exponents": 2.0}
    )
    report = verify_export(out, key.public_key_hex)
    assert not report.ok and "verdict accepts submission s2 of node" in report.reason


@pytest.mark.parametrize(
    "field",
    [
        '"evidence_measure_limits": {"mantissa": NaN}',
        '"evidence_measure_limits": {"mantissa": Infinity}',
        '"evidence_measure_limits": {"mantissa": -1}',
        '"evidence_measure_limits": {"mantissa": 1e300}',
        '"evidence_measure_limits": {"speed": 1}',
        '"evidence_measure_limits": {"mantissa\\u0000": 1}',
        '"evidence_measure_limits": {"\\ud800": 1}',
        '"evidence_measure_limits": {"mantissa": {"mantissa": 1}}',
        '"evidence_measure_limits": [1, 2]',
        '"evidence_scale": NaN',
        '"evidence_scale": -1',
        '"evidence_scale": 1e9',
    ],
)
def test_a_spec_with_evidence_settings_out_of_bounds_is_refused_and_no_pool_made(tmp_path, field):
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = _spec(owner, [validator]).model_dump(mode="json")
    spec.pop("evidence_measure_limits")
    spec.pop("evidence_scale")
    body = (json.dumps(spec)[:-1] + ", " + field + "}").encode()
    with local_orchestrator(tmp_path / "run", orch) as server:
        headers = sign_request(orch, "POST", "/pools", body) | {"Content-Type": "application/json"}
        answer = httpx.post(server.url + "/pools", content=body, headers=headers, timeout=30)
        assert answer.status_code == 422, answer.text
        assert set(answer.json()) == {"error"} and answer.json()["error"]["message"]
        assert PoolClient(server.url, orch).pools() == []
