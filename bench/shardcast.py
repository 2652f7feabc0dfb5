"""Benchmark of shardcast on one machine, loopback only. One run prints every ratio.

1. one client fetching SIZE from one relay  vs  a plain loopback stream of the same bytes
   (raw socket, ``sendfile`` → ``recv_into`` + ``pwrite``, no HTTP, no hashing);
2. origin → 2 relays → N clients (each a process)  vs  one client alone, same topology;
3. the same topology with the reference ``shardcast`` 0.3.2 package (installed into a
   private directory with pip) on the same file;
4. delta size / full size: one AdamW (lr 3e-4) step of the tiny demo model on a real
   next-token loss, and a simulated small-learning-rate AdamW step of a ~100M-parameter bf16
   model.

Ratio 1 alternates which arm runs first, and before each arm writes back dirty pages and
pauses ``--settle-s`` seconds (default 5) so the memory the previous arm freed is returned
to the host: both arms start from the same memory state (see ``_settle``).

Usage: ``python bench/shardcast.py [--size-mib 1024] [--topo-size-mib 256] [--clients 8]``.
Everything it starts it stops; scratch files go under --work (deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from swarmrl.identity import KeyPair
from swarmrl.shardcast import Publisher, WeightClient

PY = sys.executable
KEY_SEED = b"\x42" * 32
SETTLE_S = 5.0  # > the ~2 s period at which freed guest memory is reported to the host


def _spawn(cmd: list[str], what: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start a server process that prints 'serving on URL' (or 'port N') first; return it and the URL."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line or not line[0].strip():
        proc.kill()
        raise RuntimeError(f"{what} did not start within {timeout_s}s")
    return proc, line[0].split()[-1].strip()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _relay_has(url: str, version: int) -> bool:
    try:
        listing = httpx.get(f"{url}/versions", timeout=5).json()
    except httpx.HTTPError:
        return False
    return any(v["version"] == version and v["complete"] for v in listing["versions"])


def _random_file(path: Path, size: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as out:
        left = size
        while left:
            n = min(left, len(block))
            out.write(block[:n] if n < len(block) else block)
            block = block[1:] + block[:1] if left > n else block  # shard contents differ
            left -= n


def _settle(seconds: float) -> None:
    """Write back dirty pages, then wait for freed memory to be returned to the host.

    These VMs hand freed pages back (free-page reporting, every ~2 s); memory written right
    after a large delete then costs a host fault per page. Pausing before each arm puts both
    arms in that state, whatever ran before.
    """
    os.sync()
    time.sleep(seconds)


# --- plain loopback baseline ---------------------------------------------------------------
_RAW_SERVER = r"""
import socket, sys, os
path = sys.argv[1]
size = os.path.getsize(path)
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen()
print("port", ls.getsockname()[1], flush=True)
while True:
    conn, _ = ls.accept()
    conn.recv(4096)
    conn.sendall(str(size).encode().ljust(32))
    with open(path, "rb") as f:
        conn.sendfile(f)
    conn.close()
"""


def plain_transfer(path: Path, out: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of both ends) to stream ``path`` over a raw loopback socket."""
    proc, port = _spawn([PY, "-c", _RAW_SERVER, str(path)], "raw server")
    try:
        size = os.path.getsize(path)
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        server_cpu, client_cpu = _cpu_of(proc.pid), time.process_time()
        started = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        sock = socket.create_connection(("127.0.0.1", int(port)))
        sock.sendall(b"GET")
        header = b""
        while len(header) < 32:
            header += sock.recv(32 - len(header))
        assert int(header) == size
        buf = memoryview(bytearray(1 << 20))
        got = 0
        while got < size:
            n = sock.recv_into(buf)
            if not n:
                raise RuntimeError("raw transfer ended early")
            os.pwrite(fd, buf[:n], got)
            got += n
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - client_cpu + _cpu_of(proc.pid) - server_cpu
        os.close(fd)
        sock.close()
        return elapsed, cpu
    finally:
        _stop([proc])


