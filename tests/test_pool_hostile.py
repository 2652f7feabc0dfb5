"""Hostile peer input on SQLite and PostgreSQL: nasty strings, deep or non-finite JSON, and
stored rows that cannot be served. Every case is a clean 4xx, and the pool keeps working for
honest peers afterwards (claims, verdicts and batches still deliver every honest unit)."""

import json
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.pool.state.store import split_reference
from swarmrl.protocol.pool import PoolSpec, Sample, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "hx"


@pytest.fixture
def pool(db_url, tmp_path):
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    cfg = PoolConfig(db_url=db_url)
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validators=[validator.public_key_hex],
            max_leases_in_flight=64,
        )
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        yield server, {"orch": orch, "owner": owner, "validator": validator, "node": node}


def send(server, key, method, path, body=b""):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers |= sign_request(key, method, path, data)
    return httpx.request(method, server.url + path, content=data, headers=headers, timeout=30)


def submit_raw(server, node, proof_json: str):
    """Submit an honest unit whose every sample's proof is the literal JSON ``proof_json``."""
    work = PoolClient(server.url, node).lease(POOL).work
    samples = [s.model_dump(mode="json") for s in synthetic_samples(work, 0)]
    for s in samples:
        s["proof"] = "@PROOF@"
    body = json.dumps({"lease_id": work.lease_id, "samples": samples})
    return send(
        server,
        node,
        "POST",
        f"/pools/{POOL}/submissions",
        body.replace('"@PROOF@"', proof_json).encode(),
    )


def honest_flow_still_works(server, keys):
    """Submit one honest unit; a validator claims it (alone), accepts it; the trainer gets it."""
    node = PoolClient(server.url, keys["node"])
    work = node.lease(POOL).work
    receipt = node.submit(
        POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    )
    checker = PoolClient(server.url, keys["validator"])
    pending = checker.claim(POOL, limit=64)
    assert [p.submission_id for p in pending] == [receipt.submission_id]
    checker.verdict(
        POOL,
        Verdict(
            submission_id=receipt.submission_id,
            accept=True,
            measured_tokens=receipt.tokens,
            behaviour_logprobs=[s.logprobs for s in pending[0].samples],
        ),
    )
    batch = PoolClient(server.url, keys["orch"]).batch(POOL, step=0)
    assert [s.submission_id for s in batch.submissions] == [receipt.submission_id]
    assert PoolClient(server.url, keys["orch"]).node_logs(POOL, keys["node"].node_id).node_id


DEEP = '{"a":' + "[" * 260 + "]" * 260 + "}"
BAD_PROOFS = {
    "lone surrogate": '{"chunks":["\\ud800"]}',
    "lone surrogate key": '{"\\udfff":1}',
    "NUL": '{"chunks":["a\\u0000b"]}',
    "260 levels deep": DEEP,
    "NaN": '{"x":NaN}',
    "Infinity": '{"x":[1,-Infinity]}',
    "huge integer": '{"x":' + "9" * 40 + "}",
    "odd hex": '"abc"',
    "non-hex string": '"zz"',
}


@pytest.mark.parametrize("case", sorted(BAD_PROOFS))
def test_bad_proofs_are_refused_and_validation_keeps_running(pool, case):
    server, keys = pool
    response = submit_raw(server, keys["node"], BAD_PROOFS[case])
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "malformed"
    honest_flow_still_works(server, keys)


def _episode_of(sample: dict) -> dict:
    """The one-turn episode that agrees with a synthetic sample's fields."""
    prompt, output = sample["prompt_tokens"], sample["output_tokens"]
    return {
        "seed": 1,
        "segments": [
            {
                "tokens": prompt + output,
                "turns": [
                    {"role": "context", "start": 0, "end": len(prompt)},
                    {"role": "model", "start": len(prompt), "end": len(prompt) + len(output)},
                ],
                "logprobs": sample["logprobs"],
            }
        ],
    }


def _turns(episode: dict, turns: list) -> dict:
    episode["segments"][0]["turns"] = turns
    return episode


