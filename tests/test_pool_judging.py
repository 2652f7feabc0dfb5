"""Every submission is judged, even one that went stale while it waited: a worker that cheats
just before a version bump is still caught; a stale unit is judged for penalty only and never
reaches the trainer."""

from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "jd"


def test_stale_submissions_are_judged_penalised_and_never_trained(tmp_path):
    orch, owner, validator, cheat, honest = (KeyPair.generate() for _ in range(5))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=20,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
        async_level=2,
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        ids = {}
        for key in (cheat, honest):
            node = PoolClient(server.url, key)
            node.join(POOL, CPU_NODE)
            work = node.lease(POOL).work
            sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            ids[key.node_id] = node.submit(POOL, sub).submission_id
        trainer = PoolClient(server.url, owner)
        trainer.set_version(POOL, 5)  # both units are now older than 5 − async_level
        checker = PoolClient(server.url, validator)
        pending = {p.node_id: p for p in checker.claim(POOL)}
        assert set(pending) == {cheat.node_id, honest.node_id}
        checker.verdict(
            POOL,
            Verdict(
                submission_id=ids[cheat.node_id],
                accept=False,
                reasons=["sampling replay mismatch"],
                measured_tokens=0,
            ),
        )
        good = pending[honest.node_id]
        checker.verdict(
            POOL,
            Verdict(
                submission_id=good.submission_id,
                accept=True,
                measured_tokens=2,
                behaviour_logprobs=[s.logprobs for s in good.samples],
            ),
        )
        states = {n.node_id: n.state for n in trainer.nodes(POOL)}
        assert states == {cheat.node_id: "banned", honest.node_id: "healthy"}
        assert trainer.batch(POOL, step=5).submissions == []  # stale: judged, never trained
        assert trainer.metrics(POOL).credited_tokens == 2
