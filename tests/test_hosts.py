"""The multi-host test bed: shaped links between namespaces, the lossy-link proxy, CPU quotas,
and that nothing it made outlives it. Namespace and cgroup tests need root and skip elsewhere."""

import gc
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from swarmrl.testing.hosts import (
    CGROUP_CPU,
    TestBed,
    cpu_unavailable_reason,
    loss_unavailable_reason,
    unavailable_reason,
)
from swarmrl.testing.linkproxy import Impairment, LinkProxy

NO_BED = unavailable_reason()
# the test beds share one subnet (10.237.0.0/24): under pytest-xdist, one at a time
pytestmark = pytest.mark.xdist_group("netns")
needs_bed = pytest.mark.skipif(NO_BED is not None, reason=NO_BED or "")
needs_cpu = pytest.mark.skipif(
    NO_BED is not None or cpu_unavailable_reason() is not None,
    reason=NO_BED or cpu_unavailable_reason() or "",
)
needs_loss = pytest.mark.skipif(
    NO_BED is not None or loss_unavailable_reason() is not None,
    reason=NO_BED or loss_unavailable_reason() or "",
)
PROBE = [sys.executable, "-m", "swarmrl.testing.netprobe"]


def _serve(host, verb: str, port: int):
    proc = host.popen(PROBE + [verb, host.address, str(port)])
    host.bed.wait_port(host, port, proc)
    return proc


def _mbit_per_s(sender, receiver, port: int, nbytes: int) -> float:
    seconds = float(sender.run(PROBE + ["send", receiver.address, str(port), str(nbytes)]))
    return nbytes * 8 / seconds / 1e6


@needs_bed
def test_a_capped_link_carries_about_its_cap_and_an_uncapped_one_far_more():
    with TestBed() as bed:
        origin = bed.add_host("origin")
        worker = bed.add_host("worker", up_mbit=8)
        _serve(origin, "sink", 5001)
        capped = _mbit_per_s(worker, origin, 5001, 2_000_000)  # ~2 s at the cap
        # 8 Mbit/s on the wire is ~7.6 Mbit/s of TCP payload (Ethernet, IP and TCP headers)
        assert 0.8 * 8 <= capped <= 1.05 * 8, capped
        worker.shape(up_mbit=None)
        uncapped = _mbit_per_s(worker, origin, 5001, 20_000_000)
        assert uncapped > 20 * 8, uncapped
        # the cap on the other direction is the switch's egress towards the host
        worker.shape(down_mbit=8)
        _serve(worker, "sink", 5002)
        towards_worker = _mbit_per_s(origin, worker, 5002, 2_000_000)
        assert 0.8 * 8 <= towards_worker <= 1.05 * 8, towards_worker


def _retransmitted(host) -> int:
    """TCP segments the host's kernel has retransmitted (its namespace's /proc/net/snmp)."""
    lines = [
        line.split()
        for line in host.run(["cat", "/proc/net/snmp"]).splitlines()
        if line.startswith("Tcp:")
    ]
    names, values = lines
    return int(values[names.index("RetransSegs")])


@needs_loss
def test_a_lossy_link_drops_real_packets_and_tcp_sends_them_again():
    with TestBed() as bed:
        receiver = bed.add_host("receiver")
        sender = bed.add_host("sender", up_mbit=50, loss=0.02)
        _serve(receiver, "sink", 5003)
        before = _retransmitted(sender)
        # the sink answers once it has every byte: TCP delivered the stream whole
        sender.run(PROBE + ["send", receiver.address, "5003", "4000000"])
        dropped = sender.dropped()
        assert dropped > 0  # ~2 % of ~2,800 data segments and their acknowledgements
        assert _retransmitted(sender) - before > 0  # the kernel sent the lost ones again
        sender.lose(0)  # the rule is gone: nothing more is dropped
        sender.run(PROBE + ["send", receiver.address, "5003", "1000000"])
        assert sender.dropped() == 0
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        sender.lose(1.5)


class _EchoServer:
    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def _round_trips(address, count: int) -> list[float]:
    times = []
    with socket.create_connection(address, timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"x" * 64)
            got = b""
            while len(got) < 64:
                got += sock.recv(64 - len(got))
            times.append(time.perf_counter() - start)
    return times


