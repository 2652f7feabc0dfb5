"""Origin → 2 relays → N clients, ours against the reference ``shardcast`` 0.3.2, on loopback.

Both systems are set up once (origin, two relays or middle nodes that already hold the
version); then each run times N client processes released together, once per system, the
order alternating from run to run, each arm after ``procs.settle`` (dirty pages written back,
freed memory returned to the host) and with the previous arm's outputs deleted. A checkpoint
of several files goes to the reference as one uncompressed tar, its unit of distribution
(unpacking it is not counted).

Reference work-arounds for several clients on one machine: clients start one after another
(its start-up writes and deletes the fixed path ``/tmp/dummy.bin``), and each client gets its
own package copy (it keeps its scratch copy of the distribution file inside the package).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import shardcast_procs as P
from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher


def write_checkpoint(path: Path, size: int, files: int) -> Path:
    """A checkpoint directory of ``files`` random weight files summing to ``size`` bytes."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "benchmark"}')
    if files == 1:
        P.random_file(path / "model.safetensors", size)
        return path
    base = size // files
    for i in range(files):
        part = base if i < files - 1 else size - base * (files - 1)
        P.random_file(path / f"model-{i + 1:05d}-of-{files:05d}.safetensors", part)
    return path


def as_one_file(ckpt: Path, out: Path) -> Path:
    """The checkpoint as what the reference broadcasts: one file (a tar of several)."""
    files = sorted(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    if len(files) == 1:
        return files[0]
    with tarfile.open(out, "w") as tar:
        for p in sorted(ckpt.iterdir()):
            tar.add(p, arcname=p.name)
    return out


_REF_ORIGIN = r"""
import sys, time, logging
sys.path.insert(0, sys.argv[1])
import shardcast
from shardcast.utils import logger
logger.setLevel(logging.WARNING)
origin = shardcast.OriginServer(sys.argv[2], int(sys.argv[3]))
version = origin.broadcast(sys.argv[4])
print("version", version, flush=True)
while True:
    time.sleep(1)
"""
_REF_MIDDLE = r"""
import sys, time, logging
sys.path.insert(0, sys.argv[1])
from shardcast.middle_node import MiddleNode
from shardcast.utils import logger
logger.setLevel(logging.WARNING)
node = MiddleNode([sys.argv[2]], sys.argv[3], int(sys.argv[4]), check_interval=1)
print("port", sys.argv[4], flush=True)
while True:
    time.sleep(1)
"""
_REF_CLIENT = r"""
import sys, time, json, logging, resource
sys.path.insert(0, sys.argv[1])
from shardcast.client_node import ClientNode
from shardcast.utils import logger
logger.setLevel(logging.WARNING)
client = ClientNode(sys.argv[2].split(","), sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
def cpu():
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # its wget downloads
    return time.process_time() + kids.ru_utime + kids.ru_stime
started, cpu0 = time.perf_counter(), cpu()
out = client.download_version("v1", sys.argv[3] + "/file.bin")
print(json.dumps({"seconds": time.perf_counter() - started, "cpu": cpu() - cpu0}), flush=True)
sys.exit(0 if out else 1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_reference(work: Path) -> Path | None:
    target = work / "ref_pkg"
    done = subprocess.run(
        [
            P.PY,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            "shardcast==0.3.2",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"reference shardcast 0.3.2 did not install: {done.stderr.strip()[-300:]}")
        return None
    return target


@dataclass
class Arm:
    """One system set up and holding the version at both relays: it times client runs."""

    name: str
    work: Path
    servers: list[subprocess.Popen]
    client_cmd: Callable[[int, Path], list[str]]  # (index, out_dir) -> argv of one client
    setup_s: float
    runs: list[dict] = field(default_factory=list)

    def clients(self, n: int, tag: str) -> dict:
        """Time ``n`` clients released together; delete what they wrote."""
        outs = [self.work / f"{tag}{i}" for i in range(n)]
        cmds = [self.client_cmd(i, out) for i, out in enumerate(outs)]
        try:
            seconds, cpu = P.run_clients(cmds, [p.pid for p in self.servers[1:]], timeout_s=3600)
        finally:
            P.remove(*outs)
        return {"seconds": seconds, "cpu_s": cpu, "load_avg": os.getloadavg()}

    def close(self) -> None:
        P.stop(self.servers)


def ours(work: Path, ckpt: Path, key: KeyPair) -> Arm:
    store = work / "ours_origin"
    Publisher(store, key).publish(ckpt, 1)
    servers, _, relays = P.origin_and_relays(work, store, 2, key.public_key_hex)
    started = time.perf_counter()
    try:
        P.wait_until(lambda: all(P.relay_has(u, 1) for u in relays), 900, "relays to hold v1")
    except BaseException:
        P.stop(servers)
        raise
    sources = ",".join(relays)

    def cmd(i: int, out: Path) -> list[str]:
        return [P.PY, "-c", P.CLIENT, sources, key.public_key_hex, str(out), "1"]

    return Arm("ours", work, servers, cmd, time.perf_counter() - started)


def reference(work: Path, blob: Path, pkg: Path, clients: int) -> Arm:
    servers: list[subprocess.Popen] = []
    dirs = [work / "ref_origin", work / "ref_mid0", work / "ref_mid1"]
    for d in dirs:  # its downloader first fetches data1.bin from every server to score it
        d.mkdir(parents=True)
        (d / "data1.bin").write_bytes(os.urandom(1 << 20))
    port = _free_port()
    origin_url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    try:
        proc, _ = P.spawn(
            [P.PY, "-c", _REF_ORIGIN, str(pkg), str(dirs[0]), str(port), str(blob)],
            "reference origin",
            900,
        )
        servers.append(proc)
        mids = []
        for d in dirs[1:]:
            mport = _free_port()
            proc, _ = P.spawn(
                [P.PY, "-c", _REF_MIDDLE, str(pkg), origin_url, str(d), str(mport)],
                "reference middle",
            )
            servers.append(proc)
            mids.append(f"http://127.0.0.1:{mport}")
        shards = len(list((dirs[0] / "v1").glob("shard_*.bin")))

        def mid_done(d: Path) -> bool:
            got = list((d / "v1").glob("shard_*.bin")) if (d / "v1").is_dir() else []
            return len(got) == shards

        P.wait_until(lambda: all(mid_done(d) for d in dirs[1:]), 900, "reference middles")
    except BaseException:
        P.stop(servers)
        raise
    copies = []
    for i in range(clients):  # one package copy per client (see module docstring)
        own = work / f"ref_pkg_{i}"
        shutil.copytree(pkg, own, dirs_exist_ok=True)
        copies.append(own)
    sources = ",".join(mids)

    def cmd(i: int, out: Path) -> list[str]:
        return [P.PY, "-c", _REF_CLIENT, str(copies[i]), sources, str(out)]

    return Arm("reference", work, servers, cmd, time.perf_counter() - started)


def compare(
    work: Path, ckpt: Path, key: KeyPair, clients: int, runs: int, settle_s: float, alone: bool
) -> dict:
    """Set both systems up, then ``runs`` alternating timed runs of ``clients`` clients."""
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    # ours: store + 2 relays; reference: the tar, its origin's shards + 2 middles; then the
    # clients of one arm at a time (the reference's shards and its reassembled copy)
    P.check_disk(work, 7 * size + 2 * clients * size, "the topology comparison")
    pkg = install_reference(work)
    if pkg is None:
        return {"error": "pip install shardcast==0.3.2 failed"}
    blob = as_one_file(ckpt, work / "model.tar")
    arms = []
    try:
        arms.append(ours(work, ckpt, key))
        arms.append(reference(work, blob, pkg, clients))
        if blob.parent == work:
            P.remove(blob)  # the reference origin holds its shards now
        result: dict = {"bytes": size, "clients": clients, "runs": []}
        for arm in arms:
            result[f"{arm.name}_relays_ready_s"] = arm.setup_s
            if alone:
                P.settle(settle_s)
                result[f"{arm.name}_one_client"] = arm.clients(1, "alone")
        for run in range(runs):
            order = arms if run % 2 == 0 else arms[::-1]
            row: dict = {"first": order[0].name}
            for arm in order:
                P.settle(settle_s)
                row[arm.name] = arm.clients(clients, f"{arm.name}_{run}_")
            row["ours_faster_by"] = row["reference"]["seconds"] / row["ours"]["seconds"]
            row["ours_aggregate_Mbps"] = clients * size * 8 / row["ours"]["seconds"] / 1e6
            row["reference_aggregate_Mbps"] = clients * size * 8 / row["reference"]["seconds"] / 1e6
            print({"run": run, **row}, flush=True)
            result["runs"].append(row)
        return result
    finally:
        for arm in arms:
            arm.close()
