"""Typed errors: every error class sits in the tree of swarmrl.errors, every pool answer code
reads back into its own type at the client, and a banned worker stops because of the type."""

import ast
import inspect
import logging
import re
import threading
from pathlib import Path

import httpx
import pytest

import swarmrl
from swarmrl import errors
from swarmrl.config import load_config
from swarmrl.errors import NodeBanned, PeerError, Rejected
from swarmrl.identity import KeyPair
from swarmrl.pool import rejections
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, InvalidateRequest, PoolSpec
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.worker.node import WorkerNode, WorkerSettings
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator

SRC = Path(swarmrl.__file__).parent
DOCS = SRC.parents[1] / "docs"


def test_every_exception_class_is_defined_in_the_tree_and_drawn_in_its_docstring():
    defined = [
        (path, node.name)
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(
            isinstance(b, ast.Name)
            and (b.id.endswith(("Error", "Exception")) or b.id in vars(errors))
            for b in node.bases
        )
    ]
    # a private signal (leading underscore) never leaves its module: it is caught there and
    # turned into an error of the tree
    outside = [
        (str(p.relative_to(SRC)), n)
        for p, n in defined
        if p.name != "errors.py" and not n.startswith("_")
    ]
    assert outside == []
    tree = errors.__doc__ or ""
    classes = [
        c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__
    ]
    assert all(issubclass(c, errors.SwarmError) for c in classes)
    assert [c.__name__ for c in classes if f" {c.__name__} " not in tree] == []


def test_each_code_maps_to_its_exception_and_is_documented():
    pool_doc = (DOCS / "pool.md").read_text()
    for code, cls in rejections.BY_CODE.items():
        assert cls.code == code and issubclass(cls, PeerError)
        exc = rejections.refusal(code, "why")
        assert type(exc) is cls and str(exc) == "why"
        assert rejections.answer(cls("why")) == {"error": {"code": code, "message": "why"}}
        status = rejections.status_of(cls("why"))
        assert 400 <= status < 500
        assert re.search(rf"\| `{code}` \| {status} \|", pool_doc), f"{code} not in docs/pool.md"
    assert type(rejections.refusal("from_a_newer_pool", "m")) is Rejected
    assert len(set(rejections.BY_CODE)) == len(rejections.STATUS)


@pytest.mark.parametrize("code", sorted(rejections.BY_CODE))
def test_the_client_raises_the_type_the_answer_code_names(code):
    cls = rejections.BY_CODE[code]

    def answer(request):
        return httpx.Response(rejections.STATUS[cls], json=rejections.answer(cls("no words")))

    client = PoolClient(
        "http://pool.test",
        KeyPair.generate(),
        http=httpx.Client(transport=httpx.MockTransport(answer)),
    )
    with pytest.raises(PeerError) as err:
        client.lease("arith")
    assert type(err.value) is cls
    assert str(err.value) == "POST /pools/arith/lease: no words"


def test_an_answer_that_is_not_the_pools_is_a_plain_rejection():
    proxy = httpx.MockTransport(lambda r: httpx.Response(404, text="<html>nginx</html>"))
    client = PoolClient("http://pool.test", KeyPair.generate(), http=httpx.Client(transport=proxy))
    with pytest.raises(Rejected, match="HTTP 404: <html>nginx") as err:
        client.lease("arith")
    assert type(err.value) is Rejected


@pytest.fixture
def banned_node(tmp_path):
    """A worker's key that joined a pool and was then banned by the pool owner."""
    orch, owner, node = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    with local_orchestrator(tmp_path / "run", orch) as server:
        admin = PoolClient(server.url, orch, timeout_s=10)
        spec = PoolSpec(
            pool_id="arith",
            owner_key=owner.public_key_hex,
            task_count=100,
            sampling=SamplingParams(max_new_tokens=4),
            validators=[KeyPair.generate().public_key_hex],
        )
        admin.create_pool(spec)
        invite = make_invite(owner, "arith", 60)
        PoolClient(server.url, node, timeout_s=10).join("arith", CPU_NODE, invite)
        # the pool's reason, in words the worker never reads
        admin.invalidate("arith", node.node_id, InvalidateRequest(severity="hard", reason="x"))
        yield server, node, invite
        admin.close()


def _worker(tmp_path, url, key, invite):
    config = load_config([], ["pool.heartbeat_interval_s=0.2", "swarm.retry_s=0.1"])
    settings = WorkerSettings(url, "arith", ["http://127.0.0.1:9"], "ab" * 32, tmp_path, invite)
    status = StatusReporter("worker", "w0", tmp_path / "status", node_id=key.node_id)
    return WorkerNode(config, settings, key, status, logging.getLogger("test.worker"))


def test_a_banned_worker_exits_with_status_3_instead_of_crashing(banned_node, tmp_path):
    server, key, invite = banned_node
    worker = _worker(tmp_path, server.url, key, invite)
    assert worker.run() == 3
    assert worker.banned.is_set() and worker.status.status.state == "banned"


def test_a_banned_workers_heartbeat_stops_it(banned_node, tmp_path):
    server, key, invite = banned_node
    with pytest.raises(NodeBanned):
        PoolClient(server.url, key).heartbeat("arith", Heartbeat(status="ok"))
    worker = _worker(tmp_path, server.url, key, invite)
    beats = threading.Thread(target=worker.membership.heartbeats, daemon=True)
    beats.start()
    beats.join(timeout=10)
    assert not beats.is_alive() and worker.banned.is_set() and worker.stop.is_set()
    worker.pool.close()
    worker.weights.close()
