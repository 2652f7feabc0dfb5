"""Schema-driven fuzzing of every orchestrator endpoint: no input may produce a 5xx.

Cases come from the published OpenAPI schema (schemathesis, valid and invalid inputs); each is
signed by a key drawn from {orchestrator, pool owner, validator, member node, stranger, none},
and path parameters are sometimes pointed at the real pool and node so the deep code runs.
On top of the schema's own cases, string values are sometimes swapped for nasty ones (lone
surrogates, NULs, huge strings) and numbers for NaN/Infinity or huge integers. Runs on SQLite
and on PostgreSQL.
"""

import json
import math

import httpx
import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.server import make_context
from swarmrl.pool.web.app import build_app
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import PoolSpec, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

pytestmark = pytest.mark.slow
EXAMPLES = 6


@pytest.fixture(scope="module")
def target(tmp_path_factory, module_db_url):
    orch, owner, validator, second, node = (KeyPair.generate() for _ in range(5))
    config = PoolConfig(max_body_bytes=256 << 10, db_url=module_db_url)
    with local_orchestrator(tmp_path_factory.mktemp("fuzz"), orch, config) as server:
        spec = PoolSpec(
            pool_id="fz",
            owner_key=owner.public_key_hex,
            task_count=20,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validators=[validator.public_key_hex, second.public_key_hex],
            validated_fraction=0.5,
            quorum=2,  # a fuzzed rejection is a vote on a disputed submission
        )
        PoolClient(server.url, orch).create_pool(spec)
        client = PoolClient(server.url, node)
        client.join("fz", CPU_NODE)
        for _ in range(2):  # leave submissions around for claims, verdicts and batches
            work = client.lease("fz").work
            client.submit(
                "fz", Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        keys = [orch, owner, validator, node, KeyPair.generate(), None]
        yield server.url, operations, keys, node.node_id


def test_schema_lists_every_route(target, tmp_path):
    """The fuzzer sees every route the pool app serves (so a new route is fuzzed too)."""
    _, operations, _, _ = target
    routes = {(op.method.upper(), op.path) for op in operations}
    app = build_app(make_context(KeyPair.generate(), tmp_path, PoolConfig()))
    served = {
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    assert ("POST", "/pools/{pool_id}/submissions") in routes
    assert ("POST", "/pools/{pool_id}/verdicts") in routes
    assert ("GET", "/ledger/entries") in routes
    assert ("POST", "/pools/{pool_id}/batches/ack") in routes
    assert routes == served


NASTY_TEXT = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "x\x00", "\udbff\udbff"]),
    st.lists(
        st.one_of(st.characters(), st.sampled_from(["\x00", "\ud800", "\udc00"])), max_size=12
    ).map("".join),
    st.integers(10_000, 400_000).map(lambda n: "x" * n),
)
NASTY_NUMBER = st.sampled_from([math.nan, math.inf, -math.inf, 10**40, -(10**30), 2**63])
PATH_NASTIES = ["%00", "%ED%A0%80", "%C0%80", "\ufffe", "\u0085", "x" * 300]


def _deep(levels: int) -> object:
    value: object = {"x": 1}
    for _ in range(levels):
        value = [value]
    return value


def _nastify(value, draw):
    """``value`` with some strings, numbers and containers swapped for hostile ones."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(item, dict) and draw(st.booleans()):
                item = {**item, draw(NASTY_TEXT): _deep(draw(st.integers(20, 400)))}
            out[key] = _nastify(item, draw)
        return out
    if isinstance(value, list):
        return [_nastify(item, draw) for item in value]
    if isinstance(value, str) and draw(st.booleans()):
        return draw(NASTY_TEXT)
    if isinstance(value, int | float) and not isinstance(value, bool) and draw(st.booleans()):
        return draw(NASTY_NUMBER)
    return value


def _fuzz_operation(http, url, operation, keys, node_id, mode):
    seen = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate),  # shrinking such cases is slow and fragile
    )
    @given(
        case=operation.as_strategy(generation_mode=mode),
        key=st.sampled_from(keys),
        real_pool=st.booleans(),
        real_node=st.booleans(),
        nasty=st.booleans(),
        data=st.data(),
    )
    def run(case, key, real_pool, real_node, nasty, data):
        if real_pool and "pool_id" in case.path_parameters:
            case.path_parameters["pool_id"] = "fz"
        if real_node and "node_id" in case.path_parameters:
            case.path_parameters["node_id"] = node_id
        if nasty:
            for name in list(case.path_parameters or {}):
                if data.draw(st.booleans()):
                    case.path_parameters[name] += data.draw(st.sampled_from(PATH_NASTIES))
        kwargs = case.as_transport_kwargs(base_url=url)
        target_url = httpx.URL(kwargs["url"], params=kwargs.get("params") or None)
        payload = kwargs.get("json")
        if nasty and "json" in kwargs:
            payload = _nastify(payload, data.draw)
        body = json.dumps(payload).encode() if "json" in kwargs else b""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers |= sign_request(key, kwargs["method"], target_url.raw_path.decode(), body)
        response = http.request(kwargs["method"], target_url, content=body, headers=headers)
        seen.append(response.status_code)
        assert response.status_code < 500, (
            f"{kwargs['method']} {target_url} {body[:300]!r} → {response.status_code} "
            f"{response.text[:300]}"
        )

    try:
        run()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE  # a route without inputs has no invalid form
    return seen


def test_no_input_makes_a_5xx(target):
    url, operations, keys, node_id = target
    statuses = []
    with httpx.Client(timeout=30) as http:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                statuses += _fuzz_operation(http, url, operation, keys, node_id, mode)
    assert len(statuses) >= len(operations) * 2
    # the fuzzing reached handlers, not just the signature check
    assert {200, 401, 403, 404, 422} <= set(statuses), sorted(set(statuses))