# --- our topology --------------------------------------------------------------------------
def _origin_and_relays(
    work: Path, store: Path, n_relays: int, pubkey: str
) -> tuple[list[subprocess.Popen], str, list[str]]:
    procs = []
    origin, origin_url = _spawn(
        [
            PY,
            "-m",
            "swarmrl.cli",
            "shardcast",
            "serve-origin",
            "--store",
            str(store),
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        "origin",
    )
    procs.append(origin)
    relay_urls = []
    for i in range(n_relays):
        proc, url = _spawn(
            [
                PY,
                "-m",
                "swarmrl.cli",
                "relay",
                "--upstream",
                origin_url,
                "--publisher-key",
                pubkey,
                "--store",
                str(work / f"relay{i}"),
                "--port",
                "0",
                "--log-level",
                "WARNING",
            ],
            f"relay {i}",
        )
        procs.append(proc)
        relay_urls.append(url)
    return procs, origin_url, relay_urls


_CLIENT = r"""
import json, sys, time
from swarmrl.shardcast import WeightClient
sources, key, out, version = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4])
client = WeightClient(sources, key, out)
print("ready", flush=True)
sys.stdin.readline()
started, cpu = time.perf_counter(), time.process_time()
client.fetch(version)
print(json.dumps({"seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}), flush=True)
"""


def _run_clients(
    cmds: list[list[str]], servers: list[int], timeout_s: float = 600
) -> tuple[float, float]:
    """Start clients, release them together; (seconds until the last is done, CPU seconds of
    the clients' fetches plus the serving processes ``servers`` meanwhile)."""
    procs: list[subprocess.Popen] = []
    try:
        # started one after another: the reference client's start-up writes and deletes the
        # fixed path /tmp/dummy.bin, so concurrent start-ups race; the fetches start together
        for cmd in cmds:
            procs.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
            if procs[-1].stdout.readline().strip() != "ready":
                raise RuntimeError(f"client did not start: {cmd[:3]}")
        server_cpu = sum(_cpu_of(pid) for pid in servers)
        started = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        cpu = 0.0
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"client exited with {proc.returncode}")
            cpu += json.loads(out.strip().splitlines()[-1])["cpu"]
        elapsed = time.perf_counter() - started
        return elapsed, cpu + sum(_cpu_of(pid) for pid in servers) - server_cpu
    finally:
        _stop(procs)


def ours_topology(work: Path, ckpt: Path, n_clients: int, key: KeyPair) -> dict:
    store = work / "ours_origin"
    Publisher(store, key).publish(ckpt, 1)
    procs, origin_url, relays = _origin_and_relays(work, store, 2, key.public_key_hex)
    try:
        started = time.perf_counter()
        _wait_until(lambda: all(_relay_has(u, 1) for u in relays), 300, "relays to replicate v1")
        replicate_s = time.perf_counter() - started
        sources = ",".join(relays)

        def clients(n: int, tag: str) -> list[list[str]]:
            return [
                [PY, "-c", _CLIENT, sources, key.public_key_hex, str(work / f"{tag}{i}"), "1"]
                for i in range(n)
            ]

        relay_pids = [p.pid for p in procs[1:]]
        alone, alone_cpu = _run_clients(clients(1, "alone"), relay_pids)
        many, many_cpu = _run_clients(clients(n_clients, "many"), relay_pids)
        return {
            "relays_replicate_s": replicate_s,
            "one_client_s": alone,
            "n_clients_s": many,
            "one_client_cpu_s": alone_cpu,
            "n_clients_cpu_s": many_cpu,
        }
    finally:
        _stop(procs)


# --- reference shardcast 0.3.2 --------------------------------------------------------------
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
            PY,
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


def reference_topology(work: Path, blob: Path, n_clients: int, pkg: Path) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        dirs = [work / "ref_origin", work / "ref_mid0", work / "ref_mid1"]
        for d in dirs:  # its downloader first fetches data1.bin from every server to score it
            d.mkdir(parents=True)
            (d / "data1.bin").write_bytes(os.urandom(1 << 20))
        port = _free_port()
        origin_url = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        proc, _ = _spawn(
            [PY, "-c", _REF_ORIGIN, str(pkg), str(dirs[0]), str(port), str(blob)],
            "reference origin",
            300,
        )
        procs.append(proc)
        mids = []
        for d in dirs[1:]:
            mport = _free_port()
            proc, _ = _spawn(
                [PY, "-c", _REF_MIDDLE, str(pkg), origin_url, str(d), str(mport)],
                "reference middle",
            )
            procs.append(proc)
            mids.append(f"http://127.0.0.1:{mport}")
        shards = len(list((dirs[0] / "v1").glob("shard_*.bin")))

        def mid_done(d: Path) -> bool:
            return (
                len(list((d / "v1").glob("shard_*.bin"))) == shards
                if (d / "v1").is_dir()
                else False
            )

        _wait_until(
            lambda: all(mid_done(d) for d in dirs[1:]), 300, "reference middles to replicate"
        )
        replicate_s = time.perf_counter() - started
        servers = ",".join(mids)

        def clients(n: int, tag: str) -> list[list[str]]:
            # one package copy per client: the reference client keeps its scratch copy of the
            # distribution file inside its package directory, so clients sharing one race
            cmds = []
            for i in range(n):
                own = work / f"ref_pkg_{tag}{i}"
                shutil.copytree(pkg, own, dirs_exist_ok=True)
                cmds.append([PY, "-c", _REF_CLIENT, str(own), servers, str(work / f"{tag}{i}")])
            return cmds

        mid_pids = [p.pid for p in procs[1:]]
        alone, alone_cpu = _run_clients(clients(1, "refalone"), mid_pids)
        many, many_cpu = _run_clients(clients(n_clients, "refmany"), mid_pids)
        return {
            "relays_replicate_s_incl_broadcast": replicate_s,
            "one_client_s": alone,
            "n_clients_s": many,
            "one_client_cpu_s": alone_cpu,
            "n_clients_cpu_s": many_cpu,
        }
    finally:
        _stop(procs)


