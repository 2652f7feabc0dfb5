"""Server CPU per request of the orchestrator app, called in-process (no sockets, no client).

Builds the orchestrator's ASGI app over a fresh SQLite database (or ``--db-url``), joins
``--nodes`` nodes, and sends signed heartbeats, leases and submissions (4 samples × 32 tokens;
``--tokens`` sets the output tokens per sample) straight into the app, in batches of 25.
Requests are signed before the clock starts, so the figure is the app's own CPU time
(``time.process_time``): signature check, nonce, database work, ledger, rollout files, reply.
On a shared machine a batch's figure grows with the load (caches are cold after every switch),
so the lowest batches are the closest to an idle machine's; the minimum, first quartile and
median over the batches are printed. Run from the repository root:

    python bench/pool_costs.py --nodes 500

``bench/pool.py --costs`` measures the same over HTTP (uvicorn included) from the server's
``/proc`` CPU counters.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pool import POOL, bench_spec  # bench/pool.py, this script's sibling
from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.server import make_context
from swarmrl.pool.trust import service
from swarmrl.pool.web.app import build_app
from swarmrl.protocol.pool import Heartbeat, LeaseReply, SamplingParams, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, synthetic_samples

BATCH = 25
Request = tuple[KeyPair, str, bytes, dict[str, str]]


async def call(app: Any, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """POST ``body`` to ``path`` through the ASGI ``app``; the 200 answer's body."""
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    if answer.get("status") != 200:
        raise RuntimeError(f"{path}: {answer.get('status')} {answer['body'][:300]!r}")
    return answer["body"]


def signed(kp: KeyPair, path: str, body: bytes) -> Request:
    return kp, path, body, sign_request(kp, "POST", path, body)


async def timed(
    app: Any, requests: list[Request], after: Callable[[], object] = lambda: None
) -> tuple[list[float], list[bytes]]:
    """Per-request CPU milliseconds of each batch (``after`` it included), and every answer."""
    per_batch, answers = [], []
    for i in range(0, len(requests), BATCH):
        batch = requests[i : i + BATCH]
        start = time.process_time()
        for _, path, body, headers in batch:
            answers.append(await call(app, path, body, headers))
        after()
        per_batch.append((time.process_time() - start) / len(batch) * 1000)
    return per_batch, answers


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 3),
        "p25": round(ordered[len(ordered) // 4], 3),
        "median": round(ordered[len(ordered) // 2], 3),
    }


async def measure(nodes: int, db_url: str, tokens: int = 32) -> dict[str, dict[str, float]]:
    config = PoolConfig(join_rate_per_s=1000, join_burst=100_000, db_url=db_url)
    ctx = make_context(KeyPair.generate(), Path(tempfile.mkdtemp()), config)
    spec = bench_spec(lease_timeout_s=600)
    spec = spec.model_copy(update={"sampling": SamplingParams(max_new_tokens=tokens)})
    service.create_pool(ctx, spec)
    app = build_app(ctx)
    keys = [KeyPair.generate() for _ in range(nodes)]
    join = json.dumps({"metadata": CPU_NODE.model_dump(mode="json")}).encode()
    base = f"/pools/{POOL}"
    await timed(app, [signed(kp, f"{base}/join", join) for kp in keys])
    beat = Heartbeat(status="ok", model_version=0, tokens_per_s=100.0, log_tail=["step ok"])
    beat_body = beat.model_dump_json().encode()
    # each batch's buffered beats are written after it, inside its time: a server writes them
    # once a second (pool.heartbeat_flush_s), ~500 beats a flush at 5,000 nodes, not 25
    flush = functools.partial(service.flush_beats, ctx)
    await timed(app, [signed(kp, f"{base}/heartbeat", beat_body) for kp in keys], flush)  # warm
    beats, _ = await timed(app, [signed(kp, f"{base}/heartbeat", beat_body) for kp in keys], flush)
    leases, answers = await timed(app, [signed(kp, f"{base}/lease", b"") for kp in keys])
    submissions = []
    for kp, answer in zip(keys, answers, strict=True):
        work = LeaseReply.model_validate_json(answer).work
        assert work is not None
        sub = Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
        submissions.append(signed(kp, f"{base}/submissions", sub.model_dump_json().encode()))
    ctx.store.put_samples(f"{POOL}/warm-up.parquet", synthetic_samples(work, 0))  # first imports
    submits, _ = await timed(app, submissions)
    return {"heartbeat": summary(beats), "lease": summary(leases), "submit": summary(submits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500, help="nodes (requests per kind)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per sample")
    parser.add_argument("--db-url", default="", help="SQLAlchemy URL; empty = SQLite in a temp dir")
    args = parser.parse_args()
    costs = asyncio.run(measure(args.nodes, args.db_url, args.tokens))
    print(json.dumps({"server_cpu_ms_per_request_in_process": costs}))


if __name__ == "__main__":
    main()
