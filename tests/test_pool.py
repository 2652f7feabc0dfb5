"""The orchestrator end to end on loopback: join, heartbeat, lease, submit, verdict, batch,
health transitions, lease reassignment, admin views, restarts."""

import time

import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict, Expired, Invalid, NodeBanned, NotMember, Unauthorized
from swarmrl.identity import KeyPair, verify_signature
from swarmrl.identity.requests import request_message
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.pool.state import db
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, InvalidateRequest, PoolSpec, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples


def _spec(owner: KeyPair, validator: KeyPair, **kw) -> PoolSpec:
    base = dict(
        pool_id="arith",
        owner_key=owner.public_key_hex,
        task_count=100,
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=4),
        seed=7,
        validators=[validator.public_key_hex],
        max_tasks_per_lease=4,
        credit_lock_s=3600,
    )
    base.update(kw)
    return PoolSpec(**base)


@pytest.fixture
def swarm(tmp_path):
    orch, owner, validator = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    with local_orchestrator(tmp_path / "run", orch) as server:
        admin = PoolClient(server.url, orch, timeout_s=10)
        admin.create_pool(_spec(owner, validator))
        yield server, orch, owner, validator
        admin.close()


WAIT_S = 60.0  # bound on waits for the sweeper: generous, a loaded machine is slow