# --- deltas -----------------------------------------------------------------------------------
def delta_tiny_model(work: Path, key: KeyPair) -> dict:
    import torch
    from safetensors.torch import save_file

    from swarmrl.config.model import TinyModelConfig
    from swarmrl.model.factory import create_tiny_model
    from swarmrl.model.io import save_policy
    from swarmrl.model.tokenizer import build_char_tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+=\n ")
    model = create_tiny_model(TinyModelConfig(), tokenizer)
    save_policy(model, tokenizer, work / "tiny0")
    text = [
        f"{a}+{b}={str(a + b)[::-1]}" for a, b in [(123, 456), (305, 271), (111, 222), (400, 499)]
    ]
    ids = torch.tensor([tokenizer(t)["input_ids"] for t in text])  # [4, seq]
    bf16_before = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=3e-4).step()
    save_policy(model, tokenizer, work / "tiny1")
    bf16_after = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    out = {"params": params, "loss_before_step": float(loss.detach())}
    for dtype, dirs in (
        ("float32", ("tiny0", "tiny1")),
        ("bfloat16", ("tiny0_bf16", "tiny1_bf16")),
    ):
        if dtype == "bfloat16":  # the same step, published as bf16 weights
            for name, state in zip(dirs, (bf16_before, bf16_after), strict=True):
                (work / name).mkdir()
                shutil.copy(work / "tiny0" / "config.json", work / name / "config.json")
                save_file(state, str(work / name / "model.safetensors"))
        pub = Publisher(work / f"tiny_store_{dtype}", key)
        pub.publish(work / dirs[0], 1)
        m = pub.publish(work / dirs[1], 2)
        delta = sum(d.size for d in m.deltas)
        out[dtype] = {
            "full_bytes": m.total_bytes,
            "delta_bytes": delta,
            "fraction": delta / m.total_bytes,
        }
    return out


