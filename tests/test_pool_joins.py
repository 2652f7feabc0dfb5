"""Joining costs something: new identities are admitted at a bounded rate per pool, label
sizes are bounded, and a new node's credit is held until its first checks pass (probation)."""

import time

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import RateLimited
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow.work import HELD_UNTIL
from swarmrl.pool.state import db
from swarmrl.protocol.pool import NodeMetadata, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "jn"


def advance(server, seconds):
    base = server.ctx.clock
    server.ctx.clock = lambda: base() + seconds


def test_fresh_identities_are_admitted_at_a_bounded_rate(tmp_path):
    orch, owner = KeyPair.generate(), KeyPair.generate()
    cfg = PoolConfig(join_rate_per_s=0.5, join_burst=3)
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        # the pool's clock stands still: a loaded machine taking 2 s over these joins would
        # otherwise refill a token (the bucket lives in the database and reads this clock)
        frozen = time.time()
        server.ctx.clock = lambda: frozen
        first = [KeyPair.generate() for _ in range(3)]
        for key in first:
            PoolClient(server.url, key).join(POOL, CPU_NODE)
        with pytest.raises(RateLimited, match="try again in"):
            PoolClient(server.url, KeyPair.generate()).join(POOL, CPU_NODE)
        PoolClient(server.url, first[0]).join(POOL, CPU_NODE)  # a member joining again is free
        advance(server, 2.1)  # one token back
        PoolClient(server.url, KeyPair.generate()).join(POOL, CPU_NODE)
        with pytest.raises(RateLimited):
            PoolClient(server.url, KeyPair.generate()).join(POOL, CPU_NODE)
        assert len(PoolClient(server.url, owner).nodes(POOL)) == 4


def test_labels_are_bounded():
    big = {f"k{i}": "v" for i in range(17)}
    for labels in (big, {"k": "v" * 257}, {"k" * 65: "v"}, {"": "v"}):
        with pytest.raises(ValueError):
            NodeMetadata(engine="torch", memory_gb=1, accelerator="cpu", labels=labels)


def test_a_new_node_has_its_credit_held_until_probation_passes(tmp_path):
    orch, owner, validator, key = (KeyPair.generate() for _ in range(4))
    cfg = PoolConfig(probation_submissions=2)
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=10,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
        check_rate_decay=1.0,  # every submission is checked (swarmrl.pool.flow.spotcheck)
        max_leases_in_flight=8,
    )
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node, checker = PoolClient(server.url, key), PoolClient(server.url, validator)
        node.join(POOL, CPU_NODE)
        admin = PoolClient(server.url, owner)

        def submit():
            work = node.lease(POOL).work
            return node.submit(
                POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )

        locked = []
        for _ in range(2):
            assert submit().status == "pending"
            [p] = checker.claim(POOL)
            lp = [s.logprobs for s in p.samples]
            checker.verdict(
                POOL,
                Verdict(
                    submission_id=p.submission_id,
                    accept=True,
                    measured_tokens=2,
                    behaviour_logprobs=lp,
                ),
            )
            with server.ctx.engine.connect() as conn:
                locked.append(
                    conn.execute(sa.select(sa.func.max(db.credits.c.unlock_at))).scalar_one()
                )
        assert locked[0] >= HELD_UNTIL  # held while on probation
        assert locked[1] < HELD_UNTIL  # released (into the normal lock) once it passed
        assert submit().status == "pending"  # checked: credited only by its verdict
        assert admin.metrics(POOL).credited_tokens == 4


def test_a_pool_made_from_a_config_admits_only_the_engines_its_verifier_measured(tmp_path):
    """``swarmrl pool spec`` and ``swarmrl run`` write the engines the run-start calibration
    measures (``toploc.engines``, else ``inference.backend``) as ``requirements.engines``: a node
    declaring another engine is refused at join, in the pool's words, before it takes a unit;
    a pool set to accept both engines admits both."""
    from swarmrl.config import EMBEDDED_DEFAULT, load_config
    from swarmrl.errors import Unauthorized
    from swarmrl.pool.spec_check import spec_from_config

    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    vllm_node = CPU_NODE.model_copy(update={"engine": "vllm"})
    torch_only = load_config([EMBEDDED_DEFAULT], ["env.size=3"])
    both = load_config([EMBEDDED_DEFAULT], ["env.size=3", 'toploc.engines=["torch","vllm"]'])
    with local_orchestrator(tmp_path, orch, PoolConfig(join_burst=8)) as server:
        for pool_id, config in (("t", torch_only), ("tv", both)):
            spec = spec_from_config(
                config, owner.public_key_hex, [validator.public_key_hex], pool_id
            )
            PoolClient(server.url, orch).create_pool(spec.model_copy(update={"open": True}))
        with pytest.raises(Unauthorized, match=r"engine 'vllm' not in \['torch'\]"):
            PoolClient(server.url, KeyPair.generate()).join("t", vllm_node)
        PoolClient(server.url, KeyPair.generate()).join("t", CPU_NODE)
        for node in (CPU_NODE, vllm_node):
            PoolClient(server.url, KeyPair.generate()).join("tv", node)
        assert len(PoolClient(server.url, owner).nodes("t")) == 1
        assert len(PoolClient(server.url, owner).nodes("tv")) == 2
