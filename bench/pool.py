"""Load test of the orchestrator: N simulated nodes on loopback, heartbeating, leasing, submitting.

The orchestrator runs as its own process (``swarmrl orchestrator``, SQLite, one uvicorn worker);
the nodes are asyncio tasks spread over ``--procs`` client processes. Each process shares one
HTTP connection pool (``--connections``) between its nodes' ``PoolClient``s, whose calls run in
a thread pool of the same size (``asyncio.to_thread``). Each node joins an
open pool, then heartbeats every ``--beat-s`` seconds (first beat at a random phase) and runs a
work loop: lease a unit, "generate" for ``--unit-s`` seconds (sleep; no model runs), submit
synthetic samples, repeat. Reported: requests per second and client-side p50/p99/max latency per
call kind over the measured window (joins excluded). Run from the repository root:

    python bench/pool.py --nodes 100 1000 --duration 60

Time compression: ``--beat-s`` and ``--unit-s`` scale the real intervals (10 s and 30 s by
default, i.e. uncompressed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx

from swarmrl.errors import PeerError, PeerUnavailable
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, PoolSpec, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples

POOL = "bench"
T = TypeVar("T")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Recorder:
    """Latencies and refusals of calls that start inside the wall-clock window [t0, t1)."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.lat: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}

    async def timed(self, kind: str, call: Callable[..., T], *args: Any) -> T | None:
        """``call(*args)`` in a worker thread, timed; refusals counted, not raised."""
        wall, start = time.time(), time.perf_counter()
        counted = self.t0 <= wall < self.t1
        try:
            return await asyncio.to_thread(call, *args)
        except (PeerError, PeerUnavailable) as exc:
            if counted:
                key = f"{kind}: {getattr(exc, 'code', type(exc).__name__)}"
                self.errors[key] = self.errors.get(key, 0) + 1
            return None
        finally:
            if counted:
                self.lat.setdefault(kind, []).append(time.perf_counter() - start)


async def node_life(
    client: PoolClient, rec: Recorder, args: argparse.Namespace, stop: asyncio.Event
) -> None:
    rng = random.Random(client.keypair.node_id)

    async def beats() -> None:
        await asyncio.sleep(rng.random() * args.beat_s)
        while not stop.is_set():
            beat = Heartbeat(
                status="ok",
                model_version=0,
                tokens_per_s=100.0,
                log_tail=[f"step ok at {time.time():.0f}"],
            )
            await rec.timed("heartbeat", client.heartbeat, POOL, beat)
            await asyncio.sleep(args.beat_s)

    async def work() -> None:
        await asyncio.sleep(rng.random() * args.unit_s)
        while not stop.is_set():
            reply = await rec.timed("lease", client.lease, POOL)
            if reply is None or reply.work is None:
                await asyncio.sleep(args.beat_s)
                continue
            await asyncio.sleep(args.unit_s)
            samples = synthetic_samples(reply.work, 0, rng=rng)
            submission = Submission(lease_id=reply.work.lease_id, samples=samples)
            await rec.timed("submit", client.submit, POOL, submission)

    await asyncio.gather(beats(), work())


async def drive(url: str, n_nodes: int, args: argparse.Namespace, t0: float, t1: float) -> Recorder:
    """Join ``n_nodes`` nodes, run them until ``t1``, and return what was recorded."""
    rec = Recorder(t0, t1)
    limits = httpx.Limits(
        max_connections=args.connections, max_keepalive_connections=args.connections
    )
    # one thread per connection: threads never outnumber the connections they would wait for
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(args.connections))
    with httpx.Client(limits=limits) as http:
        clients = [
            PoolClient(url, KeyPair.generate(), timeout_s=60, http=http) for _ in range(n_nodes)
        ]
        gate = asyncio.Semaphore(16)

        async def join(c: PoolClient) -> None:
            async with gate:
                await asyncio.to_thread(c.join, POOL, CPU_NODE)

        await asyncio.gather(*(join(c) for c in clients))
        stop = asyncio.Event()
        tasks = [asyncio.create_task(node_life(c, rec, args, stop)) for c in clients]
        await asyncio.sleep(max(0.0, t1 - time.time()))
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rec


def drive_process(job: tuple) -> tuple[dict, dict]:
    url, n_nodes, args, t0, t1 = job
    rec = asyncio.run(drive(url, n_nodes, args, t0, t1))
    return rec.lat, rec.errors