BAD_EPISODES = {  # each a change of the one-turn episode that agrees with the sample
    "gap between turns": lambda e: _turns(
        e, [{"role": "context", "start": 0, "end": 7}, {"role": "model", "start": 8, "end": 10}]
    ),
    "overlapping turns": lambda e: _turns(
        e, [{"role": "context", "start": 0, "end": 8}, {"role": "model", "start": 7, "end": 10}]
    ),
    "no context first": lambda e: _turns(e, [{"role": "model", "start": 0, "end": 10}]),
    "lone surrogate role": lambda e: _turns(
        e,
        [{"role": "context", "start": 0, "end": 8}, {"role": "@SURROGATE@", "start": 8, "end": 10}],
    ),  # fmt: skip
    "NaN log-prob": lambda e: {**e, "segments": [{**e["segments"][0], "logprobs": "@NAN@"}]},
    "negative token": lambda e: {**e, "segments": [{**e["segments"][0], "tokens": [-1] * 10}]},
    "no segments": lambda e: {**e, "segments": []},
    "reward claimed": lambda e: {**e, "reward": 1.0},
    "huge seed": lambda e: {**e, "seed": 2**70},
    "extra field": lambda e: {**e, "turn_mask": [1]},
    "260 levels deep": lambda e: {**e, "segments": "@DEEP@"},
    "proofs of no episode": None,
}


@pytest.mark.parametrize("case", sorted(BAD_EPISODES))
def test_bad_episodes_are_refused_and_the_pool_keeps_working(pool, case):
    server, keys = pool
    work = PoolClient(server.url, keys["node"]).lease(POOL).work
    samples = [s.model_dump(mode="json") for s in synthetic_samples(work, 0)]
    change = BAD_EPISODES[case]
    if change is None:
        samples[0]["turn_proofs"] = [samples[0]["proof"]]
    else:
        samples[0]["proof"] = None
        samples[0]["episode"] = change(_episode_of(samples[0]))
    body = json.dumps({"lease_id": work.lease_id, "samples": samples})
    body = body.replace('"@NAN@"', "[NaN, -0.1]").replace('"@DEEP@"', DEEP)
    body = body.replace("@SURROGATE@", "\\ud800")
    response = send(server, keys["node"], "POST", f"/pools/{POOL}/submissions", body.encode())
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] in ("malformed", "invalid")
    honest_flow_still_works(server, keys)


def _meta(**labels):
    return {"metadata": {"engine": "torch", "memory_gb": 1, "accelerator": "cpu", "labels": labels}}


def test_nasty_strings_in_labels_logs_reasons_and_ids_are_4xx(pool):
    server, keys = pool
    stranger = KeyPair.generate()
    node, validator, orch = keys["node"], keys["validator"], keys["orch"]
    nid = node.node_id
    cases = [
        (stranger, "POST", f"/pools/{POOL}/join", _meta(a="\ud800")),
        (stranger, "POST", f"/pools/{POOL}/join", _meta(a="x\x00y")),
        (stranger, "POST", f"/pools/{POOL}/join", _meta(**{"\x00": "v"})),
        (stranger, "POST", f"/pools/{POOL}/join", _meta(a="x" * 100_000)),
        (stranger, "POST", f"/pools/{POOL}/join", _meta(**{f"k{i}": "v" for i in range(17)})),
        (node, "POST", f"/pools/{POOL}/heartbeat", {"status": "ok", "log_tail": ["up \ud800"]}),
        (node, "POST", f"/pools/{POOL}/heartbeat", {"status": "ok", "log_tail": ["up \x00"]}),
        (node, "POST", f"/pools/{POOL}/heartbeat", {"status": "ok", "log_tail": ["x" * 10_000]}),
        (node, "POST", f"/pools/{POOL}/submissions", {"lease_id": "a\x00", "samples": []}),
        (validator, "POST", f"/pools/{POOL}/validation/claim", {"engine": "vllm\x00"}),
        (validator, "POST", f"/pools/{POOL}/validation/claim", {"engine": "\ud800"}),
        (validator, "POST", f"/pools/{POOL}/validation/claim", {"engine": "v" * 65}),
        (validator, "POST", f"/pools/{POOL}/validation/claim", {"engine": ["torch"]}),
        (
            validator,
            "POST",
            f"/pools/{POOL}/verdicts",
            {
                "submission_id": "0" * 32,
                "accept": False,
                "reasons": ["\udc00"],
                "measured_tokens": 0,
            },
        ),
        (
            orch,
            "POST",
            f"/pools/{POOL}/nodes/{nid}/invalidate",
            {"severity": "soft", "reason": "\x00"},
        ),
        (None, "GET", "/pools/hx%00", b""),
        (None, "GET", "/pools/hx%ED%A0%80", b""),
        (node, "POST", "/pools/hx%00/lease", b""),
        (node, "POST", "/pools/hx%00/heartbeat", {"status": "ok"}),
        (orch, "GET", f"/pools/{POOL}/nodes/{nid[:-1]}%00/logs", b""),
        (orch, "GET", f"/pools/{POOL}/nodes/%00/logs", b""),
        (
            orch,
            "POST",
            f"/pools/{POOL}/nodes/abc%00def/invalidate",
            {"severity": "soft", "reason": "x"},
        ),
    ]
    for key, method, path, body in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = send(server, key, method, path, data)
        assert 400 <= response.status_code < 500, (
            path,
            data[:80],
            response.status_code,
            response.text,
        )
    honest_flow_still_works(server, keys)


