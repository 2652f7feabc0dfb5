"""Stopping and restarting `swarmrl orchestrator` loses nothing: pools, nodes, leases, pending
submissions, used invites and nonces, and the ledger come back from the database and store."""

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from swarmrl.cli import main as swarmrl_main
from swarmrl.errors import Conflict
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.ledger.verify import verify_export
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, PoolSpec, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples

pytestmark = pytest.mark.slow


def start(tmp: Path, key_file: Path, spec_file: Path) -> tuple[subprocess.Popen, str]:
    return spawn_orchestrator(tmp / "run", key_file, [spec_file])


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        raise


def test_restart_restores_everything(tmp_path):
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    key_file = tmp_path / "orch.json"
    orch.save(key_file)
    spec = PoolSpec(
        pool_id="p1",
        owner_key=owner.public_key_hex,
        task_count=10,
        sampling=SamplingParams(max_new_tokens=3),
        validators=[validator.public_key_hex],
    )
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json())

    proc, url = start(tmp_path, key_file, spec_file)
    try:
        invite = make_invite(owner, "p1", 600)
        client = PoolClient(url, node)
        client.join("p1", CPU_NODE, invite)
        client.heartbeat("p1", Heartbeat(status="ok", log_tail=["loaded v0"]))
        done, kept = client.lease("p1").work, client.lease("p1").work
        receipt = client.submit(
            "p1", Submission(lease_id=done.lease_id, samples=synthetic_samples(done, 0))
        )
        PoolClient(url, owner).set_version("p1", 1)
        path, body = "/pools/p1/heartbeat", b'{"status":"ok"}'
        replay = sign_request(node, "POST", path, body) | {"Content-Type": "application/json"}
        assert httpx.post(url + path, content=body, headers=replay).status_code == 200
    finally:
        stop(proc)

    proc, url = start(tmp_path, key_file, spec_file)
    try:
        client = PoolClient(url, node)
        admin = PoolClient(url, owner)
        assert admin.pool("p1").current_version == 1
        [view] = admin.nodes("p1")
        assert view.node_id == node.node_id and view.state == "healthy"
        assert view.leases_in_flight == 1
        assert admin.node_logs("p1", node.node_id).lines == ["loaded v0"]
        # the lease taken before the restart can still be answered
        client.submit("p1", Submission(lease_id=kept.lease_id, samples=synthetic_samples(kept, 1)))
        # the pending submission is still there, with its rollouts
        pending = {p.submission_id: p for p in PoolClient(url, validator).claim("p1")}
        assert receipt.submission_id in pending
        assert pending[receipt.submission_id].samples == synthetic_samples(done, 0)
        # used invites stay used; requests used before the restart are refused (nonces persist)
        with pytest.raises(Conflict, match="already used"):
            PoolClient(url, KeyPair.generate()).join("p1", CPU_NODE, invite)
        r = httpx.post(url + path, content=body, headers=replay)
        assert r.status_code == 401 and r.json()["error"]["code"] == "replayed_request"
        assert "already used" in r.json()["error"]["message"]
        # the lease counter continued: the next draw is lease number 2
        assert client.lease("p1").work.origin_counter == 2
    finally:
        stop(proc)

    out = tmp_path / "ledger.jsonl"
    db_url = f"sqlite:///{tmp_path / 'run' / 'pool.db'}"
    assert swarmrl_main(["ledger", "export", "--db", db_url, "--out", str(out)]) == 0
    report = verify_export(out, orch.public_key_hex)
    assert report.ok, report.reason
    assert len(out.read_text().splitlines()) - 1 == report.entries >= 4  # pool, join, 2 submits
    assert report.contributions[node.node_id].submissions == 2


def test_a_full_disk_refuses_a_submission_cleanly_and_leaves_no_part_of_it(tmp_path, monkeypatch):
    """The store cannot write (ENOSPC): the submit is a 503 the worker may retry, nothing is
    recorded, no part of the body is left in the store; once there is room the same lease is
    submitted."""
    import os

    from swarmrl.errors import PeerUnavailable
    from swarmrl.pool.state import segments
    from swarmrl.testing.pool_nodes import local_orchestrator

    orch, owner, node = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    spec = PoolSpec(
        pool_id="p1", owner_key=owner.public_key_hex, task_count=10,
        sampling=SamplingParams(max_new_tokens=3), validators=[KeyPair.generate().public_key_hex],
    )  # fmt: skip
    full = {"on": True}
    real_write = os.write

    def write_or_full(fd, data):
        if full["on"]:  # the disk fills up halfway through the record: a short write
            return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    # the store appends a submission's body to a segment file (swarmrl.pool.state.segments)
    monkeypatch.setattr(segments.os, "write", write_or_full)
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        client = PoolClient(server.url, node)
        client.join("p1", CPU_NODE, make_invite(owner, "p1", 600))
        work = client.lease("p1").work
        body = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
        with pytest.raises(PeerUnavailable, match="503"):
            client.submit("p1", body)
        assert list((tmp_path / "run").rglob("*.tmp")) == []
        # the half record cut off, and the segment it began (empty then) removed
        assert list((tmp_path / "run" / "rollouts").rglob("*.seg")) == []
        full["on"] = False
        receipt = client.submit("p1", body)  # the refused attempt recorded nothing
        assert receipt.tokens > 0
