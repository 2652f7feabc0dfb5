"""The project's hostile HTTP probes against uvicorn as shipped and against granian, and the
relay's single-client fetch on each.

    python bench/granian_probes.py [--window-s 10] [--size-mib 512] [--fetch-runs 3]
                                   [--skip orchestrator,relay,fetch] [--probes NAME,…] [--out FILE]

Servers, each its own process (their memory is read from ``/proc``; a granian server's is its
whole process tree, the worker included):

- orchestrator, uvicorn: ``OrchestratorServer`` with tests/test_http_hostile.py's limits (2 s
  head, keep-alive and body timeouts, ``pool.max_body_bytes`` 4 MiB);
- orchestrator, granian: ``bench/granian_orchestrator.py`` with the same pool settings and a 2 s
  ``header_read_timeout`` (granian has no body size or body time limit of its own);
- one origin (``swarmrl shardcast serve-origin``) publishing ``--size-mib`` of random weights, and
  two relays following it: ``swarmrl relay`` and ``bench/granian_relay.py``, both with
  ``shardcast.header_timeout_s = 2`` and ``keep_alive_s = 2`` (the test's relay).

Each probe opens its sockets at once (raw sockets, this process), sends its bytes (the server may
cut them short) and reads until the server closes or ``--window-s`` passes. For every probe and
server: the statuses answered on each socket (``-`` none), when each socket was closed (``open``:
still open at the end of the window), and how far the server's peak RSS rose over what it held
before the probe (``VmHWM`` after resetting it through ``/proc/PID/clear_refs``). The probes are
those of tests/test_http_hostile.py and ``bench/hardening.py http`` (trickled chunked bodies,
bodies that never end, a huge head in one read, 28 MiB bodies, JSON nested too deep, garbage,
unknown routes) and those of tests/test_http_limits.py and tests/test_fastlane.py (silent and
slow heads, pipelining), plus readers that never read and request smuggling attempts.

``fetch``: one ``WeightClient`` fetching the published version from the uvicorn relay, the
granian relay and a uvicorn relay with ``shardcast.zero_copy = false`` (the ASGI streamed path
granian serves shards on) in turn (the order reversed each run; run 0 warms all, not counted),
as bench/shardcast.py's single-client part times it; each arm after ``shardcast_procs.settle``.
CPU: the client's and the relay's together, and the relay's alone (its whole process tree). Beside them, in the same turns,
bench/shardcast.py's plain loopback stream of the same file (its single-client ratio's
denominator).

Needs granian (``pip install granian`` into a venv; not a swarmrl dependency); run with that
venv's python. Prints progress to stderr and one JSON document to stdout (and ``--out``).
Measures and prints; knows nothing about thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shardcast_procs as P  # noqa: E402
from hostile_requests import (  # noqa: E402
    Sender,
    chunked,
    declared,
    huge_head,
    nested,
    never_reads,
    request_head,
    sends,
    slow_head,
    smuggle_cl_te,
    smuggle_te_obfuscated,
    smuggle_te_unknown,
    smuggle_two_lengths,
    trickle,
    unfinished,
)

BENCH = Path(__file__).resolve().parent
HEARTBEAT = "/pools/p1/heartbeat"  # uvicorn: the direct lane answers it
JOIN = "/pools/p1/join"  # FastAPI answers it
BODY_CAP = 4 << 20


def progress(message: str) -> None:
    print(f"[granian-probes] {message}", file=sys.stderr, flush=True)


# --- the servers -----------------------------------------------------------------------------


def serve_uvicorn_orchestrator(run_dir: str) -> None:
    """The orchestrator as tests/test_http_hostile.py runs it, until SIGTERM (a child process)."""
    import logging

    from swarmrl.config.pool import PoolConfig
    from swarmrl.identity import KeyPair
    from swarmrl.pool.server import OrchestratorServer, make_context
    from swarmrl.protocol.http_limits import HttpLimits

    logging.disable(logging.WARNING)
    limits = HttpLimits(head_timeout_s=2.0, keep_alive_s=2.0, body_timeout_s=2.0)
    ctx = make_context(KeyPair.generate(), run_dir, PoolConfig(max_body_bytes=BODY_CAP))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with OrchestratorServer(ctx, limits=limits) as server:
        print(f"serving on http://{server.host}:{server.port}", flush=True)
        done.wait()


def spawn_granian_orchestrator(work: Path) -> tuple[subprocess.Popen, str]:
    from swarmrl.identity import KeyPair

    KeyPair.generate().save(work / "orch.json")
    port_file = work / "granian.port"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "granian_orchestrator.py"), "--key", str(work / "orch.json")]
        + ["--run-dir", str(work / "granian-run"), "--port", "0", "--port-file", str(port_file)]
        + ["--set", f"pool.max_body_bytes={BODY_CAP}", "--head-timeout-s", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    P.wait_until(port_file.exists, 60, "the granian orchestrator")
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            todo += [int(c) for c in task.read_text().split()]
    return pids


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peaks(pid: int) -> dict[int, int]:
    """Reset ``VmHWM`` of ``pid``'s tree; the RSS of each, KiB."""
    held = {}
    for p in tree(pid):
        Path(f"/proc/{p}/clear_refs").write_text("5")
        held[p] = _kib(p, "VmRSS")
    return held