def test_the_proxy_adds_its_delay_each_way_with_jitter_around_it():
    echo = _EchoServer()
    direct = statistics.median(_round_trips(echo.address, 10))
    way = Impairment(delay_s=0.05, jitter_s=0.01)
    with LinkProxy(echo.address, up=way, down=way, seed=1) as proxy:
        through = _round_trips(proxy.address, 20)
    assert direct < 0.02, direct
    # 2 x 50 ms, jitter +-10 ms each way; a loaded machine adds a little, never takes away
    assert 0.095 <= statistics.median(through) <= 0.14, through
    assert min(through) >= 0.08, through
    assert max(through) - min(through) > 0.005, "no jitter at all"
    echo.sock.close()


def test_the_proxy_resets_connections_at_its_configured_rate():
    echo = _EchoServer()
    failed = 0
    with LinkProxy(echo.address, reset_probability=0.3, seed=7) as proxy:
        for _ in range(200):
            try:
                _round_trips(proxy.address, 1)
            except (ConnectionError, OSError):
                failed += 1
        assert proxy.resets == failed
    # binomial(200, 0.3): mean 60, sd 6.5
    assert 35 <= failed <= 85, failed
    echo.sock.close()


def test_a_connection_waiting_on_a_slow_answer_survives_garbage_collection():
    # A client that has sent its whole request and waits (as a long-poll does) leaves the
    # proxy's tasks reachable from nothing but each other.
    server = socket.create_server(("127.0.0.1", 0))

    def answer_late():
        conn, _ = server.accept()
        with conn:
            while conn.recv(65536):
                pass
            time.sleep(0.5)
            conn.sendall(b"late answer")

    threading.Thread(target=answer_late, daemon=True).start()
    with LinkProxy(server.getsockname()) as proxy:
        with socket.create_connection(proxy.address, timeout=5) as sock:
            sock.sendall(b"request")
            sock.shutdown(socket.SHUT_WR)
            time.sleep(0.2)
            gc.collect()
            assert sock.recv(64) == b"late answer"
    server.close()


def test_the_proxy_paces_bytes_to_its_rate():
    echo = _EchoServer()
    with LinkProxy(echo.address, up=Impairment(rate_bytes_per_s=200_000)) as proxy:
        with socket.create_connection(proxy.address, timeout=10) as sock:
            start = time.perf_counter()
            sock.sendall(b"y" * 300_000)
            got = 0
            while got < 300_000:
                got += len(sock.recv(65536))
            seconds = time.perf_counter() - start
    assert 1.3 <= seconds <= 2.5, seconds  # 300 kB at 200 kB/s
    echo.sock.close()


def test_modelled_loss_holds_a_chunk_one_retransmission_and_everything_behind_it():
    echo = _EchoServer()
    with LinkProxy(echo.address, up=Impairment(loss=0.01), seed=5) as proxy:
        with socket.create_connection(proxy.address, timeout=30) as sock:
            start = time.perf_counter()
            sock.sendall(b"z" * 2_000_000)  # ~1400 segments: ~14 losses expected
            got = 0
            while got < 2_000_000:
                got += len(sock.recv(65536))
            seconds = time.perf_counter() - start
        stalls = proxy.stalls
    assert stalls >= 1, stalls
    # each stall holds back everything behind it for at least the 200 ms minimum RTO
    assert seconds >= 0.9 * stalls * 0.2, (seconds, stalls)
    with LinkProxy(echo.address, up=Impairment(loss=0.0)) as clean:
        _round_trips(clean.address, 5)
        assert clean.stalls == 0
    echo.sock.close()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_cpu
def test_a_process_held_to_a_tenth_of_a_core_gets_about_a_tenth():
    with TestBed() as bed:
        worker = bed.add_host("worker")
        busy = [sys.executable, "-c", "while True: pass"]
        slow = worker.popen(busy, cpu_fraction=0.1)
        fast = worker.popen(busy)
        time.sleep(0.5)
        slow0, fast0, t0 = _cpu_seconds(slow.pid), _cpu_seconds(fast.pid), time.monotonic()
        time.sleep(3)
        wall = time.monotonic() - t0
        slow_share = (_cpu_seconds(slow.pid) - slow0) / wall
        fast_share = (_cpu_seconds(fast.pid) - fast0) / wall
        throttled = (bed.cgroups()[0] / "cpu.stat").read_text()
    assert slow_share <= 0.13, slow_share
    # the machine is shared: the slow one may get less than its quota, but not nothing
    assert slow_share >= 0.04, slow_share
    assert fast_share > 1.5 * slow_share, (fast_share, slow_share)
    assert "nr_throttled 0\n" not in throttled, throttled


