"""Heartbeat latency of the orchestrator while strangers reload its dashboard's ledger page.

The orchestrator (``swarmrl orchestrator``, SQLite, its own process) hosts ``bench/pool.py``'s
open pool over a database whose ledger already holds ``--entries`` signed entries (node joins
about the size of a real run's entries). Simulated nodes heartbeat, lease and submit as in
``bench/pool.py`` (``bench/pool_load.py``); in the "reloaders" condition ``--reloaders`` clients,
each from its own loopback address (127.0.0.2, .3, …: each is a different client to the
dashboard's rate limit), reload ``/ui/ledger`` in a loop for the whole measured window, each
starting the next load as soon as the last answered, whatever the answer (a 429 included).
Reported per trial: the nodes' heartbeat p50/p99/max, the reloaders' answers by status and
their latency, and the orchestrator's largest resident memory in the window. Conditions
alternate (quiet, reloaders, quiet, …), each trial with a fresh orchestrator. Run from the
repository root:

    python bench/dashboard.py --nodes 100 --entries 20000 --beat-s 1 --repeat 2

Knows nothing about the dashboard beyond its URL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from pool import bench_spec, run_level  # this script's siblings
from swarmrl.identity import KeyPair
from swarmrl.ledger.chain import Entry, Ledger
from swarmrl.pool.server import make_context
from swarmrl.pool.trust import service
from swarmrl.protocol.pool import PoolSpec
from swarmrl.testing.pool_nodes import spawn_orchestrator


def filled_run(tmp: Path, entries: int, spec: PoolSpec) -> Path:
    """An orchestrator key and database holding the pool and ``entries`` ledger entries."""
    orch = KeyPair.generate()
    orch.save(tmp / "orch.json")
    ctx = make_context(orch, tmp / "run")
    service.create_pool(ctx, spec)
    nodes = [KeyPair.generate().node_id for _ in range(200)]
    with ctx.engine.begin() as conn:
        Ledger(orch).append_many(
            conn,
            [
                Entry(
                    "node_joined",
                    {"metadata": {"note": "x" * 400, "i": i}},
                    pool_id=spec.pool_id,
                    node_id=nodes[i % len(nodes)],
                )
                for i in range(entries)
            ],
        )
    ctx.engine.dispose()
    (tmp / "spec.json").write_text(spec.model_dump_json())
    return tmp / "run"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reload_loop(url: str, address: str, t0: float, t1: float, out: dict) -> None:
    """Reload the ledger page from ``address`` until ``t1``, as fast as answers come."""
    codes: Counter[int | str] = Counter()
    lat: list[float] = []
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, timeout=60) as client:
        time.sleep(max(0.0, t0 - time.time()))
        while time.time() < t1:
            begun = time.perf_counter()
            try:
                codes[client.get(f"{url}/ui/ledger").status_code] += 1
            except httpx.HTTPError as exc:
                codes[type(exc).__name__] += 1
            lat.append(time.perf_counter() - begun)
    out[address] = {"codes": dict(codes), "lat": lat}


def trial(args: argparse.Namespace, reloaders: int) -> dict:
    spec = bench_spec(lease_timeout_s=args.unit_s * 4)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        run = filled_run(tmp, args.entries, spec)
        joins = {"pool.join_rate_per_s": 1000, "pool.join_burst": 20000}
        proc, url = spawn_orchestrator(run, tmp / "orch.json", [tmp / "spec.json"], settings=joins)
        try:
            t0 = time.time() + args.warmup
            t1 = t0 + args.duration
            pages: dict[str, dict] = {}
            threads = [
                threading.Thread(target=reload_loop, args=(url, f"127.0.0.{2 + i}", t0, t1, pages))
                for i in range(reloaders)
            ]
            rss: list[float] = []

            def watch() -> None:
                while time.time() < t1:
                    if time.time() >= t0:
                        rss.append(rss_mib(proc.pid))
                    time.sleep(0.5)

            threads.append(threading.Thread(target=watch))
            for t in threads:
                t.start()
            load0 = os.getloadavg()[0]
            row = run_level(url, args.nodes, args)
            for t in threads:
                t.join()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    page_lat = sorted(x for p in pages.values() for x in p["lat"])
    codes: Counter = Counter()
    for p in pages.values():
        codes.update(p["codes"])
    return {
        "reloaders": reloaders,
        "heartbeat": row["by_kind"].get("heartbeat"),
        "all_p99_ms": row["p99_ms"],
        "max_ms": row["max_ms"],
        "errors": row["errors"],
        "client_stall_ms": row["client_stall_ms"],
        "page_codes": dict(codes),
        "page_p50_ms": round(page_lat[len(page_lat) // 2] * 1000, 1) if page_lat else None,
        "page_max_ms": round(page_lat[-1] * 1000, 1) if page_lat else None,
        "rss_mib_max": round(max(rss), 1) if rss else None,
        "load_1min": [round(load0, 1), round(os.getloadavg()[0], 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--entries", type=int, default=20_000, help="ledger entries to start with")
    parser.add_argument("--reloaders", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="trials per condition")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds a trial")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring")
    parser.add_argument("--beat-s", type=float, default=1.0, help="heartbeat period")
    parser.add_argument("--unit-s", type=float, default=5.0, help="simulated work per unit")
    parser.add_argument("--procs", type=int, default=1, help="client processes for the nodes")
    parser.add_argument("--client-gc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        for reloaders in (0, args.reloaders):
            rows.append(trial(args, reloaders))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| reloaders | heartbeat p99 ms: median (range) | heartbeat max ms | pages answered |")
    print("|---:|---|---|---|")
    for n in (0, args.reloaders):
        mine = [r for r in rows if r["reloaders"] == n]
        p99 = [r["heartbeat"]["p99_ms"] for r in mine]
        print(
            f"| {n} | {statistics.median(p99)} ({min(p99)}–{max(p99)}) "
            f"| {', '.join(str(r['max_ms']) for r in mine)} "
            f"| {'; '.join(json.dumps(r['page_codes']) for r in mine)} |"
        )


if __name__ == "__main__":
    main()
