"""Load test of the orchestrator: N simulated nodes on loopback, heartbeating, leasing, submitting.

The orchestrator runs as its own process (``swarmrl orchestrator``; SQLite and one server
process by default; ``--db postgresql`` starts a private PostgreSQL server for the run and
``--workers N`` serves it from N processes; ``--fronts N`` puts N front processes that hold the
connections, parse HTTP and check signatures in front of the one orchestrator process);
the nodes are asyncio tasks spread over ``--procs`` client processes (uvloop). Each node keeps
its own kept-alive HTTP/1.1 connection (one request at a time on it, as one worker process
would) and signs every request exactly as ``PoolClient`` does (``sign_request``); the HTTP is
written by hand so that the load generator, which shares the machine's cores with the server,
costs a fraction of a millisecond per request instead of several. Each node joins an open pool,
then heartbeats every ``--beat-s`` seconds on a fixed grid at a random phase, as a worker does
(``swarmrl.rolekit.ticks``; a late answer does not move the next beat), and runs a work loop:
lease a unit, "generate" for ``--unit-s`` seconds (sleep; no model runs), submit synthetic
samples, repeat. Reported: requests per second, client-side p50/p99/max latency per call kind
over the measured window (request written → response read; joins excluded), the CPU share
of the server and of the client processes, the load generator's longest stall, and with
``--out`` a per-second timeline of the window (requests started, their p50/p99/max; JSON, and a
PNG beside it). Run from the repository root:

    python bench/pool.py --nodes 1000 5000 --duration 60 --warmup 40
    python bench/pool.py --nodes 1000 5000 --duration 60 --warmup 40 --db postgresql --workers 2
    python bench/pool.py --nodes 5000 --duration 60 --warmup 150 --fronts 1

On PostgreSQL each level gets a fresh database with ``synchronous_commit = off``: a commit does
not wait for its WAL flush, as SQLite's ``synchronous=NORMAL`` in WAL mode (the embedded
default) does not (a crash may lose the last commits, never consistency). "server CPU" is
then all orchestrator processes together and "db CPU" PostgreSQL's, reported side by side.

The load generator must not add pauses of its own to what it measures: a call's latency runs
from its request written to its answer read *in the client's event loop*, so anything that
stops that loop while calls are in flight is counted as the server's time. Python's cyclic
garbage collector did exactly that: a client process driving 2,500 nodes collected its
middle generation every 15 s or so, taking 87–150 ms (its oldest: 144 and 316 ms) with the loop
stopped, and every call in flight on it took that much longer, the server's p99 at 5,000 nodes
included. So each client process collects once, freezes what it holds
(``gc.freeze``) and runs the window with the collector off (the nodes' garbage is freed by
reference counting; a few minutes' cycles are kept); ``--client-gc`` leaves it on, to see the
difference. A probe task wakes every 10 ms in each client process and records how late it
woke: "client stall" is the longest such delay in the window, the most the load generator
itself can have added to any one call.

Time compression: ``--beat-s`` and ``--unit-s`` scale the real intervals (10 s and 30 s by
default, i.e. uncompressed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import random
import resource
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
import uvloop

from latency import ms_at, percentile, plot_timeline, timeline  # this script's siblings
from proc_cpu import cpu_seconds, own_cpu_seconds, postgres_cpu_seconds
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, PoolSpec, Submission, WorkUnit
from swarmrl.rolekit.ticks import FixedRate
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples

POOL = "bench"
JOIN_BODY = json.dumps({"metadata": CPU_NODE.model_dump(mode="json")}).encode()


def bench_spec(lease_timeout_s: float) -> PoolSpec:
    """The benchmark's open pool: no validators, small leases, one unit in flight per node."""
    return PoolSpec(
        pool_id=POOL,
        owner_key=KeyPair.generate().public_key_hex,
        open=True,
        task_count=100_000,
        samples_per_task=4,
        sampling=SamplingParams(max_new_tokens=32),
        validated_fraction=0.0,
        max_tasks_per_lease=4,
        max_leases_in_flight=1,
        lease_timeout_s=lease_timeout_s,
    )


