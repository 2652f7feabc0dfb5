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

The load generator (``bench/pool_load.py``) runs the window with its garbage collector off,
so that its own pauses are not counted as the server's latency, and reports its longest
event-loop stall as "client stall" (that module's docstring; ``--client-gc`` leaves the
collector on).

Time compression: ``--beat-s`` and ``--unit-s`` scale the real intervals (10 s and 30 s by
default, i.e. uncompressed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import sqlalchemy as sa

from latency import ms_at, percentile, plot_timeline, timeline  # this script's siblings
from pool_load import POOL, drive_process
from proc_cpu import cpu_seconds, own_cpu_seconds, postgres_cpu_seconds
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, PoolSpec, Submission
from swarmrl.testing.pool_nodes import CPU_NODE, spawn_orchestrator, synthetic_samples


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


def run_level(url: str, n_nodes: int, args: argparse.Namespace) -> dict:
    """Drive ``n_nodes`` nodes from ``args.procs`` client processes; summarise the window."""
    t0 = time.time() + args.warmup
    t1 = t0 + args.duration
    shares = [n_nodes // args.procs + (i < n_nodes % args.procs) for i in range(args.procs)]
    with multiprocessing.get_context("spawn").Pool(args.procs, initializer=os.setsid) as pool:
        recs = pool.map(drive_process, [(url, k, args, t0, t1) for k in shares if k])
    t0 = recs[0].t0  # later where the window opens once all nodes joined (pool_load)
    lat: dict[str, list[float]] = {}
    errors: Counter[str] = Counter()
    join_errors: Counter[str] = Counter()
    for rec in recs:
        for k, v in rec.lat.items():
            lat.setdefault(k, []).extend(v)
        errors.update(rec.errors)
        join_errors.update(rec.join_errors)
    all_lat = [x for v in lat.values() for x in v]
    return {
        "nodes": n_nodes,
        "requests": len(all_lat),
        # answered inside the window, whenever asked (a backlogged server answers fewer than
        # were asked in it): what the server's CPU in the window was spent on
        "answered": sum(rec.answered for rec in recs),
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
        "errors": dict(errors),
        "client_stall_ms": round(max(rec.stall_s for rec in recs) * 1000, 1),
        "join_errors": dict(join_errors),  # before the window; a node refused 5 times takes no part
        # < unit-s means nodes were still ramping up (first leases) inside the window
        "joined_s_before_window": round(t0 - max(rec.joined_at for rec in recs), 1),
        "window_start": round(t0, 3),  # Unix time
        "timeline": timeline([m for rec in recs for m in rec.moments], int(args.duration)),
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