def run_level(url: str, n_nodes: int, args: argparse.Namespace) -> dict:
    """Drive ``n_nodes`` nodes from ``args.procs`` client processes; summarise the window."""
    t0 = time.time() + args.warmup
    t1 = t0 + args.duration
    shares = [n_nodes // args.procs + (i < n_nodes % args.procs) for i in range(args.procs)]
    with multiprocessing.get_context("spawn").Pool(args.procs, initializer=os.setsid) as pool:
        results = pool.map(drive_process, [(url, k, args, t0, t1) for k in shares if k])
    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for part_lat, part_errors in results:
        for k, v in part_lat.items():
            lat.setdefault(k, []).extend(v)
        for k, v in part_errors.items():
            errors[k] = errors.get(k, 0) + v
    all_lat = [x for v in lat.values() for x in v]
    return {
        "nodes": n_nodes,
        "requests": len(all_lat),
        "req_per_s": round(len(all_lat) / args.duration, 1),
        "p50_ms": round(percentile(all_lat, 0.50) * 1000, 1),
        "p99_ms": round(percentile(all_lat, 0.99) * 1000, 1),
        "max_ms": round(max(all_lat, default=float("nan")) * 1000, 1),
        "by_kind": {
            k: {
                "n": len(v),
                "p50_ms": round(percentile(v, 0.5) * 1000, 1),
                "p99_ms": round(percentile(v, 0.99) * 1000, 1),
            }
            for k, v in sorted(lat.items())
        },
        "errors": errors,
    }


def start_orchestrator(tmp: Path, spec: PoolSpec) -> tuple[subprocess.Popen, str]:
    KeyPair.generate().save(tmp / "orch.json")
    (tmp / "spec.json").write_text(spec.model_dump_json())
    # every simulated node joins in the warm-up: admit them all at once (joins are not measured)
    joins = {"pool.join_rate_per_s": 1000, "pool.join_burst": 20000}
    return spawn_orchestrator(tmp / "run", tmp / "orch.json", [tmp / "spec.json"], settings=joins)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_costs(url: str, pid: int, n: int = 50) -> dict[str, float]:
    """Server CPU milliseconds per request of each kind, sent one at a time (no queueing)."""
    clients = [PoolClient(url, KeyPair.generate()) for _ in range(n)]
    for c in clients:
        c.join(POOL, CPU_NODE)

    def cost(items: list, call) -> tuple[float, list]:  # type: ignore[no-untyped-def]
        cpu0 = cpu_seconds(pid)
        out = [call(x) for x in items]
        return round((cpu_seconds(pid) - cpu0) / len(items) * 1000, 2), out

    beat = Heartbeat(status="ok", model_version=0, log_tail=["step ok"])
    costs = {"heartbeat": cost(clients * 2, lambda c: c.heartbeat(POOL, beat))[0]}
    costs["lease"], leased = cost(clients, lambda c: (c, c.lease(POOL).work))
    subs = [
        (c, Submission(lease_id=w.lease_id, samples=synthetic_samples(w, 0))) for c, w in leased
    ]
    costs["submit"] = cost(subs, lambda cs: cs[0].submit(POOL, cs[1]))[0]
    for c in clients:
        c.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--beat-s", type=float, default=10.0, help="heartbeat period")
    parser.add_argument("--unit-s", type=float, default=30.0, help="simulated work per unit")
    parser.add_argument("--connections", type=int, default=128, help="connections per process")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument(
        "--costs", action="store_true", help="only measure server CPU per request, one at a time"
    )
    args = parser.parse_args()
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=KeyPair.generate().public_key_hex,
        open=True,
        task_count=100_000,
        samples_per_task=4,
        sampling=SamplingParams(max_new_tokens=32),
        validated_fraction=0.0,
        max_tasks_per_lease=4,
        max_leases_in_flight=1,
        lease_timeout_s=args.unit_s * 4,
    )
    if args.costs:
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_orchestrator(Path(tmp), spec)
            try:
                print(json.dumps({"server_cpu_ms_per_request": request_costs(url, proc.pid)}))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        return
    rows = []
    for n in args.nodes:
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_orchestrator(Path(tmp), spec)
            try:
                cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
                kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                row = run_level(url, n, args)
                wall = time.monotonic() - t0
                kids = resource.getrusage(resource.RUSAGE_CHILDREN)
                client_cpu = kids.ru_utime + kids.ru_stime - kids0.ru_utime - kids0.ru_stime
                row["server_cpu_share"] = round((cpu_seconds(proc.pid) - cpu0) / wall, 2)
                row["client_cpu_share"] = round(client_cpu / wall, 2)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| nodes | req/s | p50 ms | p99 ms | max ms | server CPU | client CPU | errors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        errors = sum(r["errors"].values())
        print(
            f"| {r['nodes']} | {r['req_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} "
            f"| {r['server_cpu_share']:.0%} | {r['client_cpu_share']:.0%} | {errors} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