class Refused(Exception):
    """The orchestrator answered 4xx/5xx (``code``: the pool's error code or ``http_<status>``)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class WireNode:
    """One simulated node: a key pair and one kept-alive connection, one request at a time."""

    def __init__(self, host: str, port: int, keypair: KeyPair, timeout_s: float) -> None:
        self.host, self.port, self.keypair, self.timeout_s = host, port, keypair, timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def _drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def call(self, path: str, body: bytes, timings: list[float] | None = None) -> Any:
        """POST a signed ``body`` to ``path``; the parsed JSON answer, or :class:`Refused`.

        ``timings`` gets the seconds from writing the request to reading the whole answer."""
        async with self.lock:
            if self.writer is None or self.writer.is_closing():
                await self._connect()
            headers = sign_request(self.keypair, "POST", path, body)
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            request = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{head}\r\n"
            ).encode() + body
            assert self.writer is not None and self.reader is not None
            started = time.perf_counter()
            try:
                self.writer.write(request)
                status, payload, close = await asyncio.wait_for(self._answer(), self.timeout_s)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                self._drop()
                raise Refused(type(exc).__name__) from exc
            finally:  # a call that timed out or broke counts with the time it took
                if timings is not None:
                    timings.append(time.perf_counter() - started)
            if close:
                self._drop()
        answer = json.loads(payload) if payload else None
        if status >= 400:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise Refused(str(error.get("code") or f"http_{status}"))
        return answer

    async def _answer(self) -> tuple[int, bytes, bool]:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        body = await self.reader.readexactly(int(fields.get("content-length", "0")))
        return status, body, fields.get("connection", "").lower() == "close"


class Recorder:
    """Latencies and refusals of calls that start inside the wall-clock window [t0, t1)."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.lat: dict[str, list[float]] = {}
        self.moments: list[tuple[float, float]] = []  # (seconds into the window, latency)
        self.errors: dict[str, int] = {}
        self.joined_at = float("nan")  # when this process's last node had joined
        self.join_errors: dict[str, int] = {}  # refused or timed-out joins (retried)
        self.stall_s = 0.0  # the client loop's longest delay inside the window (probe_loop)

    async def timed(self, kind: str, node: WireNode, path: str, body: bytes) -> Any:
        """``node.call``, timed if it starts in the window; refusals counted, not raised."""
        begun = time.time()
        counted = self.t0 <= begun < self.t1
        timings: list[float] | None = self.lat.setdefault(kind, []) if counted else None
        try:
            return await node.call(path, body, timings)
        except Refused as exc:
            if counted:
                key = f"{kind}: {exc.code}"
                self.errors[key] = self.errors.get(key, 0) + 1
            return None
        finally:
            if timings:
                self.moments.append((begun - self.t0, timings[-1]))


async def node_life(
    node: WireNode, rec: Recorder, args: argparse.Namespace, stop: asyncio.Event
) -> None:
    rng = random.Random(node.keypair.node_id)
    base = f"/pools/{POOL}"

    async def beats() -> None:
        # the worker's schedule: a fixed grid at the node's own phase (swarmrl.rolekit.ticks)
        ticks = FixedRate.random_phase(args.beat_s, time.monotonic(), rng)
        while not stop.is_set():
            await asyncio.sleep(ticks.wait_s(time.monotonic()))
            beat = Heartbeat(
                status="ok",
                model_version=0,
                tokens_per_s=100.0,
                log_tail=[f"step ok at {time.time():.0f}"],
            )
            await rec.timed("heartbeat", node, f"{base}/heartbeat", beat.model_dump_json().encode())
            ticks.advance(time.monotonic())

    async def work() -> None:
        await asyncio.sleep(rng.random() * args.unit_s)
        while not stop.is_set():
            reply = await rec.timed("lease", node, f"{base}/lease", b"")
            if not reply or reply.get("work") is None:
                await asyncio.sleep(args.beat_s)
                continue
            unit = WorkUnit.model_validate(reply["work"])
            await asyncio.sleep(args.unit_s)
            samples = synthetic_samples(unit, 0, rng=rng)
            body = Submission(lease_id=unit.lease_id, samples=samples).model_dump_json().encode()
            await rec.timed("submit", node, f"{base}/submissions", body)

    await asyncio.gather(beats(), work())