def _wait_until(condition, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"{what} did not happen within {WAIT_S:.0f} s"
        time.sleep(0.05)


def _joined(url, owner, pool="arith"):
    node = KeyPair.generate()
    client = PoolClient(url, node, timeout_s=10)
    client.join(pool, CPU_NODE, make_invite(owner, pool, 60))
    return node, client


def test_full_cycle_join_lease_submit_verdict_batch(swarm):
    server, orch, owner, validator = swarm
    node, client = _joined(server.url, owner)
    reply = client.heartbeat("arith", Heartbeat(status="ok", model_version=0, log_tail=["up"]))
    assert reply.state == "healthy" and reply.current_version == 0
    work = client.lease("arith").work
    assert work is not None and work.node_id == node.node_id
    # the draw is a pure function of a secret the orchestrator reveals in the ledger later
    assert work.assignment_epoch == 0
    receipt = client.submit(
        "arith", Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    )
    assert receipt.status == "pending"
    assert receipt.tokens == 4 * 2 * len(work.task_indices)

    checker = PoolClient(server.url, validator, timeout_s=10)
    pending = checker.claim("arith")
    assert [p.submission_id for p in pending] == [receipt.submission_id]
    assert pending[0].node_key == node.public_key_hex
    # the node's signature over its submit request can be re-checked from what the validator gets
    p = pending[0]
    message = request_message(
        "POST", "/pools/arith/submissions", p.body_digest, p.request_timestamp_ms, p.request_nonce
    )
    verify_signature(p.node_key, message, p.request_signature)
    behaviour = [[-0.5] * len(s.output_tokens) for s in pending[0].samples]
    v = Verdict(
        submission_id=receipt.submission_id,
        accept=True,
        measured_tokens=receipt.tokens,
        behaviour_logprobs=behaviour,
    )
    assert checker.verdict("arith", v).credited_tokens == receipt.tokens
    with pytest.raises(Conflict):
        checker.verdict("arith", v)

    trainer = PoolClient(server.url, owner, timeout_s=10)
    trainer.set_version("arith", 1)
    batch = trainer.batch("arith", step=1)
    assert [s.submission_id for s in batch.submissions] == [receipt.submission_id]
    assert batch.submissions[0].behaviour_logprobs == behaviour
    assert trainer.batch("arith", step=1).submissions == []  # exactly once
    assert trainer.metrics("arith").submissions_by_status == {"leased": 1}
    assert trainer.ack_batch("arith", [receipt.submission_id]).acknowledged == 1
    metrics = trainer.metrics("arith")
    assert metrics.credited_tokens == receipt.tokens == metrics.locked_tokens
    assert metrics.submissions_by_status == {"trained": 1}
    assert trainer.node_logs("arith", node.node_id).lines == ["up"]
    [view] = trainer.nodes("arith")
    assert view.node_id == node.node_id and view.reputation > 0.5


def test_hard_rejection_bans_node_and_drops_locked_credits(swarm):
    server, orch, owner, validator = swarm
    node, client = _joined(server.url, owner)
    checker, admin = PoolClient(server.url, validator), PoolClient(server.url, owner)
    ids = []
    for _ in range(2):
        work = client.lease("arith").work
        ids.append(
            client.submit(
                "arith", Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )
        )
    first, second = ids
    pend = {p.submission_id: p for p in checker.claim("arith")}
    checker.verdict(
        "arith",
        Verdict(
            submission_id=first.submission_id,
            accept=True,
            measured_tokens=first.tokens,
            behaviour_logprobs=[
                [-1.0] * len(s.output_tokens) for s in pend[first.submission_id].samples
            ],
        ),
    )
    assert admin.metrics("arith").credited_tokens == first.tokens
    checker.verdict(
        "arith",
        Verdict(
            submission_id=second.submission_id,
            accept=False,
            severity="hard",
            reasons=["proof mismatch"],
            measured_tokens=0,
        ),
    )
    m = admin.metrics("arith")
    assert m.credited_tokens == 0 and m.nodes_by_state == {"banned": 1}
    assert admin.batch("arith", step=0).submissions == []  # its accepted work is dropped too
    for refused in (
        lambda: client.lease("arith"),
        lambda: client.heartbeat("arith", Heartbeat(status="ok")),
        lambda: client.join("arith", CPU_NODE, make_invite(owner, "arith", 60)),
    ):
        with pytest.raises(NodeBanned, match="banned"):
            refused()


def test_soft_invalidation_drops_one_unit(swarm):
    server, orch, owner, validator = swarm
    node, client = _joined(server.url, owner)
    admin = PoolClient(server.url, orch)
    work = client.lease("arith").work
    r = client.submit(
        "arith", Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    )
    checker = PoolClient(server.url, validator)
    [p] = checker.claim("arith")
    checker.verdict(
        "arith",
        Verdict(
            submission_id=r.submission_id,
            accept=True,
            measured_tokens=5,
            behaviour_logprobs=[[0.0] * len(s.output_tokens) for s in p.samples],
        ),
    )
    view = admin.invalidate(
        "arith",
        node.node_id,
        InvalidateRequest(severity="soft", reason="late", submission_id=r.submission_id),
    )
    assert view.state == "healthy"
    assert admin.metrics("arith").credited_tokens == 0
    assert client.lease("arith").work is not None


def test_lease_cap_and_throughput_sizing(swarm):
    server, orch, owner, validator = swarm
    node, client = _joined(server.url, owner)
    a, b = client.lease("arith"), client.lease("arith")
    assert a.work and b.work and len(a.work.task_indices) == 1  # unknown throughput: smallest
    c = client.lease("arith")
    assert c.work is None and "cap" in c.reason
    client.submit(
        "arith", Submission(lease_id=a.work.lease_id, samples=synthetic_samples(a.work, 0))
    )
    d = client.lease("arith")  # measured throughput is now high (instant answer): biggest unit
    assert d.work is not None and len(d.work.task_indices) == 4


def test_expired_lease_is_reassigned_and_late_submission_refused(tmp_path):
    orch, owner, validator = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    cfg = PoolConfig(sweep_interval_s=0.1)
    with local_orchestrator(tmp_path, orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(_spec(owner, validator, lease_timeout_s=0.3))
        slow, slow_c = _joined(server.url, owner)
        fast, fast_c = _joined(server.url, owner)
        lost = slow_c.lease("arith").work

        def swept() -> bool:
            with server.ctx.engine.connect() as conn:
                state = conn.execute(
                    sa.select(db.leases.c.state).where(db.leases.c.lease_id == lost.lease_id)
                ).scalar_one()
            return state == "expired"

        _wait_until(swept, "the sweep expiring the lease")
        with pytest.raises(Expired, match="expired"):
            slow_c.submit(
                "arith", Submission(lease_id=lost.lease_id, samples=synthetic_samples(lost, 0))
            )
        again = fast_c.lease("arith").work
        assert again.task_indices == lost.task_indices
        assert (again.origin_node_id, again.origin_counter) == (slow.node_id, 0)
        assert again.node_id == fast.node_id
        nodes = {n.node_id: n for n in PoolClient(server.url, owner).nodes("arith")}
        assert nodes[slow.node_id].reputation < 0.5  # soft invalidation for the expiry


def test_health_states_follow_heartbeats(tmp_path):
    """Silence is measured on the orchestrator's clock, advanced here step by step, so each
    state is seen however slowly the sweeper runs on a loaded machine."""
    orch, owner = KeyPair.generate(), KeyPair.generate()
    cfg = PoolConfig(sweep_interval_s=0.05, unhealthy_after_s=10, dead_after_s=30, eject_after_s=60)
    with local_orchestrator(tmp_path, orch, cfg) as server:
        now = [time.time()]
        server.ctx.clock = lambda: now[0]
        PoolClient(server.url, orch).create_pool(_spec(owner, owner, open=True))
        node = KeyPair.generate()
        client = PoolClient(server.url, node)
        client.join("arith", CPU_NODE)  # open pool: no invite
        admin = PoolClient(server.url, owner)

        def after(silent_s: float, want: str) -> None:
            now[0] += silent_s
            _wait_until(lambda: admin.nodes("arith")[0].state == want, f"the node becoming {want}")

        after(11, "unhealthy")
        assert client.heartbeat("arith", Heartbeat(status="ok")).state == "healthy"
        after(31, "dead")
        after(30, "ejected")
        with pytest.raises(NotMember, match="ejected"):
            client.heartbeat("arith", Heartbeat(status="ok"))
        assert client.join("arith", CPU_NODE).state == "healthy"  # rejoin after ejection
        assert client.heartbeat("arith", Heartbeat(status="error")).state == "unhealthy"


def test_pool_cli_invite_and_create(tmp_path, capsys):
    from swarmrl.cli import main as swarmrl_main
    from swarmrl.protocol.pool import Invite

    orch, owner = KeyPair.generate(), KeyPair.generate()
    owner.save(tmp_path / "owner.json")
    orch.save(tmp_path / "orch.json")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(_spec(owner, owner, pool_id="cli").model_dump_json())
    invite_file = tmp_path / "invite.json"
    args = ["pool", "invite", "--key", str(tmp_path / "owner.json"), "--pool", "cli"]
    assert swarmrl_main([*args, "--expires-in", "60", "--out", str(invite_file)]) == 0
    invite = Invite.model_validate_json(invite_file.read_text())
    with local_orchestrator(tmp_path / "run", orch) as server:
        create = ["pool", "create", "--url", server.url, "--key", str(tmp_path / "orch.json")]
        assert swarmrl_main([*create, "--spec", str(spec_file)]) == 0
        assert '"pool_id": "cli"' in capsys.readouterr().out
        assert swarmrl_main([*create, "--spec", str(spec_file)]) == 1  # already exists: 409
        assert "already exists" in capsys.readouterr().err
        view = PoolClient(server.url, KeyPair.generate()).join("cli", CPU_NODE, invite)
        assert view.state == "healthy"


def test_client_reports_an_unreachable_orchestrator(tmp_path):
    import socket

    from swarmrl.errors import PeerUnavailable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PoolClient(f"http://127.0.0.1:{port}", KeyPair.generate(), timeout_s=2)
    with pytest.raises(PeerUnavailable, match="cannot reach"):
        client.health()


def test_pool_specs_that_could_never_work_are_refused(swarm):
    server, orch, owner, validator = swarm
    admin = PoolClient(server.url, orch)
    with pytest.raises(Invalid, match="needs at least one validator"):
        admin.create_pool(_spec(owner, validator, pool_id="noval", validators=[]))
    with pytest.raises(Invalid, match="min_tasks_per_lease exceeds"):
        admin.create_pool(_spec(owner, validator, pool_id="sizes", min_tasks_per_lease=9))
    with pytest.raises(Conflict, match="already exists"):
        admin.create_pool(_spec(owner, validator))
    with pytest.raises(Unauthorized, match="orchestrator key"):
        PoolClient(server.url, owner).create_pool(_spec(owner, validator, pool_id="byowner"))
    assert [p.spec.pool_id for p in admin.pools()] == ["arith"]


def test_ledger_entries_page_through_the_whole_ledger_and_refuse_bad_ranges(swarm, tmp_path):
    import httpx

    from swarmrl.ledger.export import write_entries
    from swarmrl.ledger.verify import verify_export

    server, orch, owner, _ = swarm
    for _ in range(2):  # one ledger entry each, after the pool's creation and first commitment
        _joined(server.url, owner)
    with PoolClient(server.url, KeyPair.generate(), timeout_s=10) as anyone:
        entries = anyone.ledger(page=2)  # three pages: 2 + 2 + 0
        assert [e["seq"] for e in entries] == list(range(4))
        assert [e["kind"] for e in entries][:2] == ["pool_created", "assignment_commit"]
        assert anyone.ledger_entries(start=3, limit=10) == entries[3:]
        assert anyone.ledger_entries(start=4) == []
        assert anyone.ledger_head(limit=1000) == entries
    # an export written from the API verifies offline against the orchestrator's key
    assert write_entries(entries, tmp_path / "ledger.jsonl") == 4
    assert verify_export(tmp_path / "ledger.jsonl", orch.public_key_hex).ok
    for query in (
        "start=-1",
        "start=99999999999999999999999",
        "start=NaN",
        "start=%00",
        "limit=0",
        "limit=1001",
        "limit=Infinity",
        "start=%ED%A0%80",
    ):
        reply = httpx.get(f"{server.url}/ledger/entries?{query}", timeout=10)
        assert reply.status_code == 422, (query, reply.status_code)
