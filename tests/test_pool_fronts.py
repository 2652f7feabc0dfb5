"""``swarmrl orchestrator --fronts N``: front processes hold the connections and check
signatures; the orchestrator behind them answers every request as it does on its own port,
refuses what it always refuses (forged, replayed, oversized, malformed) with the same answers,
and stops when a front ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples

POOL = "fr"
pytestmark = pytest.mark.slow


@pytest.fixture
def fronted(tmp_path):
    orch, owner = KeyPair.generate(), KeyPair.generate()
    orch.save(tmp_path / "orch.json")
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=50,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validated_fraction=0.0,
        max_leases_in_flight=64,
    )
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    settings = {"pool.max_body_bytes": 200_000}
    proc, url = spawn_orchestrator(
        tmp_path / "run",
        tmp_path / "orch.json",
        [tmp_path / "spec.json"],
        settings=settings,
        args=["--fronts", "1"],
    )
    try:
        yield proc, url, owner
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def _signed_post(node: KeyPair, url: str, path: str, body: bytes, **kw) -> httpx.Response:
    headers = sign_request(node, "POST", path, body, **kw) | {"Content-Type": "application/json"}
    return httpx.post(url + path, content=body, headers=headers)


def test_a_pool_behind_a_front_works_and_refuses_what_it_always_refuses(fronted):
    _, url, owner = fronted
    node = KeyPair.generate()
    worker, trainer = PoolClient(url, node), PoolClient(url, owner)
    assert httpx.get(url + "/health").json()["ok"] is True
    assert worker.join(POOL, CPU_NODE).state == "healthy"
    assert worker.heartbeat(POOL, Heartbeat(status="ok")).state == "healthy"
    work = worker.lease(POOL).work
    receipt = worker.submit(
        POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    )
    served = trainer.batch(POOL, step=0).submissions
    assert [s.submission_id for s in served] == [receipt.submission_id]
    assert trainer.ack_batch(POOL, [receipt.submission_id]).acknowledged == 1
    assert len(trainer.ledger_entries(0, 100)) > 0  # a GET with a query string

    path = f"/pools/{POOL}/heartbeat"
    body = Heartbeat(status="ok").model_dump_json().encode()
    # forged: another key's signature; the orchestrator checks it again and refuses it
    forged = sign_request(KeyPair.generate(), "POST", path, body)
    forged["X-Swarm-Key"] = node.public_key_hex
    answer = httpx.post(
        url + path, content=body, headers=forged | {"Content-Type": "application/json"}
    )
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "bad_signature"
    # replayed: the front finds the signature good, the orchestrator the nonce used
    headers = sign_request(node, "POST", path, body) | {"Content-Type": "application/json"}
    assert httpx.post(url + path, content=body, headers=headers).status_code == 200
    replay = httpx.post(url + path, content=body, headers=headers)
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_request"
    # too old: refused by the orchestrator's own time check, not only the front's
    old = _signed_post(node, url, path, body, now_s=time.time() - 3600)
    assert old.status_code == 401 and old.json()["error"]["code"] == "replayed_request"
    # malformed bodies, signed: a 422 in the app's words, never a 5xx
    for bad in (b'{"status": "ok", "model_version": NaN}', b'{"status": "\\ud800"}', b"[" * 5000):
        answer = _signed_post(node, url, path, bad)
        assert 400 <= answer.status_code < 500, (bad[:20], answer.status_code, answer.text)
    # oversized: refused at the front, the body not read past the cap
    huge = b'{"status": "ok", "log_tail": ["' + b"x" * 300_000 + b'"]}'
    answer = _signed_post(node, url, path, huge)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "oversized_request"
    metrics = httpx.get(url + "/metrics").text
    assert 'route="/pools/{pool_id}/heartbeat"' in metrics


def test_the_orchestrator_stops_when_its_front_ends(fronted):
    proc, url, _ = fronted
    fronts = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit()
        and _parent(int(pid)) == proc.pid
        and b"swarmrl.pool.web.front" in _cmdline(int(pid))
    ]
    assert len(fronts) == 1
    os.kill(fronts[0], signal.SIGKILL)
    assert proc.wait(timeout=30) is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_front_refuses_a_second_way_of_scaling_in_one_line(tmp_path):
    orch = KeyPair.generate()
    orch.save(tmp_path / "orch.json")
    done = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--key", str(tmp_path / "orch.json"),
         "--run-dir", str(tmp_path / "run"), "--fronts", "1", "--workers", "2",
         "--db", "postgresql+psycopg://x@127.0.0.1:1/x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--fronts and --workers" in done.stderr
