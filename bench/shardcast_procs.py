"""Process plumbing of the shardcast benchmark: start and stop servers, time clients, settle
memory, check the disk, and the plain loopback stream that ratio 1 compares against.

Knows nothing about what either system does with the bytes it moves.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PY = sys.executable
KEY_SEED = b"\x42" * 32
SETTLE_S = 5.0  # > the ~2 s period at which freed guest memory is reported to the host
GIB = 1 << 30


def spawn(cmd: list[str], what: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
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


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def relay_has(url: str, version: int) -> bool:
    try:
        listing = httpx.get(f"{url}/versions", timeout=5).json()
    except httpx.HTTPError:
        return False
    return any(v["version"] == version and v["complete"] for v in listing["versions"])


def random_file(path: Path, size: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as out:
        left = size
        while left:
            n = min(left, len(block))
            out.write(block[:n] if n < len(block) else block)
            block = block[1:] + block[:1] if left > n else block  # shard contents differ
            left -= n


def settle(seconds: float) -> None:
    """Write back dirty pages, then wait for freed memory to be returned to the host.

    These VMs hand freed pages back (free-page reporting, every ~2 s); memory written right
    after a large delete then costs a host fault per page. Pausing before each arm puts both
    arms in that state, whatever ran before.
    """
    os.sync()
    time.sleep(seconds)


def check_disk(where: Path, need_bytes: int, what: str) -> None:
    """Refuse to start ``what`` unless ``where`` has ``need_bytes`` free and 2 GiB to spare."""
    free = shutil.disk_usage(where).free
    if free < need_bytes + 2 * GIB:
        raise RuntimeError(
            f"{what} needs {need_bytes / GIB:.1f} GiB on {where}, {free / GIB:.1f} GiB free"
        )


def remove(*paths: Path) -> None:
    """Delete benchmark outputs now: every copy lands on the disk."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


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
    """(seconds, CPU seconds of both ends) to stream ``path`` over a raw loopback socket.

    The receiver writes the way our client does (whole MiB blocks with ``O_DIRECT`` from an
    aligned buffer, the last partial block through the page cache), so the ratio compares
    the transports, not two ways of writing.
    """
    proc, port = spawn([PY, "-c", _RAW_SERVER, str(path)], "raw server")
    try:
        size = os.path.getsize(path)
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        direct = os.open(out, os.O_WRONLY | os.O_DIRECT)
        server_cpu, client_cpu = cpu_of(proc.pid), time.process_time()
        started = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        sock = socket.create_connection(("127.0.0.1", int(port)))
        sock.sendall(b"GET")
        header = b""
        while len(header) < 32:
            header += sock.recv(32 - len(header))
        assert int(header) == size
        buf = memoryview(mmap.mmap(-1, 1 << 20))  # page-aligned
        got = fill = 0
        while got < size:
            n = sock.recv_into(buf[fill:], min(len(buf) - fill, size - got))
            if not n:
                raise RuntimeError("raw transfer ended early")
            got, fill = got + n, fill + n
            if fill == len(buf):
                os.pwrite(direct, buf, got - fill)
                fill = 0
        whole = fill - fill % 4096
        if whole:
            os.pwrite(direct, buf[:whole], got - fill)
        if fill > whole:
            os.pwrite(fd, buf[whole:fill], got - fill + whole)
        os.fsync(fd)  # our client syncs its files before it marks a version ready
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - client_cpu + cpu_of(proc.pid) - server_cpu
        os.close(fd)
        os.close(direct)
        sock.close()
        return elapsed, cpu
    finally:
        stop([proc])


# --- our topology --------------------------------------------------------------------------
def origin_and_relays(
    work: Path, store: Path, n_relays: int, pubkey: str
) -> tuple[list[subprocess.Popen], str, list[str]]:
    procs = []
    origin, origin_url = spawn(
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
        proc, url = spawn(
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


CLIENT = r"""
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


def run_clients(
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
        server_cpu = sum(cpu_of(pid) for pid in servers)
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
        return elapsed, cpu + sum(cpu_of(pid) for pid in servers) - server_cpu
    finally:
        stop(procs)
