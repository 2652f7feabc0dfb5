"""Evidence that accumulates per node: a node whose every unit is slightly off passes each unit
alone and is still rejected once its record says so; an honest node never is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import UserError
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, PoolSpec, Submission, WorkUnit
from swarmrl.protocol.proofs import ChunkReport, ProofVerdict
from swarmrl.protocol.verdicts import PendingSubmission
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge
from swarmrl.roles.worker.rollouts import generate_unit
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator
from swarmrl.toploc.bundle import build_bundles
from swarmrl.toploc.evidence import REFERENCE_FLOOR, NodeEvidence, unit_measures
from swarmrl.toploc.evidence import units as evidence_units
from swarmrl.toploc.verify import Verifier

DIGEST = "ab" * 32


class ShiftedEngine:
    """A worker's engine whose reported log-probs are all ``shift`` nats off the model's, as a
    cheaper engine's would be, by less than the per-unit tolerance."""

    def __init__(self, engine: TorchEngine, shift: float) -> None:
        self.engine, self.shift = engine, shift

    def generate(self, prompts, params, seeds, *, return_hidden=False):
        gens = self.engine.generate(prompts, params, seeds, return_hidden=return_hidden)
        return [
            dataclasses.replace(g, logprobs=[lp - self.shift for lp in g.logprobs]) for g in gens
        ]


def _units_until_rejected(
    tiny_arith, shift: float, units: int, toploc: ToplocConfig | None = None
) -> tuple[int | None, list[str]]:
    """Judge up to ``units`` units of one node with a validator keeping evidence (``toploc``,
    else the config's); the number of the first rejected unit (1-based; None if none) and
    its reasons."""
    config, env, tokenizer, model = tiny_arith
    toploc = toploc or config.toploc
    worker = KeyPair.generate()
    engine = TorchEngine(model, tokenizer)
    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}
    evidence = NodeEvidence.from_config(toploc)

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    for n in range(units):
        work = WorkUnit(
            lease_id=f"l{n}", pool_id="swarm", node_id=worker.node_id,
            task_indices=[n % 40, (n + 7) % 40], samples_per_task=2,
            sampling=SamplingParams(max_new_tokens=6), seed=1000 + n, min_version=0,
            deadline=1e12, origin_node_id=worker.node_id, origin_counter=n,
        )  # fmt: skip
        samples = generate_unit(ShiftedEngine(engine, shift), env, tokenizer, work, 0, prove)
        pending = PendingSubmission(
            submission_id=f"s{n}", node_id=worker.node_id, node_key=worker.public_key_hex,
            request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
            request_nonce="0" * 32, work=work, samples=samples,
        )  # fmt: skip
        alone = judge(pending, env, versions.__getitem__, toploc).verdict
        assert alone is not None and alone.accept, alone  # each unit passes on its own
        verdict = judge(pending, env, versions.__getitem__, toploc, evidence).verdict
        if not verdict.accept:
            return n + 1, verdict.reasons
    return None, []


def test_a_node_whose_every_unit_is_slightly_off_is_rejected_within_20_units(tiny_arith):
    config = tiny_arith[0]
    shift = 0.8 * config.toploc.logprob_tolerance  # every unit passes alone
    rejected_at, reasons = _units_until_rejected(tiny_arith, shift, units=20)
    assert rejected_at is not None, "a node consistently off was accepted 20 units running"
    assert rejected_at > 5  # no single unit decides it
    assert reasons[0].startswith("evidence: logprobs consistently off")


def test_an_honest_node_gathers_no_evidence(tiny_arith):
    rejected_at, reasons = _units_until_rejected(tiny_arith, 0.0, units=30)
    assert rejected_at is None, reasons


