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

Usage (as root): ``python bench/hosts.py [--runs 2] [--size-mib 8] [--workers 3] [--shard-kib N]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
client.fetch_newer(timeout_s=300)
print(time.time(), flush=True)
"""


def one_run(args: argparse.Namespace, relay: bool, work: Path) -> tuple[float, float]:
    """(seconds from publication to the last worker holding the version, the links' bound)."""
    key = KeyPair.from_seed(b"\x37" * 32)
    checkpoint = write_checkpoint(
        work / "ck", random_weights(args.size_mib * 1024 * 1024 // 4, seed=5)
    )
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
            )
            bed.wait_port(near, 8471, following)
            source = f"http://{near.address}:8471"
        workers = []
        for i in range(args.workers):
            host = bed.add_host(f"w{i}", down_mbit=args.worker_mbit)
            out = str(work / f"w{i}")
            proc = host.popen(
                [sys.executable, "-c", WORKER, source, key.public_key_hex, out, f"w{i}"],
                stdout=subprocess.PIPE,
            )
            workers.append(proc)
        for proc in workers:
            if proc.stdout.readline().strip() != b"parked":
                raise RuntimeError("a worker exited before parking its long-poll")
        time.sleep(1.0)  # the long-polls reach their source
        cfg = ShardcastConfig(shard_size_bytes=args.shard_kib * 1024)
        Publisher(work / "store", key, cfg).publish(checkpoint, 1)
        published = time.time()
        held = [float(proc.stdout.readline()) for proc in workers]
    copies = 1 if relay else args.workers
    bound = max(copies * size_bits / (args.origin_mbit * 1e6), size_bits / (args.worker_mbit * 1e6))
    return max(held) - published, bound


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
    args = parser.parse_args()
    print(
        f"{args.size_mib} MiB, {args.workers} workers at {args.worker_mbit:g} Mbit/s down, "
        f"origin {args.origin_mbit:g} Mbit/s up, {2 * args.delay_ms:g} ms RTT to the origin, "
        f"{args.shard_kib} KiB shards"
    )
    for relay in (False, True):
        results = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(one_run(args, relay, Path(tmp)))
        seconds = [s for s, _ in results]
        bound = results[0][1]
        print(
            f"{'relay ' if relay else 'direct'}: last worker after "
            f"{statistics.median(seconds):.2f} s (runs {', '.join(f'{s:.2f}' for s in seconds)}), "
            f"bound {bound:.2f} s, ratio {statistics.median(seconds) / bound:.2f}"
        )


if __name__ == "__main__":
    main()
