"""Joining costs something: new identities are admitted at a bounded rate per pool, label
sizes are bounded, and a node's first submissions are all checked (probation)."""

import pytest

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import RateLimited
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import NodeMetadata, PoolSpec
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator

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