def peak_growth_mib(before: dict[int, int]) -> float:
    return sum(_kib(p, "VmHWM") - kib for p, kib in before.items()) / 1024


# --- the probes ------------------------------------------------------------------------------


def orchestrator_probes() -> dict[str, list[Sender]]:
    probes: dict[str, list[Sender]] = {
        "3 idle connections": sends(b"", 3),
        "slow head (a line per 0.5 s)": [lambda a, s, w: slow_head(a, JOIN, s, w)],
        "garbage request line": sends(b"GARBAGE\x01 / HTTP/1.1\r\n\r\n"),
        "unknown route": sends(request_head("GET", "/no/such/route", "Connection: close\r\n")),
        "3 pipelined GETs (/pools, unknown, /pools)": sends(
            request_head("GET", "/pools")
            + request_head("GET", "/no/such")
            + request_head("GET", "/pools")
        ),
        "20,000 pipelined GETs, never read": [
            lambda a, s, w: never_reads(a, request_head("GET", "/pools") * 20_000, s, w)
        ],
        "80,000 pipelined GETs, never read": [
            lambda a, s, w: never_reads(a, request_head("GET", "/pools") * 80_000, s, w)
        ],
    }
    for path, name in ((HEARTBEAT, "heartbeat"), (JOIN, "join")):
        probes |= {
            f"{name}: 3 x 1.5 MB trickled in 2-byte chunks": sends(trickle(path, 1_500_000), 3),
            f"{name}: body that never ends": sends(unfinished(path)),
            f"{name}: 120 KB head in one read": sends(huge_head(path)),
            f"{name}: 28 MiB body (Content-Length)": sends(declared(path, 28 << 20)),
            f"{name}: 28 MiB body (64 KiB chunks)": sends(chunked(path, 28 << 20)),
            f"{name}: JSON nested 5,000 deep": sends(nested(path)),
            f"{name}: smuggling CL + TE": sends(smuggle_cl_te(path)),
            f"{name}: smuggling two Content-Lengths": sends(smuggle_two_lengths(path)),
            f"{name}: smuggling 'Transfer-Encoding :'": sends(smuggle_te_obfuscated(path)),
            f"{name}: smuggling TE 'chunked, identity'": sends(smuggle_te_unknown(path)),
        }
    return probes


def relay_probes() -> dict[str, list[Sender]]:
    return {
        "3 idle connections": sends(b"", 3),
        "slow head (a line per 0.5 s)": [lambda a, s, w: slow_head(a, "/versions", s, w)],
        "120 KB head in one read": sends(huge_head("/versions", "GET")),
        "long-poll whose body never ends": sends(unfinished("/versions/wait?after=99", "GET")),
        "200 KB trickled in 2-byte chunks": sends(trickle("/versions", 200_000)),
        "28 MiB body (Content-Length)": sends(declared("/versions", 28 << 20)),
        "garbage request line": sends(b"GARBAGE\x01 / HTTP/1.1\r\n\r\n"),
        "3 pipelined GETs (/versions, unknown, /versions)": sends(
            request_head("GET", "/versions")
            + request_head("GET", "/no/such")
            + request_head("GET", "/versions")
        ),
        "smuggling CL + TE": sends(smuggle_cl_te("/versions")),
        "smuggling two Content-Lengths": sends(smuggle_two_lengths("/versions")),
        "smuggling 'Transfer-Encoding :'": sends(smuggle_te_obfuscated("/versions")),
        "3 readers of a 32 MiB shard, never read": [
            lambda a, s, w: never_reads(a, request_head("GET", "/v/1/shard/0"), s, w)
        ]
        * 3,
    }