def test_a_shift_small_against_the_thresholds_is_flagged_against_the_honest_means(tiny_arith):
    """Log-probs 0.2 tolerances off on every token: a fifth of the threshold, under the drift,
    so never flagged in threshold units; with the calibration's honest mean at 0.25 tolerances
    and ``evidence_scale`` 1, the same units sit at 0.8 honest means and the node is rejected
    once its record passes the limit (S = n x 0.3 > 5 at unit 17)."""
    base = tiny_arith[0].toploc
    shift = 0.2 * base.logprob_tolerance
    assert _units_until_rejected(tiny_arith, shift, units=20) == (None, [])
    means = {"logprobs": 0.25 * base.logprob_tolerance, "mantissa": 1.0, "exponents": 0.01}
    toploc = base.model_copy(update={"evidence_scale": 1.0, "evidence_reference": means})
    rejected_at, reasons = _units_until_rejected(tiny_arith, shift, units=20, toploc=toploc)
    assert rejected_at == 17, (rejected_at, reasons)
    assert reasons[0].startswith("evidence: logprobs consistently off over 17 accepted units")


def test_unit_measures_are_each_sample_normalised_by_its_threshold(tiny_arith):
    toploc = tiny_arith[0].toploc.model_copy(
        update={
            "logprob_tolerance": 0.01,
            "max_mantissa_mean": 10.0,
            "min_exponent_matches": 88,
            "topk": 128,
        }
    )  # fmt: skip  (40 exponent mismatches allowed per 128 compared)
    chunk = ChunkReport(index=0, compared=128, exp_mismatches=10, mant_err_mean=5.0,
                        mant_err_median=4.0, passed=True)  # fmt: skip
    verdict = ProofVerdict(accepted=True, behaviour_logprobs=[-1.0, -2.0], chunks=[chunk])
    # log-prob terms: 0.005 / 0.01 = 0.5 and 0.5 / 0.01 = 50, capped at 2 -> mean 1.25
    measures = unit_measures([verdict], [[-1.005, -2.5]], toploc)
    assert measures == pytest.approx({"logprobs": 1.25, "mantissa": 0.5, "exponents": 0.25})
    evidence = NodeEvidence(drift=0.5, limit=1.0)
    assert evidence.add("n", {"logprobs": 1.25}) is None  # S = 0.75
    assert evidence.add("n", {"logprobs": 0.2}) is None  # S = 0.45
    flagged = evidence.add("n", {"logprobs": 1.25})  # S = 1.2 > 1
    assert flagged is not None and "over 3 accepted units" in flagged
    assert evidence.add("m", {"logprobs": 1.25}) is None  # another node starts at 0


def test_in_reference_units_a_measure_counts_in_honest_means_never_finer_than_the_floor(
    tiny_arith,
):
    """``evidence_scale`` s > 0: one unit of a measure is s times the calibration's honest
    mean, but at least ``REFERENCE_FLOOR`` of its threshold (an exact engine's mean of 0 would
    make every rounding of another engine a shift); no reference is a one-line error, at the
    verifier's start."""
    thresholds = {"logprob_tolerance": 0.01, "max_mantissa_mean": 10.0,
                  "min_exponent_matches": 88, "topk": 128}  # fmt: skip
    reference = {"logprobs": 0.001, "mantissa": 1.0, "exponents": 0.0}
    toploc = tiny_arith[0].toploc.model_copy(
        update={**thresholds, "evidence_scale": 4.0, "evidence_reference": reference}
    )
    units = evidence_units(toploc)
    assert units == pytest.approx(
        {"logprobs": 0.004, "mantissa": 4.0, "exponents": REFERENCE_FLOOR * 40 / 128}
    )
    chunk = ChunkReport(index=0, compared=128, exp_mismatches=1, mant_err_mean=5.0,
                        mant_err_median=4.0, passed=True)  # fmt: skip
    verdict = ProofVerdict(accepted=True, behaviour_logprobs=[-1.0, -2.0], chunks=[chunk])
    # log-probs: 0.005 / 0.004 = 1.25 and 0.5 / 0.004 capped at 2; mantissa 5 / 4;
    # exponents (1 / 128) / 0.015625 = 0.5
    measures = unit_measures([verdict], [[-1.005, -2.5]], toploc)
    assert measures == pytest.approx({"logprobs": 1.625, "mantissa": 1.25, "exponents": 0.5})
    # the same unit in threshold units (scale 0), as before
    plain = unit_measures(
        [verdict], [[-1.005, -2.5]], toploc.model_copy(update={"evidence_scale": 0})
    )
    assert plain == pytest.approx({"logprobs": 1.25, "mantissa": 0.5, "exponents": 0.025})
    missing = toploc.model_copy(update={"evidence_reference": {"logprobs": 0.001}})
    with pytest.raises(UserError, match="mantissa"):
        unit_measures([verdict], [[-1.005, -2.5]], missing)
    with pytest.raises(UserError, match="evidence_reference"):
        Verifier(TorchEngine(tiny_arith[3], tiny_arith[2]), missing)