def submit_honest(server, keys, n):
    node = PoolClient(server.url, keys["node"])
    ids = []
    for _ in range(n):
        work = node.lease(POOL).work
        samples = synthetic_samples(work, 0)
        ids.append(
            node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples)).submission_id
        )
    return ids


def break_rollout(server, submission_id, damage):
    """Make a stored rollout unreadable. ``deep_proofs``: a Parquet file under the key whose
    proofs nest 300 levels deep, as a damaged store (or one written under an older, unbounded
    schema) could hold; ``not_zstd``: the signed body, the only copy of the samples, replaced by
    bytes that are not a zstd frame."""
    key = f"{POOL}/{submission_id}.parquet"
    if damage == "not_zstd":  # zeroed where it lies in its segment
        with server.ctx.engine.connect() as conn:
            ref = conn.execute(
                sa.select(db.submissions.c.rollout_key).where(
                    db.submissions.c.submission_id == submission_id
                )
            ).scalar_one()
        _, location = split_reference(ref)
        with open(Path(server.ctx.store.root, POOL, "segments", location.segment), "r+b") as f:
            f.seek(location.offset)
            f.write(b"\x00" * location.length)
        return
    deep: object = []
    for _ in range(300):
        deep = [deep]
    samples = server.ctx.store.get_samples(key)
    bad = [Sample.model_construct(**{**s.model_dump(), "proof": {"x": deep}}) for s in samples]
    server.ctx.store.put_samples(key, bad)


def statuses(server):
    with server.ctx.engine.connect() as conn:
        t = db.submissions
        return dict(conn.execute(sa.select(t.c.submission_id, t.c.status)).all())


DAMAGE = pytest.mark.parametrize("damage", ["deep_proofs", "not_zstd"])


@DAMAGE
def test_a_claim_never_commits_a_unit_it_cannot_deliver(pool, damage):
    server, keys = pool
    broken, honest = submit_honest(server, keys, 2)
    break_rollout(server, broken, damage)
    pending = PoolClient(server.url, keys["validator"]).claim(POOL, limit=8)
    assert [p.submission_id for p in pending] == [honest]
    assert statuses(server) == {broken: "quarantined", honest: "pending"}


@DAMAGE
def test_a_batch_never_consumes_a_unit_it_cannot_deliver(pool, damage):
    server, keys = pool
    broken, honest = submit_honest(server, keys, 2)
    checker = PoolClient(server.url, keys["validator"])
    for p in checker.claim(POOL, limit=8):
        lp = [s.logprobs for s in p.samples]
        checker.verdict(
            POOL,
            Verdict(
                submission_id=p.submission_id, accept=True, measured_tokens=1, behaviour_logprobs=lp
            ),
        )
    break_rollout(server, broken, damage)  # it turns unreadable after it was accepted
    batch = PoolClient(server.url, keys["orch"]).batch(POOL, step=0)
    assert [s.submission_id for s in batch.submissions] == [honest]
    assert statuses(server)[broken] == "quarantined"