def run_probe(senders: list[Sender], address, pid: int, window_s: float) -> dict[str, Any]:
    before = reset_peaks(pid)
    start = time.monotonic()
    ends: list[tuple[str, float | None]] = [("-", None)] * len(senders)

    def one(i: int) -> None:
        ends[i] = senders[i](address, start, window_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(window_s + 15)
    grew = peak_growth_mib(before)
    return {
        "answers": [status for status, _ in ends],
        "closed_after_s": [None if e is None else round(e, 1) for _, e in ends],
        "peak_rss_growth_mib": round(grew, 1),
    }


def shown(result: dict[str, Any]) -> str:
    sockets = ", ".join(
        f"{a} {'open' if c is None else f'closed {c:.1f} s'}"
        for a, c in zip(result["answers"], result["closed_after_s"], strict=True)
    )
    return f"{sockets}; peak RSS {result['peak_rss_growth_mib']:+.1f} MiB"


def probe_servers(
    servers: dict[str, tuple[subprocess.Popen, str]],
    probes: dict[str, list[Sender]],
    window_s: float,
    what: str,
    only: list[str],
) -> dict[str, dict[str, Any]]:
    """Every probe (those naming one of ``only``, if any) on every server, the servers' order
    swapped probe by probe."""
    if only:
        probes = {name: p for name, p in probes.items() if any(o in name for o in only)}
    out: dict[str, dict[str, Any]] = {name: {} for name in probes}
    names = list(servers)
    for i, (name, senders) in enumerate(probes.items()):
        for server in names if i % 2 == 0 else names[::-1]:
            proc, url = servers[server]
            if proc.poll() is not None:
                raise RuntimeError(f"{what} on {server} has exited ({proc.returncode})")
            address = _address(url)
            out[name][server] = result = run_probe(senders, address, proc.pid, window_s)
            progress(f"{what} [{server}] {name}: {shown(result)}")
            time.sleep(0.5)
    return out


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# --- the relay's fetch -----------------------------------------------------------------------


def fetch_bench(
    relays: dict[str, tuple[subprocess.Popen, str]], work: Path, pubkey: str, ck: Path, args
) -> dict[str, Any]:
    """Each relay's fetch, and bench/shardcast.py's plain loopback stream of the same file."""
    from swarmrl.shardcast import WeightClient

    names = [*relays, "plain loopback stream"]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    relay_cpu: dict[str, list[float]] = {name: [] for name in relays}
    for run in range(args.fetch_runs + 1):  # run 0 warms every arm up, not counted
        for name in names if run % 2 == 0 else names[::-1]:
            P.settle(args.settle_s)
            if name not in relays:
                elapsed, used = P.plain_transfer(ck / "model.safetensors", work / "plain.out")
                P.remove(work / "plain.out")
            else:
                proc, url = relays[name]
                out = work / "fetched"
                client = WeightClient([url], pubkey, out)
                server_cpu = sum(P.cpu_of(p) for p in tree(proc.pid))
                client_cpu, started = time.process_time(), time.perf_counter()
                client.fetch(1)
                elapsed = time.perf_counter() - started
                served = sum(P.cpu_of(p) for p in tree(proc.pid)) - server_cpu
                used = time.process_time() - client_cpu + served
                if run > 0:
                    relay_cpu[name].append(served)
                P.remove(out)
            progress(f"fetch run {run} [{name}]: {elapsed:.2f} s, CPU {used:.2f} s")
            if run > 0:
                seconds[name].append(elapsed)
                cpu[name].append(used)
    size = args.size_mib << 20

    def summary(xs: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(xs), 3),
            "min": round(min(xs), 3),
            "max": round(max(xs), 3),
        }

    uv = statistics.median(seconds["uvicorn"])
    plain = seconds["plain loopback stream"]
    return {
        "bytes": size,
        "seconds": {name: summary(xs) for name, xs in seconds.items()},
        "MBps_median": {
            name: round(size / statistics.median(xs) / 1e6) for name, xs in seconds.items()
        },
        "cpu_s": {name: summary(xs) for name, xs in cpu.items()},
        "relay_cpu_s": {name: summary(xs) for name, xs in relay_cpu.items()},
        "throughput_over_uvicorn_median": {
            name: round(uv / statistics.median(xs), 3) for name, xs in seconds.items()
        },
        "throughput_over_uvicorn_per_run": {
            name: [round(u / x, 3) for u, x in zip(seconds["uvicorn"], xs, strict=True)]
            for name, xs in seconds.items()
        },
        "single_client_ratio_plain_over_relay_median": {
            name: round(statistics.median(plain) / statistics.median(xs), 3)
            for name, xs in seconds.items()
        },
    }


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    if sys.argv[1:2] == ["--serve-orchestrator"]:
        serve_uvicorn_orchestrator(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=10.0, help="how long a probe waits")
    parser.add_argument("--size-mib", type=int, default=512, help="the published weights")
    parser.add_argument("--fetch-runs", type=int, default=3, help="alternated fetches per relay")
    parser.add_argument("--settle-s", type=float, default=P.SETTLE_S)
    parser.add_argument("--skip", default="", help="comma list: orchestrator,relay,fetch")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument(
        "--probes", default="", help="comma list: run only probes whose name contains one"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    only = [o for o in args.probes.split(",") if o]
    import granian

    from swarmrl.identity import KeyPair
    from swarmrl.shardcast import Publisher

    results: dict[str, Any] = {
        "granian": granian.__version__,
        "window_s": args.window_s,
        "load_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="granian-probes-"))
    procs: list[subprocess.Popen] = []
    try:
        if "orchestrator" not in skip:
            servers = {
                "uvicorn": P.spawn(
                    [sys.executable, __file__, "--serve-orchestrator", str(work / "uvicorn-run")],
                    "the uvicorn orchestrator",
                ),
                "granian": spawn_granian_orchestrator(work),
            }
            procs += [proc for proc, _ in servers.values()]
            time.sleep(2)  # both past their start-up
            results["orchestrator"] = probe_servers(
                servers, orchestrator_probes(), args.window_s, "orchestrator", only
            )
            P.stop([proc for proc, _ in servers.values()])
        if not {"relay", "fetch"} <= skip:
            key = KeyPair.from_seed(P.KEY_SEED)
            P.check_disk(work, 4 * (args.size_mib << 20), "the relays")
            ck = work / "ck"
            ck.mkdir()
            P.random_file(ck / "model.safetensors", args.size_mib << 20)
            Publisher(work / "origin", key).publish(ck, 1)
            procs_, origin_url, _ = P.origin_and_relays(
                work, work / "origin", 0, key.public_key_hex
            )
            procs += procs_
            sets = ["--set", "shardcast.header_timeout_s=2", "--set", "shardcast.keep_alive_s=2"]
            granian_relay = P.spawn(
                [sys.executable, str(BENCH / "granian_relay.py"), "--upstream", origin_url]
                + ["--publisher-key", key.public_key_hex, "--store", str(work / "granian-relay")]
                + ["--port", "0", *sets],
                "the granian relay",
            )
            uvicorn_relay = P.spawn(
                [sys.executable, "-m", "swarmrl.cli", "relay", "--upstream", origin_url]
                + ["--publisher-key", key.public_key_hex, "--store", str(work / "uvicorn-relay")]
                + ["--port", "0", "--log-level", "WARNING", *sets],
                "the uvicorn relay",
            )
            procs += [granian_relay[0], uvicorn_relay[0]]
            relays = {"uvicorn": uvicorn_relay, "granian": granian_relay}
            if "fetch" not in skip:  # uvicorn on the same ASGI path as granian: no sendfile
                streamed = P.spawn(
                    [sys.executable, "-m", "swarmrl.cli", "relay", "--upstream", origin_url]
                    + ["--publisher-key", key.public_key_hex]
                    + ["--store", str(work / "streamed-relay"), "--port", "0"]
                    + ["--log-level", "WARNING", *sets, "--set", "shardcast.zero_copy=false"],
                    "the uvicorn relay without zero-copy",
                )
                procs.append(streamed[0])
            every = relays | ({"uvicorn, no zero-copy": streamed} if "fetch" not in skip else {})
            for _, url in every.values():
                P.wait_until(lambda url=url: P.relay_has(url, 1), 600, "a relay to replicate")
            progress("the relays hold version 1")
            if "relay" not in skip:
                results["relay"] = probe_servers(
                    relays, relay_probes(), args.window_s, "relay", only
                )
            if "fetch" not in skip:
                results["fetch"] = fetch_bench(every, work, key.public_key_hex, ck, args)
    finally:
        P.stop(procs)
        shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = round(time.monotonic() - began, 1)
    results["load_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
