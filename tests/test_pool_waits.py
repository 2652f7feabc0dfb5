"""Held listings: a validator's claim and a trainer's batch request that would be answered empty
wait, bounded by ``wait_s``, and are answered as soon as a submission or a verdict makes
something to hand out (``swarmrl.pool.web.waits``)."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state.replies import json_object
from swarmrl.pool.web.waits import PoolChanges, held
from swarmrl.protocol.pool import MAX_WAIT_S, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "hw"
HOLD_S = 8.0  # long enough that an answer before it can only come from a wake-up


@pytest.fixture
def pool(tmp_path):
    orch, owner, validator, node = (KeyPair.generate() for _ in range(4))
    with local_orchestrator(tmp_path / "run", orch) as server:
        spec = PoolSpec(
            pool_id=POOL,
            owner_key=owner.public_key_hex,
            task_count=50,
            open=True,
            sampling=SamplingParams(max_new_tokens=2),
            validators=[validator.public_key_hex],
            max_leases_in_flight=8,
        )
        PoolClient(server.url, orch).create_pool(spec)
        worker = PoolClient(server.url, node)
        worker.join(POOL, CPU_NODE)
        yield server, worker, PoolClient(server.url, validator), PoolClient(server.url, owner)


def submit_later(worker, delay_s):
    """Lease now; submit from another thread after ``delay_s``; the thread and its result."""
    work = worker.lease(POOL).work
    done = {}

    def go():
        time.sleep(delay_s)
        sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
        done["id"] = worker.submit(POOL, sub).submission_id

    thread = threading.Thread(target=go)
    thread.start()
    return thread, done


def test_a_held_claim_is_answered_when_a_submission_arrives(pool):
    _, worker, checker, _ = pool
    thread, done = submit_later(worker, 0.3)
    started = time.monotonic()
    claimed = checker.claim(POOL, wait_s=HOLD_S)
    waited = time.monotonic() - started
    thread.join()
    assert [p.submission_id for p in claimed] == [done["id"]]
    assert waited < HOLD_S / 2  # woken by the submission, not by the end of the hold


def test_a_held_batch_is_answered_when_a_verdict_makes_work_trainable(pool):
    _, worker, checker, trainer = pool
    work = worker.lease(POOL).work
    sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
    sid = worker.submit(POOL, sub).submission_id
    assert trainer.batch(POOL, step=0).submissions == []  # pending: not trainable yet
    pending = checker.claim(POOL)
    assert [p.submission_id for p in pending] == [sid]

    def accept():
        time.sleep(0.3)
        verdict = Verdict(
            submission_id=sid,
            accept=True,
            measured_tokens=2,
            behaviour_logprobs=[s.logprobs for s in pending[0].samples],
        )
        checker.verdict(POOL, verdict)

    thread = threading.Thread(target=accept)
    thread.start()
    started = time.monotonic()
    served = trainer.batch(POOL, step=0, wait_s=HOLD_S).submissions
    waited = time.monotonic() - started
    thread.join()
    assert [s.submission_id for s in served] == [sid]
    assert waited < HOLD_S / 2


def test_an_empty_hold_ends_empty_after_its_wait(pool):
    _, _, checker, trainer = pool
    started = time.monotonic()
    assert checker.claim(POOL, wait_s=0.6) == []
    assert trainer.batch(POOL, step=0, wait_s=0.6).submissions == []
    assert time.monotonic() - started >= 1.1  # both were held (to their own end)
    started = time.monotonic()
    assert checker.claim(POOL) == []  # no wait asked: answered at once
    assert time.monotonic() - started < 0.6


# str: a raw JSON token (NaN and Infinity are what Python's json writes for those floats)
@pytest.mark.parametrize(
    "wait", [MAX_WAIT_S + 1, -1, "NaN", "Infinity", "-Infinity", 1e308, "five", None, [1], {"s": 1}]
)
def test_a_bad_wait_is_refused(pool, wait):
    server, _, checker, trainer = pool
    for path, key, body in (
        (f"/pools/{POOL}/validation/claim", checker.keypair, b'{"limit":1,"wait_s":%s}'),
        (f"/pools/{POOL}/batches", trainer.keypair, b'{"step":0,"wait_s":%s}'),
    ):
        token = wait if wait in ("NaN", "Infinity", "-Infinity") else json.dumps(wait)
        raw = body % token.encode()
        headers = {**sign_request(key, "POST", path, raw), "Content-Type": "application/json"}
        reply = httpx.post(server.url + path, content=raw, headers=headers, timeout=30)
        assert reply.status_code == 422, (wait, reply.text)


def test_held_takes_again_on_each_change_and_on_its_own_clock():
    """The waiter itself: woken by ``notify``, and looking again every ``recheck_s`` for a
    change it was not told of (another server process)."""

    async def scenario():
        changes = PoolChanges()
        listings = [json_object({}, "submissions", [])] * 2 + [
            json_object({}, "submissions", [b"1"])
        ]
        takes = []

        async def take():
            takes.append(time.monotonic())
            return listings[len(takes) - 1]

        async def poke():
            await asyncio.sleep(0.05)
            changes.notify(POOL)
            changes.notify("another-pool")  # nobody waits there: nothing happens

        started = time.monotonic()
        poker = asyncio.create_task(poke())
        body = await held(take, changes, POOL, wait_s=5.0, recheck_s=0.4)
        await poker
        # first take at once, the second on the notify, the third on the recheck clock
        assert body == b'{"submissions":[1]}'
        assert len(takes) == 3
        assert takes[1] - started < 0.3
        assert 0.3 < takes[2] - takes[1] < 2.0
        # an empty listing is answered once its wait is over
        quiet = PoolChanges()
        empty = json_object({"step": 1}, "submissions", [])

        async def nothing():
            return empty

        assert await held(nothing, quiet, POOL, wait_s=0.2, recheck_s=0.05) == empty

    asyncio.run(scenario())