def delta_100m_bf16(work: Path, key: KeyPair, lrs: list[float]) -> list[dict]:
    """Simulated AdamW steps on a 100M-parameter model whose published weights are bf16."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096, 4096)] * 5 + [(32000, 512)] * 1 + [(1024, 1024)] * 4  # ~104M params
    results = []
    for lr in lrs:
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

        def step(params: list = params, opt: torch.optim.Optimizer = opt) -> None:
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

        for _ in range(3):  # warm optimizer state: not the first (sign-like) step
            step()

        def dump(name: str, params: list = params) -> Path:
            d = work / name
            d.mkdir(exist_ok=True)
            save_file(
                {f"w{i}": p.detach().to(torch.bfloat16).contiguous() for i, p in enumerate(params)},
                str(d / "model.safetensors"),
            )
            (d / "config.json").write_text('{"model_type": "simulated"}')
            return d

        before = dump(f"big_lr{lr}_a")
        old_bf16 = [p.detach().to(torch.bfloat16) for p in params]
        step()
        after = dump(f"big_lr{lr}_b")
        changed = sum(
            int((p.detach().to(torch.bfloat16) != o).sum())
            for p, o in zip(params, old_bf16, strict=True)
        )
        del old_bf16
        pub = Publisher(work / f"big_store_{lr}", key)
        pub.publish(before, 1)
        started = time.perf_counter()
        m = pub.publish(after, 2)
        publish_s = time.perf_counter() - started
        delta = sum(d.size for d in m.deltas)
        n = sum(p.numel() for p in params)
        results.append(
            {
                "params": n,
                "lr": lr,
                "full_bytes": m.total_bytes,
                "delta_bytes": delta,
                "fraction": delta / m.total_bytes,
                "publish_with_delta_s": publish_s,
                "bf16_values_changed": changed / n,
            }
        )
        shutil.rmtree(work / f"big_store_{lr}")
        shutil.rmtree(before)
        shutil.rmtree(after)
        del params, opt
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes of ratio 1")
    parser.add_argument("--topo-size-mib", type=int, default=256, help="bytes of ratios 2 and 3")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of ratio 1")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help="pause after writing back dirty pages, before each arm of ratio 1",
    )
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: single,topo,reference,tiny,big"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work or tempfile.mkdtemp(prefix="shardcast-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    key = KeyPair.from_seed(KEY_SEED)
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg()}
    try:
        if "single" not in skip:
            size = args.size_mib << 20
            ck = work / "single_ck"
            ck.mkdir()
            _random_file(ck / "model.safetensors", size)
            store = work / "single_origin"
            Publisher(store, key).publish(ck, 1)
            procs, _, relays = _origin_and_relays(work, store, 1, key.public_key_hex)
            plain, ours, plain_cpu, ours_cpu = [], [], [], []

            def plain_arm(counted: bool) -> None:
                seconds, cpu = plain_transfer(ck / "model.safetensors", work / "plain.out")
                if counted:
                    plain.append(seconds)
                    plain_cpu.append(cpu)
                (work / "plain.out").unlink()

            def ours_arm(counted: bool) -> None:
                client = WeightClient(relays, key.public_key_hex, work / "single_out")
                relay_cpu, client_cpu = _cpu_of(procs[1].pid), time.process_time()
                started = time.perf_counter()
                client.fetch(1)
                if counted:
                    ours.append(time.perf_counter() - started)
                    ours_cpu.append(
                        time.process_time() - client_cpu + _cpu_of(procs[1].pid) - relay_cpu
                    )
                shutil.rmtree(work / "single_out")

            try:
                _wait_until(lambda: _relay_has(relays[0], 1), 300, "relay to replicate")
                for run in range(args.repeats + 1):  # run 0 warms both paths up, not counted
                    # alternate which arm goes first, and let the memory the last arm freed
                    # settle (returned to the host) before each: both see the same state
                    arms = (plain_arm, ours_arm) if run % 2 == 0 else (ours_arm, plain_arm)
                    for arm in arms:
                        _settle(args.settle_s)
                        arm(run > 0)
            finally:
                _stop(procs)
            plain_s, ours_s = statistics.median(plain), statistics.median(ours)
            results["single"] = {
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
            print(json.dumps({"single": results["single"]}), flush=True)
            for p in ("single_ck", "single_origin", "single_out", "relay0"):
                shutil.rmtree(work / p, ignore_errors=True)
        if not {"topo", "reference"} <= skip:
            size = args.topo_size_mib << 20
            ck = work / "topo_ck"
            ck.mkdir()
            _random_file(ck / "model.safetensors", size)
            if "topo" not in skip:
                r = ours_topology(work, ck, args.clients, key)
                r.update(
                    bytes=size,
                    clients=args.clients,
                    aggregate_speedup=args.clients * r["one_client_s"] / r["n_clients_s"],
                )
                results["topology_ours"] = r
                print(json.dumps({"topology_ours": r}), flush=True)
            if "reference" not in skip:
                pkg = install_reference(work)
                if pkg is None:
                    results["topology_reference"] = "pip install shardcast==0.3.2 failed"
                else:
                    r = reference_topology(work, ck / "model.safetensors", args.clients, pkg)
                    r.update(
                        bytes=size,
                        clients=args.clients,
                        aggregate_speedup=args.clients * r["one_client_s"] / r["n_clients_s"],
                    )
                    results["topology_reference"] = r
                    print(json.dumps({"topology_reference": r}), flush=True)
                    if "topology_ours" in results:
                        results["ours_vs_reference_n_clients_speedup"] = (
                            r["n_clients_s"] / results["topology_ours"]["n_clients_s"]
                        )
        if "tiny" not in skip:
            results["delta_tiny"] = delta_tiny_model(work, key)
            print(json.dumps({"delta_tiny": results["delta_tiny"]}), flush=True)
        if "big" not in skip:
            results["delta_100m_bf16"] = delta_100m_bf16(work, key, [1e-6, 3e-6, 1e-5])
            print(json.dumps({"delta_100m_bf16": results["delta_100m_bf16"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULTS " + json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
