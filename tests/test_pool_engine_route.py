"""A validator names the engine it replays on when it claims, and the pool hands it the units of
nodes that declared that engine, keeping another engine's units for that engine's validators
while one claims: a unit is measured against its own engine's (tight) honest means wherever the
pool has a validator of that engine, whatever engine a cheat chose to declare."""

import signal
import time

import httpx
import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import PeerError
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.protocol.pool import NodeMetadata, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import (
    NEVER_SILENT,
    local_orchestrator,
    spawn_orchestrator,
    synthetic_samples,
)

POOL = "route"


def _node(engine: str) -> NodeMetadata:
    return NodeMetadata(engine=engine, memory_gb=16.0, accelerator="cpu")


def _pool(server, orch, owner, validators) -> None:
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=40,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[v.public_key_hex for v in validators],
    )
    PoolClient(server.url, orch).create_pool(spec)


def _submit(server, key: KeyPair, engine: str, joined: set[str]) -> str:
    """One unit from ``key``'s node, which joins declaring ``engine`` first; its id."""
    node = PoolClient(server.url, key)
    if key.node_id not in joined:
        node.join(POOL, _node(engine))
        joined.add(key.node_id)
    work = node.lease(POOL).work
    sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    return node.submit(POOL, sub).submission_id


def _accept(server, validator: KeyPair, submission_id: str) -> None:
    client = PoolClient(server.url, validator)
    (pending,) = [p for p in client.claim(POOL) if p.submission_id == submission_id]
    logprobs = [s.logprobs for s in pending.samples]
    verdict = Verdict(
        submission_id=submission_id, accept=True, measured_tokens=2, behaviour_logprobs=logprobs
    )
    assert client.verdict(POOL, verdict).status == "accepted"


def _claimed(server, validator: KeyPair, engine: str | None) -> set[str]:
    return {p.submission_id for p in PoolClient(server.url, validator).claim(POOL, engine=engine)}


def test_each_unit_goes_to_a_validator_of_its_nodes_engine_while_one_claims(tmp_path, db_url):
    orch, owner, by_torch, by_vllm, by_any = (KeyPair.generate() for _ in range(5))
    torch_node, vllm_node, other_node = (KeyPair.generate() for _ in range(3))
    config = PoolConfig(db_url=db_url, cross_engine_after_s=1.0, **NEVER_SILENT)
    joined: set[str] = set()
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        _pool(server, orch, owner, [by_torch, by_vllm, by_any])
        trainer = PoolClient(server.url, owner)
        # both engines' validators are seen before any work arrives
        assert _claimed(server, by_torch, "torch") == set()
        assert _claimed(server, by_vllm, "vllm") == set()
        assert trainer.metrics(POOL).validators_by_engine == {"torch": 1, "vllm": 1}
        on_torch = _submit(server, torch_node, "torch", joined)
        on_vllm = _submit(server, vllm_node, "vllm", joined)
        on_other = _submit(server, other_node, "sglang", joined)  # no validator of its engine
        seen = trainer.metrics(POOL)
        assert seen.nodes_by_engine == {"sglang": 1, "torch": 1, "vllm": 1}
        assert seen.engines_without_validator == ["sglang"]
        # each validator is handed its own engine's unit and the unit no validator's engine
        # covers, never the other covered engine's
        assert _claimed(server, by_vllm, "vllm") == {on_vllm, on_other}
        assert _claimed(server, by_torch, "torch") == {on_torch}
        # a validator that names no engine is handed any unit, as before engines were named
        later_vllm = _submit(server, vllm_node, "vllm", joined)
        later_torch = _submit(server, torch_node, "torch", joined)
        assert _claimed(server, by_any, None) == {later_vllm, later_torch}
        # a unit that has waited cross_engine_after_s is open to any validator, own engine first
        third_vllm = _submit(server, vllm_node, "vllm", joined)
        assert _claimed(server, by_torch, "torch") == {on_torch}  # its own, re-claimed
        time.sleep(1.2)
        assert _claimed(server, by_torch, "torch") == {on_torch, third_vllm}
        # the ledger's verdict names the pairing whose honest means measured the unit
        for unit, judge in ((on_torch, by_torch), (third_vllm, by_torch), (on_vllm, by_vllm)):
            _accept(server, judge, unit)
        _accept(server, by_any, later_vllm)  # a validator that named no engine: no pairing
        verdicts = {
            e["body"]["submission_id"]: e["body"].get("pairing")
            for e in trainer.ledger()
            if e["kind"] == "verdict"
        }
        assert verdicts == {
            on_torch: "torch->torch",
            third_vllm: "vllm->torch",
            on_vllm: "vllm->vllm",
            later_vllm: None,
        }


