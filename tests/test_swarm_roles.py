"""Worker generation and validator judgement, in process, on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.envs import build_env
from swarmrl.errors import VersionGone
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import create_tiny_model
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import WorkUnit
from swarmrl.protocol.seeds import sample_seed
from swarmrl.protocol.verdicts import PendingSubmission
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge
from swarmrl.roles.worker.rollouts import corrupt_weights, generate_unit
from swarmrl.toploc.bundle import build_bundles

DIGEST = "ab" * 32


def _work(tasks: list[int], g: int = 3) -> WorkUnit:
    return WorkUnit(
        lease_id="l1", pool_id="swarm", node_id="n" * 32, task_indices=tasks, samples_per_task=g,
        sampling=SamplingParams(max_new_tokens=6), seed=12345, min_version=0, deadline=1e12,
        origin_node_id="n" * 32, origin_counter=0,
    )  # fmt: skip


def _submit(tiny_arith, state_dict=None, tasks=(5, 17)):
    config, env, tokenizer, model = tiny_arith
    worker = KeyPair.generate()
    engine = TorchEngine(create_tiny_model(config.model.tiny, tokenizer), tokenizer)
    engine.load_state_dict(state_dict or model.state_dict())

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    work = _work(list(tasks))
    samples = generate_unit(engine, env, tokenizer, work, 0, prove)
    pending = PendingSubmission(
        submission_id="s1", node_id=worker.node_id, node_key=worker.public_key_hex,
        request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
        request_nonce="0" * 32, work=work, samples=samples,
    )  # fmt: skip
    versions = {0: LoadedVersion(0, DIGEST, TorchEngine(model, tokenizer), tokenizer, Path("."))}
    return pending, versions.__getitem__, config


def test_samples_follow_the_lease_and_seed_rule(tiny_arith):
    pending, _, _ = _submit(tiny_arith)
    assert [s.task_index for s in pending.samples] == [5, 5, 5, 17, 17, 17]
    seeds = [s.proof["seed"] for s in pending.samples]
    assert seeds == [sample_seed(12345, i) for i in range(6)]


def test_honest_submission_is_accepted_with_behaviour_logprobs(tiny_arith):
    pending, versions, config = _submit(tiny_arith)
    result = judge(pending, build_env(config.env), versions, config.toploc)
    assert result.verdict is not None and result.verdict.accept, result.verdict
    behaviour = result.verdict.behaviour_logprobs
    assert [len(b) for b in behaviour] == [len(s.output_tokens) for s in pending.samples]
    for b, s in zip(behaviour, pending.samples, strict=True):
        assert b == pytest.approx(s.logprobs, abs=1e-3)
    assert result.verdict.measured_tokens == sum(len(s.output_tokens) for s in pending.samples)


def test_corrupted_weights_are_rejected_hard(tiny_arith):
    _, _, _, model = tiny_arith
    pending, versions, config = _submit(tiny_arith, corrupt_weights(model.state_dict(), seed=1))
    result = judge(pending, build_env(config.env), versions, config.toploc)
    assert result.verdict is not None and not result.verdict.accept
    assert result.verdict.severity == "hard"
    assert any("hidden_states" in r or "sampling" in r for r in result.verdict.reasons)


def test_samples_for_other_tasks_are_rejected(tiny_arith):
    pending, versions, config = _submit(tiny_arith)
    swapped = [*pending.samples[3:], *pending.samples[:3]]  # answers task 17 where 5 was leased
    pending = pending.model_copy(update={"samples": swapped})
    result = judge(pending, build_env(config.env), versions, config.toploc)
    assert not result.verdict.accept
    assert "where the lease assigned 5" in result.verdict.reasons[0]


def test_a_submission_whose_version_was_pruned_everywhere_is_dropped_softly(tiny_arith):
    """Nobody can replay a pruned version: a soft drop (late), not a hang, a crash or a ban."""
    pending, _, config = _submit(tiny_arith)

    def pruned(version: int) -> LoadedVersion:
        raise VersionGone(f"v{version} has been pruned by every source that answered")

    result = judge(pending, build_env(config.env), pruned, config.toploc)
    assert result.verdict is not None and not result.verdict.accept
    assert result.verdict.severity == "soft"
    assert "v0 has been pruned" in result.verdict.reasons[0]


def test_a_soft_verdict_counts_as_expired_not_as_a_rejection():
    """The run's report blames a node only for hard rejections; a unit dropped softly (its
    version pruned before anyone could replay it) is counted apart, as expired."""
    from swarmrl.launch.facts import verdict_counts

    def verdict(node: str, accept: bool, severity: str = "hard") -> dict:
        return {
            "kind": "verdict",
            "node_id": node,
            "body": {"accept": accept, "severity": severity},
        }

    ledger = [
        verdict("a", True), verdict("a", False, "soft"), verdict("a", False, "soft"),
        verdict("b", False, "hard"), {"kind": "slash", "node_id": "b", "body": {}},
    ]  # fmt: skip
    counts = verdict_counts(ledger)
    outcomes = {
        n: {k: c[k] for k in ("accepted", "rejected", "expired")} for n, c in counts.items()
    }
    assert outcomes == {
        "a": {"accepted": 1, "rejected": 0, "expired": 2},
        "b": {"accepted": 0, "rejected": 1, "expired": 0},
    }
    assert counts["a"]["first_rejection"] == ""  # an expiry is no reason to blame a node