def test_two_validators_and_a_restarted_orchestrator_keep_one_record(tmp_path, tiny_arith):
    """The shifted worker's units go through a real orchestrator, restarted after 4 of them,
    and are judged by two validators in turn, each keeping nothing: the pool's one record of
    the node rejects it where one record over every verdict's measurements says, which neither
    validator's half of them would have."""
    config, env, tokenizer, model = tiny_arith
    orch, owner, worker = (KeyPair.generate() for _ in range(3))
    validators = [KeyPair.generate(), KeyPair.generate()]
    spec = PoolSpec(
        pool_id="evidence", owner_key=owner.public_key_hex, task_count=40, samples_per_task=2,
        open=True, sampling=SamplingParams(max_new_tokens=6), validated_fraction=1.0,
        validators=[v.public_key_hex for v in validators],
        evidence_drift=config.toploc.evidence_drift, evidence_limit=config.toploc.evidence_limit,
    )  # fmt: skip
    engine = TorchEngine(model, tokenizer)
    shifted = ShiftedEngine(engine, 0.8 * config.toploc.logprob_tolerance)
    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    measured, statuses, reasons = [], [], []
    for units in (range(4), range(4, 20)):  # the orchestrator restarts between the two
        with local_orchestrator(tmp_path / "run", orch) as server:
            if not measured:
                PoolClient(server.url, orch).create_pool(spec)
                PoolClient(server.url, worker).join("evidence", CPU_NODE)
            for n in units:
                if "rejected" in statuses:
                    break
                node = PoolClient(server.url, worker)
                node.heartbeat("evidence", Heartbeat(status="ok"))  # a slow loop outlasts a beat
                reply = node.lease("evidence")
                assert reply.work is not None, reply.reason
                work = reply.work
                samples = generate_unit(shifted, env, tokenizer, work, 0, prove)
                node.submit("evidence", Submission(lease_id=work.lease_id, samples=samples))
                checker = PoolClient(server.url, validators[n % 2])
                (pending,) = checker.claim("evidence")
                verdict = judge(pending, env, versions.__getitem__, config.toploc).verdict
                assert verdict is not None and verdict.accept, verdict  # passes on its own
                assert verdict.evidence is not None
                measured.append(verdict.evidence)
                receipt = checker.verdict("evidence", verdict)
                statuses.append(receipt.status)
                reasons += receipt.reasons
            (state,) = [v.state for v in PoolClient(server.url, owner).nodes("evidence")]
    assert "rejected" in statuses, "a node consistently off was accepted 20 units running"
    assert statuses == ["accepted"] * (len(statuses) - 1) + ["rejected"]
    assert 5 < len(measured) <= 20
    assert reasons[0].startswith("evidence: logprobs consistently off")
    assert state == "banned"

    def flagged_at(units) -> int | None:
        record = NodeEvidence.from_config(config.toploc)
        return next((i + 1 for i, m in enumerate(units) if record.add("n", m) is not None), None)

    assert flagged_at(measured) == len(measured)  # one record over both validators' units
    assert flagged_at(measured[0::2]) is None and flagged_at(measured[1::2]) is None


