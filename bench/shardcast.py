"""Benchmark of shardcast on one machine, loopback only. One run prints every ratio.

1. one client fetching SIZE from one relay  vs  a plain loopback stream of the same bytes
   (raw socket, ``sendfile`` → ``recv_into`` + direct writes, no HTTP, no hashing);
2. origin → 2 relays → N clients (each a process), ours  vs  the reference ``shardcast``
   0.3.2 package (installed into a private directory with pip) on the same checkpoint,
   ``--topo-runs`` alternating runs (``shardcast_topology``); ``--topo-files`` splits the
   checkpoint into several files (the multi-file model run);
3. delta size / full size (``shardcast_delta``).

Each arm starts after dirty pages are written back and a pause of ``--settle-s`` seconds
(default 5), so the memory the previous arm freed is returned to the host: both arms start
from the same memory state (see ``shardcast_procs.settle``); arms alternate which goes first,
and every arm's outputs are deleted before the next starts.

Usage: ``python bench/shardcast.py [--size-mib 1024] [--topo-size-mib 256] [--clients 8]``;
the 2 GiB multi-file run: ``--skip single,tiny,big --topo-size-mib 2048 --topo-files 5``.
Everything it starts it stops; scratch files go under --work (deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import shardcast_delta
import shardcast_procs as P
import shardcast_topology
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, WeightClient


def single_client(work: Path, key: KeyPair, args: argparse.Namespace) -> dict:
    """Ratio 1: one client from one relay against a plain loopback stream, alternating."""
    size = args.size_mib << 20
    P.check_disk(work, 5 * size, "the single-client comparison")
    ck = work / "single_ck"
    ck.mkdir()
    P.random_file(ck / "model.safetensors", size)
    store = work / "single_origin"
    Publisher(store, key).publish(ck, 1)
    procs, _, relays = P.origin_and_relays(work, store, 1, key.public_key_hex)
    plain, ours, plain_cpu, ours_cpu = [], [], [], []

    def plain_arm(counted: bool) -> None:
        seconds, cpu = P.plain_transfer(ck / "model.safetensors", work / "plain.out")
        if counted:
            plain.append(seconds)
            plain_cpu.append(cpu)
        P.remove(work / "plain.out")

    def ours_arm(counted: bool) -> None:
        client = WeightClient(relays, key.public_key_hex, work / "single_out")
        relay_cpu, client_cpu = P.cpu_of(procs[1].pid), time.process_time()
        started = time.perf_counter()
        client.fetch(1)
        if counted:
            ours.append(time.perf_counter() - started)
            ours_cpu.append(time.process_time() - client_cpu + P.cpu_of(procs[1].pid) - relay_cpu)
        P.remove(work / "single_out")

    try:
        P.wait_until(lambda: P.relay_has(relays[0], 1), 300, "relay to replicate")
        for run in range(args.repeats + 1):  # run 0 warms both paths up, not counted
            arms = (plain_arm, ours_arm) if run % 2 == 0 else (ours_arm, plain_arm)
            for arm in arms:
                P.settle(args.settle_s)
                arm(run > 0)
    finally:
        P.stop(procs)
        P.remove(ck, store, work / "single_out", work / "relay0")
    plain_s, ours_s = statistics.median(plain), statistics.median(ours)
    return {
        "bytes": size,
        "plain_s_runs": plain,
        "ours_s_runs": ours,
        "plain_MBps_median": size / plain_s / 1e6,
        "ours_MBps_median": size / ours_s / 1e6,
        "ratio_ours_over_plain_median": plain_s / ours_s,
        "ratio_best_over_best": min(plain) / min(ours),
        "plain_cpu_s_runs": plain_cpu,
        "ours_cpu_s_runs": ours_cpu,
        "cpu_ratio_plain_over_ours_median": statistics.median(plain_cpu)
        / statistics.median(ours_cpu),
        "load_avg_after": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes of ratio 1")
    parser.add_argument("--topo-size-mib", type=int, default=256, help="bytes of ratio 2")
    parser.add_argument("--topo-files", type=int, default=1, help="files of ratio 2's checkpoint")
    parser.add_argument("--topo-runs", type=int, default=3, help="alternating runs of ratio 2")
    parser.add_argument(
        "--topo-alone", action="store_true", help="also time one client alone, each system"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of ratio 1")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=P.SETTLE_S,
        help="pause after writing back dirty pages, before each timed arm",
    )
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: single,topo,tiny,big"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work or tempfile.mkdtemp(prefix="shardcast-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    key = KeyPair.from_seed(P.KEY_SEED)
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg()}
    try:
        if "single" not in skip:
            results["single"] = single_client(work, key, args)
            print(json.dumps({"single": results["single"]}), flush=True)
        if "topo" not in skip:
            size = args.topo_size_mib << 20
            P.check_disk(work, size, "the checkpoint")
            ck = shardcast_topology.write_checkpoint(work / "topo_ck", size, args.topo_files)
            results["topology"] = shardcast_topology.compare(
                work, ck, key, args.clients, args.topo_runs, args.settle_s, args.topo_alone
            )
            P.remove(ck)
            print(json.dumps({"topology": results["topology"]}), flush=True)
        if "tiny" not in skip:
            results["delta_tiny"] = shardcast_delta.delta_tiny_model(work, key)
            print(json.dumps({"delta_tiny": results["delta_tiny"]}), flush=True)
        if "big" not in skip:
            results["delta_100m_bf16"] = shardcast_delta.delta_100m_bf16(
                work, key, [1e-6, 3e-6, 1e-5]
            )
            print(json.dumps({"delta_100m_bf16": results["delta_100m_bf16"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULTS " + json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