def test_a_unit_whose_engines_validators_stopped_claiming_is_open_to_the_others(tmp_path):
    """Units of an engine whose validators have not claimed within claim_timeout_s go to any
    validator at once (they are not held cross_engine_after_s for a validator that is gone)."""
    orch, owner, by_torch, by_vllm, vllm_node = (KeyPair.generate() for _ in range(5))
    config = PoolConfig(cross_engine_after_s=3600, claim_timeout_s=1.0, **NEVER_SILENT)
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        _pool(server, orch, owner, [by_torch, by_vllm])
        assert _claimed(server, by_vllm, "vllm") == set()
        unit = _submit(server, vllm_node, "vllm", set())
        assert _claimed(server, by_torch, "torch") == set()  # the vLLM validator is seen
        owner_client = PoolClient(server.url, owner)
        assert owner_client.metrics(POOL).engines_without_validator == []
        time.sleep(1.2)
        assert _claimed(server, by_torch, "torch") == {unit}
        seen = owner_client.metrics(POOL)
        assert seen.validators_by_engine == {"torch": 1}
        assert seen.engines_without_validator == ["vllm"]
        scraped = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert (
            f'swarmrl_pool_engine_without_validator{{engine="vllm",pool="{POOL}"}} 1.0' in scraped
        )
        assert f'swarmrl_pool_engine_nodes{{engine="vllm",pool="{POOL}"}} 1.0' in scraped


def test_the_orchestrator_logs_an_engine_left_without_its_own_validator(tmp_path):
    """``swarmrl orchestrator`` as a process: a vLLM node while only a torch validator claims
    is logged once the gap has lasted cross_engine_after_s (not per refresh), and again when a
    vLLM validator claims."""
    orch, owner, by_torch, by_vllm, vllm_node, forger = (KeyPair.generate() for _ in range(6))
    key_file, spec_file = tmp_path / "orch.json", tmp_path / "spec.json"
    orch.save(key_file)
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=40,
        open=True,
        validators=[by_torch.public_key_hex, by_vllm.public_key_hex],
    )
    spec_file.write_text(spec.model_dump_json())
    settings = {"pool.cross_engine_after_s": 1.0}
    proc, url = spawn_orchestrator(tmp_path / "run", key_file, [spec_file], settings=settings)
    log = tmp_path / "run" / "orch.log"
    warning = f"pool {POOL}: nodes on engine vllm, but no validator on vllm has claimed for"
    again = f"pool {POOL}: engine vllm has a validator of its own again"
    try:
        PoolClient(url, vllm_node).join(POOL, _node("vllm"))
        PoolClient(url, forger).join(POOL, _node("x\n12:00:00 orchestrator: forged"))
        torch_validator = PoolClient(url, by_torch)
        deadline = time.monotonic() + 30
        while warning not in log.read_text():  # the status refresh runs every 2 s
            assert time.monotonic() < deadline, log.read_text()
            torch_validator.claim(POOL, engine="torch")
            time.sleep(0.5)
        PoolClient(url, by_vllm).claim(POOL, engine="vllm")
        while again not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert log.read_text().count(warning) == 1
    # a node's engine name is logged quoted: its line break cannot start a line of its own
    assert "engine 'x\\n12:00:00 orchestrator: forged'" in log.read_text()
    assert not any(line.startswith("12:00:00") for line in log.read_text().splitlines())


