"""What each private HTTP and storage piece buys, measured against its public path.

The orchestrator under the pool bench's load (``bench/pool.py``: N simulated nodes on loopback,
heartbeats every 10 s, lease → 30 s of "work" → submission), one fresh server per run, in these
arms (the settings that turn each piece off: ``docs/config.md``):

- ``base``: as shipped (hot routes, direct lane, statements to SQLite's driver, no fronts);
- ``no_lane``: ``pool.direct_lane = false`` (the hot routes answered inside the ASGI app);
- ``no_hot``: ``pool.hot_routes = false`` (their FastAPI routes; no lane either);
- ``no_fastsql``: ``pool.fast_sql = false`` (every statement through SQLAlchemy);
- ``fronts``: ``--fronts 1`` (one front process parses HTTP and checks signatures);
- ``granian``: the same app served by granian (``bench/granian_orchestrator.py``; needs
  ``pip install granian``; skipped without it).

Each round runs every arm once at each size, the arms in turn (reversed every other round), so
each arm sits beside the baseline of its own round. A piece's ratio in a round is the public
path's figure over the piece's: server CPU per request answered in the window (all server
processes; > 1: the piece saves CPU) and p99 latency (> 1: the piece lowers p99). The pieces
and the arms they compare: direct lane ``no_lane / base``; hot routes ``no_hot / no_lane``;
fastsql ``no_fastsql / base``; fronts ``base / fronts`` (the piece is the ``fronts`` arm; also
the orchestrator's own process alone, the CPU the fronts take off it);
granian ``base / granian`` and ``no_lane / granian`` (uvicorn as shipped, and uvicorn serving
the same ASGI path granian serves).

Zero-copy on the weight bench (``bench/shardcast.py``'s single-client case): one origin, two
relays of it, one with ``shardcast.zero_copy = false``; a client fetches the version from each
in turn (alternated, which goes first swaps each pair); ratios streamed / zero-copy of the
relay's CPU seconds and of the fetch's wall time.

A run on a loaded machine can leave the 5,000-node server behind its offered load (it
answers fewer requests than it is asked, p50 in seconds): CPU per request is then taken per
request *answered* in the window, which stays comparable, while p99 measures the backlog.
The window opens ``--settle-s`` after the last node joined (``bench/pool_load.py``), so joins
slowed by the machine's load are never measured.

Everything goes to ``--out`` (JSON) and a PNG of the ratios beside it; ``--from`` redraws the
table and plot from results files taken together. The default run took 27 minutes on 2 cores
shared with other work (load 9–20; granian installed):

    python bench/pieces.py --out bench/pieces-results.json
    python bench/pieces.py --rounds 3 --arms base no_lane granian --zc-pairs 0   # granian only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pool import bench_spec, run_level  # this script's siblings
from proc_cpu import cpu_seconds, own_cpu_seconds
from swarmrl.identity import KeyPair
from swarmrl.testing.pool_nodes import spawn_orchestrator

ARMS = {
    "base": {},
    "no_lane": {"pool.direct_lane": "false"},
    "no_hot": {"pool.hot_routes": "false"},
    "no_fastsql": {"pool.fast_sql": "false"},
    "fronts": {},
    "granian": {},
}
# piece → (public path's arm, the piece's arm, CPU counted): ratio = public / piece; CPU of
# all server processes, or of the orchestrator's own process alone (what fronts take off it)
PIECES = {
    "direct lane": ("no_lane", "base", "cpu_ms_per_request"),
    "hot routes": ("no_hot", "no_lane", "cpu_ms_per_request"),
    "fastsql": ("no_fastsql", "base", "cpu_ms_per_request"),
    "fronts": ("base", "fronts", "cpu_ms_per_request"),
    "fronts (orchestrator process alone)": ("base", "fronts", "own_cpu_ms_per_request"),
    "granian vs uvicorn as shipped": ("base", "granian", "cpu_ms_per_request"),
    "granian vs uvicorn, same ASGI path": ("no_lane", "granian", "cpu_ms_per_request"),
}
JOINS = {"pool.join_rate_per_s": 1000, "pool.join_burst": 20000}
HERE = Path(__file__).resolve().parent


def spawn_granian(tmp: Path, settings: dict) -> tuple[subprocess.Popen, str]:
    """The orchestrator app served by granian, as ``spawn_orchestrator`` starts uvicorn's."""
    run = tmp / "run"
    run.mkdir()
    port_file = run / "port"
    cmd = [sys.executable, str(HERE / "granian_orchestrator.py"), "--key", str(tmp / "orch.json")]
    cmd += ["--run-dir", str(run), "--port", "0", "--port-file", str(port_file)]
    cmd += ["--pool", str(tmp / "spec.json")]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    with (run / "orch.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError((run / "orch.log").read_text()[-2000:])
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"


def pool_run(arm: str, nodes: int, args: argparse.Namespace) -> dict:
    """One fresh orchestrator in ``arm`` driven by ``nodes`` nodes; the window's figures."""
    spec = bench_spec(lease_timeout_s=args.unit_s * 4)
    settings = {**JOINS, **ARMS[arm]}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        joined = tmp / "joined"  # the window opens once every node joined (bench/pool_load.py)
        joined.mkdir()
        clients = min(args.procs, nodes)
        run_args = argparse.Namespace(
            **{**vars(args), "warmup": 0.0, "joined_dir": str(joined), "joined_count": clients}
        )
        KeyPair.generate().save(tmp / "orch.json")
        (tmp / "spec.json").write_text(spec.model_dump_json())
        if arm == "granian":
            proc, url = spawn_granian(tmp, settings)
        else:
            extra = ["--fronts", "1"] if arm == "fronts" else []
            proc, url = spawn_orchestrator(
                tmp / "run", tmp / "orch.json", [tmp / "spec.json"], settings=settings, args=extra
            )
        try:
            load0 = os.getloadavg()[0]
            window = _WindowCpu(proc.pid, joined, clients, args)
            row = run_level(url, nodes, run_args)
            window.join()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    served = row["requests"] / args.duration
    # per request answered in the window: one asked and still queued cost nothing yet
    cpu_ms = window.cpu_s / max(row["answered"], 1) * 1000
    own_ms = window.own_cpu_s / max(row["answered"], 1) * 1000
    out = {
        "arm": arm,
        "nodes": nodes,
        "req_per_s": round(served, 1),
        "answered_per_s": round(row["answered"] / args.duration, 1),
        "p50_ms": row["p50_ms"],
        "p99_ms": row["p99_ms"],
        "cpu_share": round(window.cpu_s / args.duration, 3),
        "cpu_ms_per_request": round(cpu_ms, 4),
        "own_cpu_ms_per_request": round(own_ms, 4),
        "errors": sum(row["errors"].values()),
        "error_kinds": row["errors"],  # "<call>: <code or exception>": count
        "client_stall_ms": row["client_stall_ms"],
        # < 0: the last node joined inside the window (the server was still busy with joins)
        "joined_s_before_window": row["joined_s_before_window"],
        "load": [round(load0, 1), round(os.getloadavg()[0], 1)],
    }
    print(json.dumps(out), flush=True)
    return out


class _WindowCpu(threading.Thread):
    """CPU seconds of the server's process group (``cpu_s``) and of its first process alone
    (``own_cpu_s``) in the window the client processes open once all their nodes joined
    (``bench/pool_load.py``, ``window_after_joins``)."""

    def __init__(self, pid: int, joined: Path, clients: int, args: argparse.Namespace) -> None:
        super().__init__(daemon=True)
        self.pid, self.joined, self.clients = pid, joined, clients
        self.settle_s, self.duration = args.settle_s, args.duration
        self.cpu_s = self.own_cpu_s = float("nan")
        self.start()

    def run(self) -> None:
        while len(found := list(self.joined.glob("*.joined"))) < self.clients:
            time.sleep(0.05)
        t0 = max(float(f.read_text()) for f in found) + self.settle_s
        time.sleep(max(0.0, t0 - time.time()))
        cpu0, own0 = cpu_seconds(self.pid), own_cpu_seconds(self.pid)
        time.sleep(self.duration)
        self.cpu_s = cpu_seconds(self.pid) - cpu0
        self.own_cpu_s = own_cpu_seconds(self.pid) - own0


def pool_rounds(args: argparse.Namespace) -> list[dict]:
    runs = []
    for r in range(args.rounds):
        for nodes in args.nodes:
            order = args.arms if r % 2 == 0 else args.arms[::-1]
            for arm in order:
                runs.append({"round": r, **pool_run(arm, nodes, args)})
    return runs


def pool_ratios(runs: list[dict]) -> list[dict]:
    """Each piece's ratios at each size, one per round whose two runs both had every node
    joined before their window opened (a run still joining spends its window on joins)."""
    found = []
    for piece, (public, private, counted) in PIECES.items():
        for nodes in sorted({x["nodes"] for x in runs}):
            cpu, p99, skipped = [], [], 0
            for r in sorted({x["round"] for x in runs}):
                pair = {x["arm"]: x for x in runs if x["round"] == r and x["nodes"] == nodes}
                if public not in pair or private not in pair:
                    continue
                a, b = pair[public], pair[private]
                if min(a["joined_s_before_window"], b["joined_s_before_window"]) < 0:
                    skipped += 1
                    continue
                cpu.append(a[counted] / b[counted])
                p99.append(a["p99_ms"] / b["p99_ms"])
            if cpu:
                bench = f"pool, {nodes} nodes"
                found.append(
                    {"piece": piece, "bench": bench, **_summary(cpu, p99), "skipped": skipped}
                )
    return found


def _summary(cost: list[float], other: list[float]) -> dict:
    return {
        "cpu_ratio": _stats(cost),
        "second_ratio": _stats(other),
        "runs": len(cost),
    }


def _stats(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "all": [round(v, 3) for v in values],
    }


def zero_copy(args: argparse.Namespace) -> dict:
    """Relay CPU and fetch time, streamed over zero-copy, alternated (module docstring)."""
    import shardcast_procs as P
    from swarmrl.shardcast import Publisher, WeightClient

    key = KeyPair.from_seed(P.KEY_SEED)
    work = Path(tempfile.mkdtemp(prefix="pieces-zc-", dir=args.work))
    procs = []
    try:
        ck = work / "ck"
        ck.mkdir()
        P.random_file(ck / "model.safetensors", args.zc_size_mib << 20)
        Publisher(work / "origin", key).publish(ck, 1)
        origin, origin_url = P.spawn(
            [
                P.PY,
                "-m",
                "swarmrl.cli",
                "shardcast",
                "serve-origin",
                "--store",
                str(work / "origin"),
            ]
            + ["--port", "0", "--log-level", "WARNING"],
            "origin",
        )
        procs.append(origin)
        relays = {}
        for arm, value in (("zero_copy", "true"), ("streamed", "false")):
            proc, url = P.spawn(
                [P.PY, "-m", "swarmrl.cli", "relay", "--upstream", origin_url]
                + ["--publisher-key", key.public_key_hex, "--store", str(work / arm)]
                + ["--port", "0", "--log-level", "WARNING"]
                + ["--set", f"shardcast.zero_copy={value}"],
                arm,
            )
            procs.append(proc)
            relays[arm] = (proc, url)
            P.wait_until(lambda u=url: P.relay_has(u, 1), 300, f"{arm} relay to replicate")
        seen: dict[str, dict[str, list[float]]] = {a: {"s": [], "cpu": []} for a in relays}
        for pair in range(args.zc_pairs + 1):  # pair 0 warms both up, not counted
            order = list(relays) if pair % 2 == 0 else list(relays)[::-1]
            for arm in order:
                proc, url = relays[arm]
                P.settle(1.0)
                client = WeightClient([url], key.public_key_hex, work / "out")
                cpu0, t0 = P.cpu_of(proc.pid), time.perf_counter()
                client.fetch(1)
                seconds, cpu = time.perf_counter() - t0, P.cpu_of(proc.pid) - cpu0
                P.remove(work / "out")
                if pair > 0:
                    seen[arm]["s"].append(seconds)
                    seen[arm]["cpu"].append(cpu)
                    print(json.dumps({"arm": arm, "pair": pair, "s": seconds, "relay_cpu_s": cpu}))
    finally:
        P.stop(procs)
        P.remove(work)
    cpu = [a / b for a, b in zip(seen["streamed"]["cpu"], seen["zero_copy"]["cpu"], strict=True)]
    wall = [a / b for a, b in zip(seen["streamed"]["s"], seen["zero_copy"]["s"], strict=True)]
    return {
        "piece": "zero-copy",
        "bench": f"weights, one client, {args.zc_size_mib} MiB",
        **_summary(cpu, wall),
        "runs_raw": seen,
    }


def plot(ratios: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(ratios) + 2), sharey=True)
    labels = [f"{r['piece']} ({r['bench']})" for r in ratios]
    for ax, key, title in (
        (axes[0], "cpu_ratio", "server CPU per request: public path / piece"),
        (axes[1], "second_ratio", "p99 (pool) or fetch time (weights): public path / piece"),
    ):
        for i, r in enumerate(ratios):
            ax.scatter(r[key]["all"], [i] * len(r[key]["all"]), color="tab:blue", s=18)
            ax.scatter([r[key]["median"]], [i], color="tab:red", marker="|", s=300)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(1.1, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks(range(len(ratios)), labels, fontsize=8)
    fig.suptitle("> 1: the piece pays (dots: rounds/pairs; bar: median; dashed: 1.1)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument(
        "--settle-s", type=float, default=8.0, help="from the last node joined to the window"
    )
    parser.add_argument("--beat-s", type=float, default=10.0)
    parser.add_argument("--unit-s", type=float, default=30.0)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--client-gc", action="store_true")
    parser.add_argument("--zc-pairs", type=int, default=5, help="zero-copy pairs (0: skip)")
    parser.add_argument("--zc-size-mib", type=int, default=512)
    parser.add_argument("--work", default=None, help="scratch directory of the weight bench")
    parser.add_argument("--out", default=None, help="results JSON (and a PNG beside it)")
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        default=None,
        help="measure nothing: the table and plot of these results files taken together",
    )
    args = parser.parse_args()
    if args.sources:
        runs, zero, loads = merged(args.sources)
        report(runs, zero, loads, args.out)
        return
    if "granian" in args.arms:
        try:
            import granian  # noqa: F401
        except ImportError:
            print("granian is not installed: its arm is skipped", flush=True)
            args.arms = [a for a in args.arms if a != "granian"]
    started = time.time()
    load = [round(os.getloadavg()[0], 1)]
    runs = pool_rounds(args) if args.rounds else []
    zero = [zero_copy(args)] if args.zc_pairs else []
    load.append(round(os.getloadavg()[0], 1))
    print(f"{time.time() - started:.0f} s")
    report(runs, zero, [load], args.out)


