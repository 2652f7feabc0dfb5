"""Every form ``Sample.proof`` allows is judged as the bundle it carries, end to end: a worker
proves a real unit on a tiny model, sends the bundle as a JSON object or as hex, the pool stores
it, a validator claims it and replays it. An honest unit is accepted in either form; hex that
spells no bundle is a rejection that says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.protocol.proofs import proof_to_wire
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge
from swarmrl.roles.worker.rollouts import generate_unit
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator
from swarmrl.toploc.bundle import build_bundles

POOL = "forms"
DIGEST = "ab" * 32


def _through_the_pool(tmp_path: Path, tiny_arith, encode) -> tuple[list[str], str, bool]:
    """One unit proved by a worker, its proofs sent as ``encode(bundle)`` returns them, stored by
    a real orchestrator, claimed and judged by a validator; (reasons, node state, trainable)."""
    config, env, tokenizer, model = tiny_arith
    orch, owner, validator, worker = (KeyPair.generate() for _ in range(4))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=20,
        samples_per_task=2,
        open=True,
        sampling=SamplingParams(max_new_tokens=6),
        validators=[validator.public_key_hex],
    )
    engine = TorchEngine(model, tokenizer)

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [encode(b) for b in bundles]

    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node = PoolClient(server.url, worker)
        node.join(POOL, CPU_NODE)
        work = node.lease(POOL).work
        samples = generate_unit(engine, env, tokenizer, work, 0, prove)
        node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))
        checker = PoolClient(server.url, validator)
        (pending,) = checker.claim(POOL)
        verdict = judge(pending, env, versions.__getitem__, config.toploc).verdict
        assert verdict is not None
        checker.verdict(POOL, verdict)
        trainer = PoolClient(server.url, owner)
        (state,) = [n.state for n in trainer.nodes(POOL)]
        trained = trainer.batch(POOL, step=0).submissions
        return verdict.reasons, state, bool(trained)


@pytest.mark.parametrize("form", ["json", "hex"])
def test_an_honest_unit_is_accepted_in_every_proof_form(tmp_path, tiny_arith, form):
    reasons, state, trained = _through_the_pool(
        tmp_path, tiny_arith, lambda b: proof_to_wire(b, form)
    )
    assert reasons == []
    assert state == "healthy"
    assert trained


def test_hex_that_spells_no_bundle_is_rejected_with_its_reason(tmp_path, tiny_arith):
    reasons, state, trained = _through_the_pool(
        tmp_path,
        tiny_arith,
        lambda b: proof_to_wire(b, "hex")[:-8],  # the bundle's JSON cut short
    )
    assert reasons and "ProofBundle invalid" in reasons[0]
    assert state == "banned"  # a peer's malformed proof, named as such
    assert not trained