def test_a_crowd_of_engine_names_shows_as_the_most_common_few(tmp_path):
    """Nodes name their engine: in a pool that accepts any, 20 names from 21 identities give
    the metrics (and so the labels of /metrics and the orchestrator's warnings) 16 engines,
    the most common first."""
    orch, owner = KeyPair.generate(), KeyPair.generate()
    config = PoolConfig(join_burst=100, **NEVER_SILENT)
    with local_orchestrator(tmp_path / "run", orch, config) as server:
        _pool(server, orch, owner, [KeyPair.generate()])
        for i in range(20):
            PoolClient(server.url, KeyPair.generate()).join(POOL, _node(f"engine-{i:02d}"))
        PoolClient(server.url, KeyPair.generate()).join(POOL, _node("engine-19"))
        shown = PoolClient(server.url, owner).metrics(POOL).nodes_by_engine
    assert len(shown) == 16
    assert shown["engine-19"] == 2  # the most common, then the first names in order
    assert set(shown) == {"engine-19"} | {f"engine-{i:02d}" for i in range(15)}


def test_a_database_from_before_node_engines_gets_them_from_each_nodes_metadata(tmp_path):
    url = db.sqlite_url(tmp_path / "pool.db")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        for node_id, metadata in (("n-vllm", _node("vllm").model_dump_json()), ("n-odd", "{}")):
            conn.execute(
                db.nodes.insert(),
                dict(
                    pool_id=POOL,
                    node_id=node_id,
                    public_key="00" * 32,
                    state="healthy",
                    metadata=metadata,
                    joined_at=0.0,
                ),
            )
        conn.exec_driver_sql("ALTER TABLE nodes DROP COLUMN engine")
    engine.dispose()
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            rows = dict(conn.execute(sa.select(db.nodes.c.node_id, db.nodes.c.engine)).all())
        assert rows == {"n-vllm": "vllm", "n-odd": None}
    finally:
        engine.dispose()


def test_the_spec_gives_each_validator_its_engine_and_covers_every_engine(tmp_path):
    """``PoolSpec.validator_engines``: a pool whose accepted engines some engine of has no
    validator is refused; a validator's claim naming another engine than the spec's is a 422
    saying which; one naming none is routed by the spec's."""
    orch, owner, by_torch, by_vllm, vllm_node = (KeyPair.generate() for _ in range(5))
    both = {"engines": ["torch", "vllm"]}
    base = dict(pool_id=POOL, owner_key=owner.public_key_hex, task_count=40, open=True)
    base |= dict(sampling=SamplingParams(max_new_tokens=2), requirements=both)
    base |= dict(validators=[by_torch.public_key_hex, by_vllm.public_key_hex])
    with pytest.raises(ValidationError, match="accepts vllm but no validator"):
        PoolSpec(**base, validator_engines={by_torch.public_key_hex: "torch"})
    with pytest.raises(ValidationError, match="not validators"):
        PoolSpec(**base, validator_engines={"c" * 64: "vllm", by_torch.public_key_hex: "torch"})
    engines = {by_torch.public_key_hex: "torch", by_vllm.public_key_hex: "vllm"}
    with local_orchestrator(tmp_path / "run", orch, PoolConfig(**NEVER_SILENT)) as server:
        PoolClient(server.url, orch).create_pool(PoolSpec(**base, validator_engines=engines))
        with pytest.raises(PeerError, match=r"replays on 'vllm', but pool .* has it on 'torch'"):
            PoolClient(server.url, by_torch).claim(POOL, engine="vllm")
        assert _claimed(server, by_vllm, None) == set()  # seen, as the spec's vllm
        unit = _submit(server, vllm_node, "vllm", set())
        assert _claimed(server, by_torch, None) == set()  # routed as the spec's torch
        assert _claimed(server, by_vllm, None) == {unit}