def test_a_unit_is_measured_against_the_honest_means_of_its_own_pairing(tmp_path, tiny_arith):
    """A calibration across engines records each pairing's honest means; a validator measures
    a unit against those of the engine its node declared at join (which the pool hands out
    with the claim) and its own engine, where they were recorded, and against the loosest
    pairing's otherwise, a measure at a time."""
    config, env, tokenizer, model = tiny_arith
    thresholds = {"logprob_tolerance": 0.01, "max_mantissa_mean": 10.0,
                  "min_exponent_matches": 88, "topk": 128}  # fmt: skip
    loosest = {"logprobs": 0.004, "mantissa": 2.0, "exponents": 0.02}
    pairings = {
        "torch->torch": {"logprobs": 0.001, "mantissa": 0.5, "exponents": 0.01},
        "vllm->torch": {"mantissa": 1.0},  # a measure it lacks: the loosest pairing's
    }
    toploc = config.toploc.model_copy(
        update={**thresholds, "evidence_scale": 2.0, "evidence_reference": loosest,
                "evidence_pairing_references": pairings}
    )  # fmt: skip
    assert evidence_units(toploc, "torch->torch") == pytest.approx(
        {"logprobs": 0.002, "mantissa": 1.0, "exponents": 0.02}
    )
    assert evidence_units(toploc, "vllm->torch") == pytest.approx(
        {"logprobs": 0.008, "mantissa": 2.0, "exponents": 0.04}
    )
    for unknown in ("torch->vllm", None):
        assert evidence_units(toploc, unknown) == evidence_units(toploc)
    assert evidence_units(toploc) == pytest.approx(
        {"logprobs": 0.008, "mantissa": 4.0, "exponents": 0.04}
    )
    for bad in ({"torch": loosest}, {"->torch": loosest}, {"torch->vllm": {"mantissa": -1.0}}):
        with pytest.raises(ValueError, match="pairing|finite"):
            ToplocConfig(evidence_pairing_references=bad)

    # through a real pool: the claim carries the engine the node joined with
    orch, owner, worker, validator = (KeyPair.generate() for _ in range(4))
    spec = PoolSpec(
        pool_id="pairs", owner_key=owner.public_key_hex, task_count=40, samples_per_task=2,
        open=True, sampling=SamplingParams(max_new_tokens=6), validated_fraction=1.0,
        validators=[validator.public_key_hex],
    )  # fmt: skip
    engine = TorchEngine(model, tokenizer)
    versions = {0: LoadedVersion(0, DIGEST, engine, tokenizer, Path("."))}

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node = PoolClient(server.url, worker)
        node.join("pairs", CPU_NODE)
        work = node.lease("pairs").work
        assert work is not None
        shifted = ShiftedEngine(engine, 0.3 * thresholds["logprob_tolerance"])
        samples = generate_unit(shifted, env, tokenizer, work, 0, prove)
        node.submit("pairs", Submission(lease_id=work.lease_id, samples=samples))
        (pending,) = PoolClient(server.url, validator).claim("pairs")
    assert CPU_NODE.engine == "torch" and pending.engine == "torch"
    own = judge(pending, env, versions.__getitem__, toploc, engine="torch").verdict
    cross = judge(pending, env, versions.__getitem__, toploc, engine="vllm").verdict
    unknown = judge(pending, env, versions.__getitem__, toploc).verdict
    assert own is not None and cross is not None and unknown is not None
    assert own.accept and cross.accept and unknown.accept
    assert own.evidence and cross.evidence == unknown.evidence  # no torch->vllm means: loosest
    # the same replay, measured in torch->torch's honest means: 4 times the log-prob distance
    # (a term capped at TOKEN_CAP aside) where the loosest pairing's would pass it
    assert own.evidence["logprobs"] > 2 * unknown.evidence["logprobs"] > 0
    assert own.evidence["logprobs"] <= 4 * unknown.evidence["logprobs"] + 1e-9