async def probe_loop(rec: Recorder, period_s: float = 0.01) -> None:
    """Record in ``rec.stall_s`` the longest this event loop was late waking a sleep of
    ``period_s`` inside the window: what the load generator itself added to a call at most."""
    while time.time() < rec.t1:
        asleep = time.perf_counter()
        await asyncio.sleep(period_s)
        late = time.perf_counter() - asleep - period_s
        if time.time() >= rec.t0:
            rec.stall_s = max(rec.stall_s, late)


async def drive(url: str, n_nodes: int, args: argparse.Namespace, t0: float, t1: float) -> Recorder:
    """Join ``n_nodes`` nodes, run them until ``t1``, and return what was recorded."""
    rec = Recorder(t0, t1)
    where = urlsplit(url)
    host, port = where.hostname or "127.0.0.1", where.port or 80
    nodes = [WireNode(host, port, KeyPair.generate(), timeout_s=60) for _ in range(n_nodes)]
    gate = asyncio.Semaphore(16)

    async def join(node: WireNode) -> bool:
        """Join, retrying a refusal or timeout up to 5 times (each counted); True if joined."""
        for _ in range(5):
            async with gate:
                try:
                    await node.call(f"/pools/{POOL}/join", JOIN_BODY)
                    return True
                except Refused as exc:
                    key = f"join: {exc.code}"
                    rec.join_errors[key] = rec.join_errors.get(key, 0) + 1
            await asyncio.sleep(1.0)
        return False

    joined = await asyncio.gather(*(join(node) for node in nodes))
    nodes = [node for node, ok in zip(nodes, joined, strict=True) if ok]
    rec.joined_at = time.time()
    if not args.client_gc:  # module docstring: the load generator's own pauses
        gc.collect()
        gc.freeze()
        gc.disable()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(node_life(node, rec, args, stop)) for node in nodes]
    tasks.append(asyncio.create_task(probe_loop(rec)))
    await asyncio.sleep(max(0.0, t1 - time.time()))
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for node in nodes:
        node._drop()
    gc.enable()
    gc.unfreeze()
    return rec


def drive_process(job: tuple) -> tuple[dict, dict, float, dict, list, float]:
    url, n_nodes, args, t0, t1 = job
    rec = uvloop.run(drive(url, n_nodes, args, t0, t1))
    return rec.lat, rec.errors, rec.joined_at, rec.join_errors, rec.moments, rec.stall_s