def _leftovers(prefix: str, pids: list[int]) -> list[str]:
    found = [
        n
        for n in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.split()
        if n.startswith(prefix)
    ]
    found += [p.name for p in CGROUP_CPU.glob(f"{prefix}-*")]
    found += [str(pid) for pid in pids if os.path.exists(f"/proc/{pid}")]
    return found


def _populate(bed: TestBed) -> list[int]:
    a = bed.add_host("a", up_mbit=50, down_mbit=50)
    b = bed.add_host("b")
    server = _serve(a, "sink", 5003)
    slow = b.popen([sys.executable, "-c", "while True: pass"], cpu_fraction=0.2)
    proxy = a.proxy(6003, (a.address, 5003), delay_ms=5)
    assert len(_leftovers(bed.prefix, [server.pid])) == 5  # switch, a, b, cgroup, server
    return [server.pid, slow.pid, proxy.pid]


@needs_cpu
def test_nothing_the_bed_made_remains_after_it_closes_even_after_an_exception():
    with TestBed() as bed:
        pids = _populate(bed)
    assert _leftovers(bed.prefix, pids) == []

    with pytest.raises(RuntimeError, match="a test failed here"):
        with TestBed() as bed:
            pids = _populate(bed)
            raise RuntimeError("a test failed here")
    assert _leftovers(bed.prefix, pids) == []

    bed = TestBed()  # never closed: its finaliser undoes it when it is dropped
    pids, prefix = _populate(bed), bed.prefix
    del bed
    gc.collect()
    assert _leftovers(prefix, pids) == []
    # no interface of a bed ever appears in the machine's own network stack
    assert prefix not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_without_privileges_the_bed_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    from swarmrl.errors import ServiceUnavailable

    with pytest.raises(ServiceUnavailable) as refused:
        TestBed()
    assert "needs root" in str(refused.value) and "\n" not in str(refused.value)


@needs_bed
@pytest.mark.slow
def test_weights_cross_a_slow_lossy_link_through_a_relay_and_arrive_verified(tmp_path):
    from safetensors.numpy import load_file

    from swarmrl.config.shardcast import ShardcastConfig
    from swarmrl.identity import KeyPair
    from swarmrl.shardcast import Publisher
    from swarmrl.testing.shardcast import random_weights, write_checkpoint

    key = KeyPair.from_seed(b"\x25" * 32)
    weights = random_weights(1_000_000, seed=11)  # 4 MB: 2 s through the 16 Mbit/s uplink
    cfg = ShardcastConfig(shard_size_bytes=256 * 1024)
    Publisher(tmp_path / "store", key, cfg).publish(write_checkpoint(tmp_path / "ck", weights), 1)
    swarmrl = [sys.executable, "-m", "swarmrl.cli"]
    shard = ["--set", "shardcast.shard_size_bytes=262144"]
    with TestBed() as bed:
        origin = bed.add_host("origin", up_mbit=16)
        relay = bed.add_host("relay")
        worker = bed.add_host("worker")
        served = origin.popen(
            swarmrl
            + ["shardcast", "serve-origin", "--store", str(tmp_path / "store")]
            + ["--host", origin.address, "--port", "8470"]
            + shard
        )
        bed.wait_port(origin, 8470, served)
        # 25 ms each way on the origin's link, and one connection in ten reset on accept
        origin.proxy(
            8480, (origin.address, 8470), delay_ms=25, jitter_ms=5, reset_probability=0.1, seed=3
        )
        started = time.monotonic()
        following = relay.popen(
            swarmrl
            + ["relay", "--upstream", f"http://{origin.address}:8480"]
            + ["--publisher-key", key.public_key_hex, "--store", str(tmp_path / "relay")]
            + ["--host", relay.address, "--port", "8471"]
            + shard
        )
        bed.wait_port(relay, 8471, following)
        fetch = swarmrl + ["shardcast", "fetch", "--source", f"http://{relay.address}:8471"]
        fetch += ["--version", "1", "--out", str(tmp_path / "worker")]
        fetch += ["--publisher-key", key.public_key_hex] + shard
        deadline = time.monotonic() + 90
        while True:
            try:
                path = worker.run(fetch, timeout=90).strip().splitlines()[-1]
                break
            except RuntimeError:  # the relay has not learnt of v1 yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        elapsed = time.monotonic() - started
    got = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(got) == sorted(weights)
    for name, tensor in weights.items():
        assert (got[name] == tensor).all(), name
    # 4 MB cannot have crossed a 16 Mbit/s link in less than ~2 s: the cap was on the path
    assert elapsed >= 0.9 * 4e6 * 8 / 16e6, elapsed