def merged(sources: list[str]) -> tuple[list[dict], list[dict], list[list[float]]]:
    """The runs of several results files (their rounds kept apart), their zero-copy pairs
    as one, and their loads."""
    runs, zero, loads = [], [], []
    for n, source in enumerate(sources):
        found = json.loads(Path(source).read_text())
        runs += [{**x, "round": x["round"] + 1000 * n} for x in found["runs"]]
        zero += [r for r in found["ratios"] if r["piece"] == "zero-copy"]
        loads += found["load"] if isinstance(found["load"][0], list) else [found["load"]]
    if len(zero) > 1:
        cpu = [v for r in zero for v in r["cpu_ratio"]["all"]]
        wall = [v for r in zero for v in r["second_ratio"]["all"]]
        zero = [{**zero[0], **_summary(cpu, wall)}]
    return runs, zero, loads


def report(runs: list[dict], zero: list[dict], loads: list[list[float]], out: str | None) -> None:
    """The ratios as a Markdown table; with ``out``, the results JSON and PNG."""
    ratios = pool_ratios(runs) + zero
    print("\n| piece | bench | CPU ratio median (range) | p99 / time ratio median (range) | runs |")
    print("|---|---|---|---|---:|")
    for r in ratios:
        c, s = r["cpu_ratio"], r["second_ratio"]
        print(
            f"| {r['piece']} | {r['bench']} | {c['median']:.2f} ({c['min']:.2f}–{c['max']:.2f}) "
            f"| {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) | {r['runs']} |"
        )
    print("load (1 min, start → end):", "; ".join(" → ".join(map(str, x)) for x in loads))
    if out:
        path = Path(out)
        found = {"runs": runs, "ratios": ratios, "load": loads}
        path.write_text(json.dumps(found, indent=1) + "\n")
        plot(ratios, path.with_suffix(".png"))
        print(f"{path}, {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