def run_level(url: str, n_nodes: int, args: argparse.Namespace) -> dict:
    """Drive ``n_nodes`` nodes from ``args.procs`` client processes; summarise the window."""
    t0 = time.time() + args.warmup
    t1 = t0 + args.duration
    shares = [n_nodes // args.procs + (i < n_nodes % args.procs) for i in range(args.procs)]
    with multiprocessing.get_context("spawn").Pool(args.procs, initializer=os.setsid) as pool:
        results = pool.map(drive_process, [(url, k, args, t0, t1) for k in shares if k])
    lat: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    joined_at = max(r[2] for r in results)
    join_errors: dict[str, int] = {}
    for part in results:
        for k, v in part[3].items():
            join_errors[k] = join_errors.get(k, 0) + v
    moments = [m for part in results for m in part[4]]
    for part_lat, part_errors, *_ in results:
        for k, v in part_lat.items():
            lat.setdefault(k, []).extend(v)
        for k, v in part_errors.items():
            errors[k] = errors.get(k, 0) + v
    all_lat = [x for v in lat.values() for x in v]
    return {
        "nodes": n_nodes,
        "requests": len(all_lat),
        "req_per_s": round(len(all_lat) / args.duration, 1),
        "p50_ms": ms_at(all_lat, 0.50),
        "p99_ms": ms_at(all_lat, 0.99),
        "max_ms": ms_at(all_lat, 1.0),
        "by_kind": {
            k: {
                "n": len(v),
                "p50_ms": ms_at(v, 0.5),
                "p99_ms": ms_at(v, 0.99),
            }
            for k, v in sorted(lat.items())
        },
        "errors": errors,
        "client_stall_ms": round(max(r[5] for r in results) * 1000, 1),
        "join_errors": join_errors,  # before the window; a node refused 5 times takes no part
        # < unit-s means nodes were still ramping up (first leases) inside the window
        "joined_s_before_window": round(t0 - joined_at, 1),
        "window_start": round(t0, 3),  # Unix time
        "timeline": timeline(moments, int(args.duration)),
    }


def start_orchestrator(
    tmp: Path, spec: PoolSpec, db_url: str = "", workers: int = 1, fronts: int = 0
) -> tuple[subprocess.Popen, str]:
    KeyPair.generate().save(tmp / "orch.json")
    (tmp / "spec.json").write_text(spec.model_dump_json())
    # every simulated node joins in the warm-up: admit them all at once (joins are not measured)
    joins = {"pool.join_rate_per_s": 1000, "pool.join_burst": 20000}
    args = ["--workers", str(workers)] + (["--db", db_url] if db_url else [])
    args += ["--fronts", str(fronts)] if fronts else []
    return spawn_orchestrator(
        tmp / "run", tmp / "orch.json", [tmp / "spec.json"], settings=joins, args=args
    )


@contextlib.contextmanager
def database(kind: str) -> Iterator[Callable[[], tuple[str, int | None]]]:
    """``fresh()`` gives a new database URL and its server port per level ("" and None for
    SQLite, which lives in the orchestrator's run directory)."""
    if kind == "sqlite":
        yield lambda: ("", None)
        return
    from swarmrl.testing.postgres import private_postgres

    with private_postgres() as base:
        admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")

        def fresh() -> tuple[str, int | None]:
            name = f"bench_{uuid.uuid4().hex[:12]}"
            with admin.connect() as conn:
                conn.execute(sa.text(f"CREATE DATABASE {name}"))
                conn.execute(sa.text(f"ALTER DATABASE {name} SET synchronous_commit = off"))
            return base.rsplit("/", 1)[0] + "/" + name, sa.engine.make_url(base).port

        try:
            yield fresh
        finally:
            admin.dispose()


def request_costs(
    url: str, pid: int, n: int = 50, rounds: int = 5, counter: Callable[[int], float] | None = None
) -> dict[str, dict]:
    """Server CPU milliseconds per request of each kind, sent one at a time (no queueing):
    ``rounds`` rounds of ``n`` requests per kind; the median and range of the rounds' means.
    ``counter(pid)``: CPU seconds so far (default: the process group, :func:`cpu_seconds`)."""
    counter = counter or cpu_seconds
    clients = [PoolClient(url, KeyPair.generate()) for _ in range(n)]
    for c in clients:
        c.join(POOL, CPU_NODE)

    def cost(items: list, call) -> tuple[float, list]:  # type: ignore[no-untyped-def]
        cpu0 = counter(pid)
        out = [call(x) for x in items]
        return (counter(pid) - cpu0) / len(items) * 1000, out

    beat = Heartbeat(status="ok", model_version=0, log_tail=["step ok"])
    seen: dict[str, list[float]] = {"heartbeat": [], "lease": [], "submit": []}
    for _ in range(rounds):
        seen["heartbeat"].append(cost(clients * 2, lambda c: c.heartbeat(POOL, beat))[0])
        spent, leased = cost(clients, lambda c: (c, c.lease(POOL).work))
        seen["lease"].append(spent)
        subs = [
            (c, Submission(lease_id=w.lease_id, samples=synthetic_samples(w, 0))) for c, w in leased
        ]
        seen["submit"].append(cost(subs, lambda cs: cs[0].submit(POOL, cs[1]))[0])
    for c in clients:
        c.close()
    return {
        kind: {
            "median": round(percentile(v, 0.5), 2),
            "min": round(min(v), 2),
            "max": round(max(v), 2),
        }
        for kind, v in seen.items()
    }


def measure_level(
    n: int, spec: PoolSpec, args: argparse.Namespace, db_url: str, db_port: int | None
) -> dict:
    """One level: a fresh orchestrator (and database) driven by ``n`` nodes."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_orchestrator(Path(tmp), spec, db_url, args.workers, args.fronts)
        try:
            load0 = os.getloadavg()[0]
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            own0 = own_cpu_seconds(proc.pid)
            db0 = postgres_cpu_seconds(db_port)
            kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            row = run_level(url, n, args)
            wall = time.monotonic() - t0
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            client_cpu = kids.ru_utime + kids.ru_stime - kids0.ru_utime - kids0.ru_stime
            row["db"], row["workers"], row["fronts"] = args.db, args.workers, args.fronts
            row["server_cpu_share"] = round((cpu_seconds(proc.pid) - cpu0) / wall, 2)
            row["orchestrator_cpu_share"] = round((own_cpu_seconds(proc.pid) - own0) / wall, 2)
            row["db_cpu_share"] = round((postgres_cpu_seconds(db_port) - db0) / wall, 2)
            row["client_cpu_share"] = round(client_cpu / wall, 2)
            row["load_1min"] = [round(load0, 1), round(os.getloadavg()[0], 1)]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--beat-s", type=float, default=10.0, help="heartbeat period")
    parser.add_argument("--unit-s", type=float, default=30.0, help="simulated work per unit")
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument(
        "--client-gc",
        action="store_true",
        help="leave the client processes' garbage collector on in the window (its pauses are "
        "then counted as latency; module docstring)",
    )
    parser.add_argument(
        "--costs", action="store_true", help="only measure server CPU per request, one at a time"
    )
    parser.add_argument(
        "--costs-nodes",
        type=int,
        default=50,
        help="--costs: nodes, each sending 2 heartbeats, 1 lease and 1 submission a round (more "
        "of them resolve finer than /proc's 10 ms CPU ticks: 500 resolve 0.01 ms a heartbeat)",
    )
    parser.add_argument(
        "--db",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="the pool database (postgresql: a private server started for the run)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="orchestrator server processes (PostgreSQL only)"
    )
    parser.add_argument(
        "--fronts", type=int, default=0, help="orchestrator front processes (0: none)"
    )
    args = parser.parse_args()
    spec = bench_spec(lease_timeout_s=args.unit_s * 4)
    with database(args.db) as fresh:
        if args.costs:
            with tempfile.TemporaryDirectory() as tmp:
                proc, url = start_orchestrator(
                    Path(tmp), spec, fresh()[0], args.workers, args.fronts
                )
                try:
                    costs = request_costs(url, proc.pid, n=args.costs_nodes)
                    print(json.dumps({"server_cpu_ms_per_request": costs}))
                    if args.fronts:  # the orchestrator alone, its fronts left out
                        own = request_costs(
                            url, proc.pid, n=args.costs_nodes, counter=own_cpu_seconds
                        )
                        print(json.dumps({"orchestrator_cpu_ms_per_request": own}))
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
            return
        rows = [measure_level(n, spec, args, *fresh()) for n in args.nodes]
    print(
        "\n| nodes | db, workers, fronts | load (start → end) | req/s | p50 ms | p99 ms | max ms "
        "| server CPU (orchestrator) | db CPU | client CPU | client stall ms | errors |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        errors = sum(r["errors"].values())
        load = " → ".join(str(x) for x in r["load_1min"])
        print(
            f"| {r['nodes']} | {r['db']}, {r['workers']}, {r['fronts']} | {load} "
            f"| {r['req_per_s']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} "
            f"| {r['server_cpu_share']:.0%} ({r['orchestrator_cpu_share']:.0%}) "
            f"| {r['db_cpu_share']:.0%} | {r['client_cpu_share']:.0%} | {r['client_stall_ms']} "
            f"| {errors} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
        plot_timeline(rows, Path(args.out).with_suffix(".png"))
        print(f'per-second timeline: {args.out} ("timeline"), {Path(args.out).with_suffix(".png")}')


if __name__ == "__main__":
    main()
