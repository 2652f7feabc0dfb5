"""Weight distribution across shaped links on one machine: publication to the last worker.

An origin, optionally a relay, and ``--workers`` workers, each in its own network namespace
(``swarmrl.testing.hosts``; needs root). The origin's uplink is capped at ``--origin-mbit``,
each worker's downlink at ``--worker-mbit``, and the origin's port sits behind a
``linkproxy`` adding ``--delay-ms`` each way. Every worker parks a long-poll
(``WeightClient.fetch_newer``); then one version of ``--size-mib`` is published and the time to
the last worker holding it (verified) is set against the bound the links allow:

- direct: every worker pulls from the origin, whose uplink carries the version once per worker:
  ``max(workers * size / origin_rate, size / worker_rate)``;
- relay: the relay pulls it once and serves the workers:
  ``max(size / origin_rate, size / worker_rate)``.

A relay passes a shard on once it holds all of it, so a version smaller than one shard (the
default shard is 32 MiB) crosses the two hops one after the other; ``--shard-kib`` sets smaller
shards.

``--delta``: once every worker holds that version, a second one is published, the first with
every weight moved by a step of relative size 1e-3 (each float32's low mantissa bits change),
which travels as a delta blob; its time to the last worker is set against the same bound for
the blob's size (and the full version's time against the full size).

The relay tier (a relay next to the workers, a slow far link to the origin):
``--origin-mbit 20 --worker-mbit 100`` (150 ms RTT to the origin by default).

Usage (as root): ``python bench/hosts.py [--runs 2] [--size-mib 8] [--workers 3] [--shard-kib N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher
from swarmrl.testing.hosts import TestBed
from swarmrl.testing.shardcast import random_weights, write_checkpoint

SWARMRL = [sys.executable, "-m", "swarmrl.cli"]
WORKER = """
import sys, time
from swarmrl.shardcast import WeightClient
client = WeightClient([sys.argv[1]], sys.argv[2], sys.argv[3], client_id=sys.argv[4])
print("parked", flush=True)
for _ in range(int(sys.argv[5])):
    client.fetch_newer(timeout_s=300)
    print(time.time(), flush=True)
"""


def one_run(args: argparse.Namespace, relay: bool, work: Path) -> list[tuple[float, float]]:
    """For the version (and with ``--delta`` the delta after it): (seconds from publication to
    the last worker holding it, the links' bound)."""
    key = KeyPair.from_seed(b"\x37" * 32)
    weights = random_weights(args.size_mib * 1024 * 1024 // 4, seed=5)
    checkpoint = write_checkpoint(work / "ck", weights)
    size_bits = sum(f.stat().st_size for f in checkpoint.iterdir()) * 8
    (work / "store").mkdir()
    with TestBed() as bed:
        origin = bed.add_host("origin", up_mbit=args.origin_mbit)
        served = origin.popen(
            SWARMRL
            + ["shardcast", "serve-origin", "--store", str(work / "store")]
            + ["--host", origin.address, "--port", "8470", "--log-level", "WARNING"]
        )
        bed.wait_port(origin, 8470, served)
        origin.proxy(8480, (origin.address, 8470), delay_ms=args.delay_ms)
        source = f"http://{origin.address}:8480"
        if relay:
            near = bed.add_host("relay")
            following = near.popen(
                SWARMRL
                + ["relay", "--upstream", source, "--publisher-key", key.public_key_hex]
                + ["--store", str(work / "relay"), "--host", near.address, "--port", "8471"]
                + ["--log-level", "WARNING"]
                + [arg for item in args.relay_set for arg in ("--set", f"shardcast.{item}")]
            )
            bed.wait_port(near, 8471, following)
            source = f"http://{near.address}:8471"
        workers = []
        for i in range(args.workers):
            host = bed.add_host(f"w{i}", down_mbit=args.worker_mbit)
            out = str(work / f"w{i}")
            proc = host.popen(
                [sys.executable, "-c", WORKER, source, key.public_key_hex, out, f"w{i}"]
                + [str(2 if args.delta else 1)],
                stdout=subprocess.PIPE,
            )
            workers.append(proc)
        for proc in workers:
            if proc.stdout.readline().strip() != b"parked":
                raise RuntimeError("a worker exited before parking its long-poll")
        time.sleep(1.0)  # the long-polls reach their source
        cfg = ShardcastConfig(shard_size_bytes=args.shard_kib * 1024)
        publisher = Publisher(work / "store", key, cfg)
        publisher.publish(checkpoint, 1)
        published = time.time()
        held = [float(proc.stdout.readline()) for proc in workers]
        results = [(max(held) - published, bound(args, relay, size_bits))]
        if args.delta:
            stepped = {name: w * np.float32(1 + 1e-3) for name, w in weights.items()}
            manifest = publisher.publish(write_checkpoint(work / "ck2", stepped), 2)
            published = time.time()
            held = [float(proc.stdout.readline()) for proc in workers]
            delta_bits = sum(d.size for d in manifest.deltas) * 8
            results.append((max(held) - published, bound(args, relay, delta_bits)))
    return results


def bound(args: argparse.Namespace, relay: bool, size_bits: float) -> float:
    """Seconds the links need at least: the origin's uplink carries one copy per worker (direct)
    or one in all (relay), each worker's downlink one."""
    copies = 1 if relay else args.workers
    return max(copies * size_bits / (args.origin_mbit * 1e6), size_bits / (args.worker_mbit * 1e6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--size-mib", type=int, default=8)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--origin-mbit", type=float, default=40.0)
    parser.add_argument("--worker-mbit", type=float, default=20.0)
    parser.add_argument(
        "--shard-kib", type=int, default=32768, help="shard size (a relay forwards whole shards)"
    )
    parser.add_argument("--delay-ms", type=float, default=75.0, help="one way, origin's link")
    parser.add_argument("--delta", action="store_true", help="then a delta version (docstring)")
    parser.add_argument(
        "--relay-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="[shardcast] settings of the relay, e.g. relay_parallel_downloads=8",
    )
    args = parser.parse_args()
    print(
        f"{args.size_mib} MiB, {args.workers} workers at {args.worker_mbit:g} Mbit/s down, "
        f"origin {args.origin_mbit:g} Mbit/s up, {2 * args.delay_ms:g} ms RTT to the origin, "
        f"{args.shard_kib} KiB shards"
    )
    print("load at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    results: dict[bool, list[list[tuple[float, float]]]] = {False: [], True: []}
    for _ in range(args.runs):  # direct and relay alternated
        for relay in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                results[relay].append(one_run(args, relay, Path(tmp)))
    for relay in (False, True):
        for i, what in enumerate(["full", "delta"][: 2 if args.delta else 1]):
            seconds = [run[i][0] for run in results[relay]]
            least = results[relay][0][i][1]
            print(
                f"{'relay ' if relay else 'direct'} {what}: last worker after "
                f"{statistics.median(seconds):.2f} s (runs {', '.join(f'{s:.2f}' for s in seconds)}), "
                f"bound {least:.2f} s, ratio {statistics.median(seconds) / least:.2f} "
                f"({min(seconds) / least:.2f}-{max(seconds) / least:.2f})"
            )
    print("load at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
