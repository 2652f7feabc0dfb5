"""Several hosts on one machine: network namespaces, shaped links and CPU-starved processes.

``with TestBed() as bed:`` gives a private switch (a bridge inside a namespace of its own) and
``bed.add_host(name, up_mbit=..., down_mbit=...)`` a host on it: a network namespace with one
interface (``eth0``) and its own address in ``10.237.0.0/24``, wired to the switch by a veth pair
whose two directions are each capped by a ``tbf`` qdisc (``up``: the host's egress, ``down``: the
switch's egress towards it). ``host.popen(argv, cpu_fraction=0.1)`` starts a process inside the
host, held to a tenth of a core by a cgroup v1 ``cpu`` quota. ``host.lose(0.01)`` (or
``add_host(..., loss=0.01)``) drops that share of the packets crossing the host's link, each way,
in the kernel: nftables rules (``numgen random``) on its port of the switch and at its input,
so TCP really retransmits and backs off (needs ``nft``, Debian's nftables). Latency and jitter are not here
(the kernel has no ``netem``): put a ``swarmrl.testing.linkproxy`` in front of a port,
``host.proxy(...)``.

Every interface is created directly inside the namespaces, so the machine's own network stack
never sees an address or a link of the test bed, and the test range routes nowhere else. At exit
(also after an exception, and from a finaliser if the bed is dropped unclosed) it kills the
processes it started (by process group), deletes its cgroups and namespaces (which takes the
links with them). Where it cannot run (not root, no ``ip``/``tc``, no namespaces) it raises
``ServiceUnavailable`` with one line saying why; ``unavailable_reason()`` returns that line.

Knows nothing about swarmrl's roles or pytest.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.errors import ServiceUnavailable

SUBNET = "10.237.0"  # a /24 that exists only inside the test bed's namespaces
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ServiceUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why a test bed cannot be made here, in one line; None where it can."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network namespaces, tc, cgroups)"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"the multi-host test bed needs `{tool}` (Debian: iproute2)"
    probe = f"swprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def loss_unavailable_reason() -> str | None:
    """Why :meth:`Host.lose` cannot drop packets here, in one line; None where it can."""
    if shutil.which("nft") is None:
        return "real packet loss on a test bed's link needs `nft` (Debian: nftables)"
    return None


LOSS_TABLE = "swarmrl_loss"
LOSS_SCALE = 1_000_000  # the rule draws a number below this per packet


def cpu_unavailable_reason() -> str | None:
    """Why a process cannot be held to a fraction of a core here; None where it can."""
    if os.geteuid() != 0:
        return "holding a process to a fraction of a core needs root (cgroup v1 cpu)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU} (cpu.cfs_quota_us missing)"
    return None


@dataclass
class _Made:
    """Everything a bed made, in the order to undo it; shared with the finaliser."""

    namespaces: list[str] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _undo(made: _Made) -> None:
    for proc in made.processes:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    made.processes.clear()
    for namespace in made.namespaces:
        # A process a test started some other way inside the namespace would keep it alive.
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    made.namespaces.clear()
    for cgroup in made.cgroups:
        for _ in range(50):  # a killed task leaves its cgroup a moment after it is reaped
            try:
                cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    made.cgroups.clear()


class Host:
    """One host of a bed: a namespace, an address, a shaped link to the switch."""

    def __init__(self, bed: TestBed, name: str, index: int) -> None:
        self.bed = bed
        self.name = name
        self.namespace = f"{bed.prefix}-{name}"
        self.address = f"{SUBNET}.{index}"
        self.switch_port = f"p{index}"  # its end of the veth pair, inside the switch namespace

    def shape(self, up_mbit: float | None = None, down_mbit: float | None = None) -> None:
        """Cap the link's two directions (Mbit/s); None lifts a cap."""
        for namespace, device, mbit in (
            (self.namespace, "eth0", up_mbit),
            (self.bed.switch, self.switch_port, down_mbit),
        ):
            subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                capture_output=True,
            )
            if mbit is not None:
                rate_bit = int(mbit * 1e6)
                # A burst of ~4 ms of traffic (and at least 2 full frames): the cap holds at
                # millisecond scale without starving a timer-driven qdisc.
                burst = max(3200, rate_bit // 8 // 250)
                _run(
                    *("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device),
                    *("root", "tbf", "rate", f"{rate_bit}bit", "burst", str(burst)),
                    *("latency", "100ms"),
                )

    def lose(self, fraction: float) -> None:
        """Drop ``fraction`` of the packets crossing this host's link, each way (module
        docstring): what it sends, in the switch as they cross it (a ``bridge`` rule on its
        port), and what it receives, at its own input (an ``inet`` rule). Neither end is told,
        so TCP finds the loss and sends again, as on a real lossy link. 0 removes both."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"a link loses a share of its packets in [0, 1), not {fraction}")
        for namespace, family, table, _, _ in self._loss_rules():
            subprocess.run(
                ["ip", "netns", "exec", namespace, "nft", "delete", "table", family, table],
                capture_output=True,
            )
        if not fraction:
            return
        reason = loss_unavailable_reason()
        if reason is not None:
            raise ServiceUnavailable(reason)
        self.bed.one_segment_per_packet()
        below = max(1, round(fraction * LOSS_SCALE))
        for namespace, family, table, hook, match in self._loss_rules():
            rules = (
                f"table {family} {table} {{\n"
                f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept;\n"
                f"    {match} numgen random mod {LOSS_SCALE} < {below} counter drop\n  }}\n}}\n"
            )
            done = subprocess.run(
                ["ip", "netns", "exec", namespace, "nft", "-f", "-"],
                input=rules,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                raise ServiceUnavailable(f"nft could not add a loss rule: {done.stderr.strip()}")

    def _loss_rules(self) -> list[tuple[str, str, str, str, str]]:
        """(namespace, family, table, hook, match) of :meth:`lose`'s two rules: what the host
        receives, at its input, and what it sends, as its port forwards it through the switch."""
        return [
            (self.namespace, "inet", LOSS_TABLE, "input", 'iifname "eth0"'),
            (
                self.bed.switch,
                "bridge",
                f"{LOSS_TABLE}_{self.switch_port}",
                "forward",
                f'iifname "{self.switch_port}"',
            ),
        ]

    def one_segment_per_packet(self) -> None:
        _run("ip", "-n", self.namespace, "link", "set", "dev", "eth0", "gso_max_segs", "1")

    def dropped(self) -> int:
        """Packets :meth:`lose`'s rules have dropped so far, both ways (0 without them)."""
        total = 0
        for namespace, family, table, _, _ in self._loss_rules():
            done = subprocess.run(
                ["ip", "netns", "exec", namespace, "nft", "list", "table", family, table],
                capture_output=True,
                text=True,
            )
            total += sum(int(n) for n in re.findall(r"counter packets (\d+)", done.stdout))
        return total

    def cut(self) -> None:
        """Partition this host from the switch (its interface down; connections stall)."""
        _run("ip", "-n", self.namespace, "link", "set", "eth0", "down")

    def reconnect(self) -> None:
        """Undo :meth:`cut`: the interface up again, its address and route as before."""
        _run("ip", "-n", self.namespace, "link", "set", "eth0", "up")

    def popen(
        self,
        argv: list[str],
        cpu_fraction: float | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (its own process group); killed when the bed closes.

        With ``cpu_fraction``, the process (and its children) is held to that fraction of one
        core by a cgroup v1 ``cpu`` quota before it runs a line of ``argv``.
        """
        prefix = ["ip", "netns", "exec", self.namespace]
        if cpu_fraction is not None:
            cgroup = self.bed.cpu_cgroup(f"{self.name}-{len(self.bed._made.cgroups)}", cpu_fraction)
            # The shell joins the cgroup, then becomes ``ip netns exec``: no instruction of argv
            # runs unthrottled. It joins outside the namespace because ``ip netns exec`` mounts a
            # fresh /sys without the cgroup hierarchy.
            join = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs")]
            prefix = join + prefix
        proc = subprocess.Popen(prefix + argv, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.bed._made.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60.0, **kwargs: object) -> str:
        """Run ``argv`` inside this host to completion and return its stdout (``kwargs``: of
        ``subprocess.Popen``, e.g. ``cwd``)."""
        proc = self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} in {self.name} exited {proc.returncode}: {err.decode()}")
        return out.decode()

    def proxy(
        self,
        listen_port: int,
        target: tuple[str, int],
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        reset_probability: float = 0.0,
        seed: int | None = None,
        loss: float = 0.0,
        listen_address: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """A ``linkproxy`` in this host on ``listen_address:listen_port`` (default: the host's
        address), forwarding to ``target``; ``loss`` is modelled (``linkproxy``'s docstring)."""
        argv = [sys.executable, "-m", "swarmrl.testing.linkproxy"]
        argv += [
            "--listen",
            f"{listen_address or self.address}:{listen_port}",
            "--target",
            f"{target[0]}:{target[1]}",
        ]
        argv += ["--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms)]
        argv += ["--reset-probability", str(reset_probability), "--loss", str(loss)]
        if seed is not None:
            argv += ["--seed", str(seed)]
        proc = self.popen(argv)
        self.bed.wait_port(self, listen_port, proc)
        return proc


class TestBed:
    """A private switch and the hosts on it; a context manager that undoes all it made."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ServiceUnavailable(reason)
        self.prefix = f"sw{secrets.token_hex(3)}"
        self.switch = f"{self.prefix}-switch"
        self.hosts: dict[str, Host] = {}
        self.segmented = False  # one_segment_per_packet: set once a link loses packets
        self._made = _Made()
        self._finalizer = weakref.finalize(self, _undo, self._made)
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._finalizer()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def add_host(
        self,
        name: str,
        up_mbit: float | None = None,
        down_mbit: float | None = None,
        loss: float = 0.0,
    ) -> Host:
        """A new host on the switch, its link capped at ``up_mbit``/``down_mbit`` (None: not)
        and losing ``loss`` of its packets each way (:meth:`Host.lose`)."""
        if name in self.hosts or len(self.hosts) >= 250:
            raise ValueError(f"host {name!r} exists, or the bed is full (250 hosts)")
        host = Host(self, name, len(self.hosts) + 1)
        self._add_namespace(host.namespace)
        _run(
            *("ip", "link", "add", "eth0", "netns", host.namespace, "type", "veth"),
            *("peer", "name", host.switch_port, "netns", self.switch),
        )
        _run("ip", "-n", self.switch, "link", "set", host.switch_port, "master", "br0", "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        self.hosts[name] = host
        if self.segmented:
            host.one_segment_per_packet()
        host.shape(up_mbit, down_mbit)
        host.lose(loss)
        return host

    def one_segment_per_packet(self) -> None:
        """Every host's interface sends one TCP segment per packet (``gso_max_segs 1``), now
        and for hosts added later: a veth otherwise carries a send's segments as one large
        packet, and a rule dropping "a packet" would drop dozens of segments at once."""
        if not self.segmented:
            self.segmented = True
            for host in self.hosts.values():
                host.one_segment_per_packet()

    def cpu_cgroup(self, name: str, fraction: float) -> Path:
        """A cgroup v1 ``cpu`` group whose tasks together get ``fraction`` of one core."""
        reason = cpu_unavailable_reason()
        if reason is not None:
            raise ServiceUnavailable(reason)
        if not 0.01 <= fraction <= 64:
            raise ValueError(f"cpu_fraction must be in [0.01, 64] cores, got {fraction}")
        cgroup = CGROUP_CPU / f"{self.prefix}-{name}"
        cgroup.mkdir()
        self._made.cgroups.append(cgroup)
        (cgroup / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        self.set_cpu(cgroup, fraction)
        return cgroup

    @staticmethod
    def set_cpu(cgroup: Path, fraction: float) -> None:
        """Hold the tasks of ``cgroup`` (one of :meth:`cgroups`) to ``fraction`` of a core from
        now on."""
        if not 0.01 <= fraction <= 64:
            raise ValueError(f"cpu_fraction must be in [0.01, 64] cores, got {fraction}")
        (cgroup / "cpu.cfs_quota_us").write_text(str(int(fraction * CFS_PERIOD_US)))

    def wait_port(
        self, host: Host, port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0
    ) -> None:
        """Block until something listens on ``host``'s TCP ``port``; fail if ``proc`` dies first."""
        deadline = time.monotonic() + timeout
        needle = f":{port} "
        while time.monotonic() < deadline:
            listening = subprocess.run(
                ["ip", "netns", "exec", host.namespace, "ss", "-Hltn"],
                capture_output=True,
                text=True,
            ).stdout
            if any(needle in line for line in listening.splitlines()):
                return
            if proc.poll() is not None:
                raise RuntimeError(
                    f"process in {host.name} exited {proc.returncode} before port {port}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"nothing listened on {host.name}:{port} within {timeout:.0f} s")

    def namespaces(self) -> list[str]:
        """The namespaces this bed holds now (the switch's first)."""
        return list(self._made.namespaces)

    def cgroups(self) -> list[Path]:
        return list(self._made.cgroups)
