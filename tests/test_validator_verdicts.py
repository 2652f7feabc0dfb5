"""A validator posts a batch's verdicts side by side: across a far link a batch costs one round
trip, not one per verdict; the answers come back in the verdicts' order, a refusal in its
place, and a peer that stays away is still raised."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarmrl.config.swarm import SwarmSection
from swarmrl.errors import PeerError, WaitTimeout
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict, VerdictReceipt
from swarmrl.roles.validator.process import post_verdicts
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "vv"
LOG = logging.getLogger("test")


class HeldTogether(PoolClient):
    """A real client whose verdicts wait at a barrier before they are sent: a batch posted one
    after another never gets past it (the barrier breaks after ``timeout`` s)."""

    def __init__(self, *args, parties: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.barrier = threading.Barrier(parties, timeout=10)

    def verdict(self, pool_id: str, verdict: Verdict) -> VerdictReceipt:
        self.barrier.wait()
        return super().verdict(pool_id, verdict)


def _submitted(server_url: str, nodes: int) -> list[str]:
    """One unit submitted by each of ``nodes`` fresh nodes; their submission ids."""
    ids = []
    for _ in range(nodes):
        node = PoolClient(server_url, KeyPair.generate())
        node.join(POOL, CPU_NODE)
        work = node.lease(POOL).work
        sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
        ids.append(node.submit(POOL, sub).submission_id)
    return ids


def test_a_batch_of_verdicts_is_posted_side_by_side_and_answered_in_order(tmp_path):
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=20,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
        validated_fraction=1.0,
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        ids = _submitted(server.url, 3)
        checker = HeldTogether(server.url, validator, parties=4)
        pending = {p.submission_id: p for p in checker.claim(POOL)}
        assert set(pending) == set(ids)
        verdicts = [
            Verdict(
                submission_id=sid,
                accept=True,
                measured_tokens=2,
                behaviour_logprobs=[s.logprobs for s in pending[sid].samples],
            )
            for sid in ids[:2]
        ]
        # a verdict on a unit that does not exist is refused by the pool: its refusal comes
        # back in its place, the others still recorded
        verdicts.insert(1, Verdict(submission_id="f" * 32, accept=True, measured_tokens=2))
        verdicts.append(
            Verdict(
                submission_id=ids[2],
                accept=False,
                reasons=["sampling replay mismatch"],
                measured_tokens=0,
            )
        )
        swarm = SwarmSection(give_up_s=5, retry_s=0.1)
        with ThreadPoolExecutor(4) as poster:
            answers = post_verdicts(checker, POOL, verdicts, poster, swarm, LOG)
        assert isinstance(answers[1], PeerError)
        assert [a.submission_id for a in (answers[0], answers[2], answers[3])] == ids
        assert [a.status for a in (answers[0], answers[2], answers[3])] == [
            "accepted",
            "accepted",
            "rejected",
        ]
        assert not checker.barrier.broken  # all four were in flight at once


def test_a_verdict_whose_orchestrator_stays_away_is_raised_not_returned(tmp_path):
    validator = KeyPair.generate()
    with local_orchestrator(tmp_path / "run") as server:
        url = server.url
    gone = PoolClient(url, validator, timeout_s=1)  # the server above has stopped
    swarm = SwarmSection(give_up_s=1, retry_s=0.2)
    verdict = Verdict(submission_id="a" * 32, accept=True, measured_tokens=1)
    with ThreadPoolExecutor(2) as poster, pytest.raises(WaitTimeout):
        post_verdicts(gone, POOL, [verdict, verdict], poster, swarm, LOG)


def test_a_validator_measuring_evidence_in_another_unit_than_the_pool_refuses_to_judge(tmp_path):
    """The pool adds every validator's measurements into one record per node: a validator set
    to another ``toploc.evidence_scale`` than the pool's spec says so in one line at start."""
    from swarmrl.config import load_config
    from swarmrl.errors import UserError
    from swarmrl.roles.validator.process import require_same_evidence_terms

    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=4,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
        evidence_scale=2.5,
    )
    below = load_config([], ["inference.dtype=bfloat16"])  # 2.5 by default below float32
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        with PoolClient(server.url, validator) as pool:
            require_same_evidence_terms(pool, POOL, below, LOG)
            for config in (load_config([], []), load_config([], ["toploc.evidence_scale=2"])):
                with pytest.raises(UserError) as refused:
                    require_same_evidence_terms(pool, POOL, config, LOG)
                message = str(refused.value)
                assert "\n" not in message and "evidence_scale 2.5" in message, message
                assert f"is {config.toploc.evidence_scale:g}" in message, message


def test_a_validator_whose_thresholds_miss_an_engine_the_pool_accepts_refuses_to_judge(tmp_path):
    """Honest work on an engine the calibration never measured may sit beyond its honest means:
    a validator whose thresholds file was calibrated on fewer engines than the pool accepts
    (or a pool that accepts any engine) says so in one line at start. A file written before
    documents named their engines was calibrated on torch alone; a file not there yet (the
    run's own calibration, written later across the pool's engines) is not judged."""
    import json

    from swarmrl.config import load_config
    from swarmrl.errors import UserError
    from swarmrl.protocol.pool import Requirements
    from swarmrl.roles.validator.process import require_same_evidence_terms

    orch, owner, validator = (KeyPair.generate() for _ in range(3))

    def spec(pool_id: str, engines: list[str]) -> PoolSpec:
        return PoolSpec(
            pool_id=pool_id,
            owner_key=owner.public_key_hex,
            task_count=4,
            sampling=SamplingParams(max_new_tokens=2),
            validators=[validator.public_key_hex],
            requirements=Requirements(engines=engines),
        )

    def thresholds(name: str, document: dict) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"thresholds": {}, **document}))
        return f"toploc.thresholds_path={path}"

    torch_only = thresholds("torch.json", {"engines": ["torch"]})
    older = thresholds("older.json", {})  # no engines recorded: torch alone
    both = thresholds("both.json", {"engines": ["torch", "vllm"]})
    later = f"toploc.thresholds_path={tmp_path / 'not-yet.json'}"
    pools = {"t": ["torch"], "tv": ["torch", "vllm"], "any": []}
    allowed = {
        ("t", torch_only),
        ("t", older),
        ("t", both),
        ("tv", both),
        ("t", later),
        ("tv", later),
        ("any", later),
    }
    with local_orchestrator(tmp_path / "run", orch) as server:
        for pool_id, engines in pools.items():
            PoolClient(server.url, orch).create_pool(spec(pool_id, engines))
        with PoolClient(server.url, validator) as pool:
            for pool_id in pools:
                for given in (torch_only, older, both, later):
                    config = load_config([], [given])
                    if (pool_id, given) in allowed:
                        require_same_evidence_terms(pool, pool_id, config, LOG)
                        continue
                    with pytest.raises(UserError) as refused:
                        require_same_evidence_terms(pool, pool_id, config, LOG)
                    message = str(refused.value)
                    assert "\n" not in message and "calibrated on torch" in message, message
                    accepts = "any engine" if pool_id == "any" else "engines torch, vllm"
                    assert f"accepts {accepts}" in message, message
