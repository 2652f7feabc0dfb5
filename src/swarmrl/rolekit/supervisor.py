"""Start roles as child processes, wait until they answer, and stop them all cleanly.

Each role runs as ``python -m swarmrl.cli VERB …`` in its own process group, so a signal to
the group reaches anything the role itself started; what it started in a group or session of
its own (torchrun does so with its ranks) is found in ``/proc`` and signalled too. A role's
stdout and stderr are appended to one log file per role in ``<run_dir>/logs/``. On Linux every
child also asks the kernel to send it SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``),
so even a supervisor killed with SIGKILL leaves no orphans. Stopping is SIGTERM to each group,
then SIGKILL after a grace period. Children must be started from the main thread: the death
signal is tied to the thread that forked them.

Knows nothing about what the roles do; ``swarmrl.launch.swarm`` decides what to start.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx
import tenacity

from swarmrl.errors import RoleExited, WaitTimeout

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a role that binds it later.

    Drawn below the kernel's ephemeral range (``ip_local_port_range``): a port from that range
    can be taken meanwhile as the source port of any outgoing connection (a role starting
    seconds later lost its port that way), one below it only by another listener. Where the
    range leaves no room below it, the OS picks, as before; a race stays possible either way.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10000, low) if low > 11000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free port below {low} on {host}")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux); 0 where unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel to send this process ``sig`` when its parent dies (Linux; elsewhere it
    does nothing). Tied to the parent *thread* that forked this process."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM me when my parent dies."""
    die_with_parent(signal.SIGTERM)


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` from the state on (field 3 is index 0), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid`` (children, theirs, ...) → their start time, read from
    ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return {}
    for name in entries:
        fields = _stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
            started[int(name)] = fields[19]
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found[child] = started[child]
            todo.extend(children.get(child, []))
    return found


def role_command(verb: str, args: Sequence[str]) -> list[str]:
    """The command line that runs ``swarmrl VERB args`` with this interpreter."""
    return [sys.executable, "-m", "swarmrl.cli", verb, *args]


def torchrun_command(nproc: int, verb: str, args: Sequence[str]) -> list[str]:
    """The command line that runs ``swarmrl VERB args`` as ``nproc`` ranks on this node."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc-per-node={nproc}", "-m", "swarmrl.cli", verb, *args]


# Exit statuses a role uses to say "do not start me again": 0 (done) and this one (the pool
# banned the node: a restart with the same key would only be refused again).
EXIT_BANNED = 3


@dataclass
class RoleProcess:
    """One started role: its name, process, log file, and how to start it again."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # times this role was started again after it crashed
    # processes the role started in groups of their own (torchrun's ranks have their own
    # sessions), pid → start time: remembered when the role is signalled, since once the
    # role has exited they hang from init and cannot be found from it any more
    strays: dict[int, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of this role's log (what it said before it died)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def wait_until(
    probe: Callable[[], bool], what: str, timeout_s: float, interval_s: float = 0.2
) -> None:
    """Poll ``probe`` until it returns True; raise :class:`WaitTimeout` naming ``what``."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda ok: not ok),
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_fixed(interval_s),
    )
    try:
        retrying(probe)
    except tenacity.RetryError:
        raise WaitTimeout(f"gave up after {timeout_s:.0f} s waiting for {what}") from None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when a GET of ``url`` answers 2xx; False for any connection failure."""
    try:
        return httpx.get(url, timeout=timeout_s).is_success
    except httpx.HTTPError:
        return False


class Supervisor:
    """Starts role processes and guarantees they are all gone when it is done.

    Use as a context manager: leaving the block (normally, by an exception or by Ctrl-C)
    stops every role. :meth:`check` raises :class:`RoleExited` when any role has died.
    """

    def __init__(
        self,
        run_dir: str | Path,
        grace_s: float = 10.0,
        max_restarts: int = 0,
        restart_backoff_s: float = 1.0,
    ) -> None:
        """``max_restarts``: how many times :meth:`tend` starts a crashed role again (each
        after ``restart_backoff_s`` doubled per earlier restart) before giving up on it."""
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.roles: dict[str, RoleProcess] = {}
        self.retired: set[str] = set()  # stopped on purpose: their exit is not a failure
        self.events: list[str] = []  # restarts, for the run's report and display

    # -- starting -------------------------------------------------------------------------
    def start(
        self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None
    ) -> RoleProcess:
        """Start ``command`` as role ``name`` in its own process group, logging to a file."""
        if name in self.roles and self.roles[name].alive():
            raise ValueError(f"role {name!r} is already running (pid {self.roles[name].pid})")
        log_path = self.log_dir / f"{name}.log"
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} start: {' '.join(command)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        previous = self.roles.get(name)
        role = RoleProcess(name, popen, log_path, list(command), dict(env or {}))
        role.restarts = previous.restarts if previous is not None else 0
        self.roles[name] = role
        self.retired.discard(name)
        return role

    def start_role(
        self, name: str, verb: str, args: Sequence[str], env: Mapping[str, str] | None = None
    ) -> RoleProcess:
        """Start ``swarmrl VERB args`` as role ``name``."""
        return self.start(name, role_command(verb, args), env)

    def wait_ready(self, name: str, probe: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Wait until ``probe`` holds; fail at once (with its log tail) if the role dies."""
        role = self.roles[name]

        def ready() -> bool:
            if not role.alive():
                raise self._exited(role)
            return probe()

        wait_until(ready, f"{name} to be ready ({what}); log: {role.log_path}", timeout_s)

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        """Wait until role ``name`` answers a GET of ``url`` with 2xx."""
        self.wait_ready(name, lambda: http_ok(url), f"GET {url} answers 2xx", timeout_s)

    # -- watching -------------------------------------------------------------------------
    def _exited(self, role: RoleProcess) -> RoleExited:
        """The error of a role that died: its first line says why, in the role's own last words
        (its one-line error, or the last line of its traceback); its log's tail follows."""
        tail = role.log_tail()
        said = [  # not the supervisor's own notes, nor a traceback's ^^^ markers
            x for x in tail.splitlines() if x.strip(" ^~") and not x.startswith("--- ")
        ]
        why = f": {said[-1].strip()}" if said else ""
        return RoleExited(
            f"role {role.name} exited with status {role.popen.returncode}{why}\n"
            f"last lines of {role.log_path}:\n{tail}"
        )

    def check(self, expected_done: Sequence[str] = ()) -> None:
        """Raise :class:`RoleExited` if a role not in ``expected_done`` has ended.

        A role in ``expected_done`` may end, but only with status 0; a role stopped through
        :meth:`stop` or :meth:`kill` may end any way.
        """
        for role in self.roles.values():
            code = role.popen.poll()
            if code is None or role.name in self.retired:
                continue
            if role.name in expected_done and code == 0:
                continue
            raise self._exited(role)

    def tend(self, expected_done: Sequence[str] = ()) -> list[str]:
        """As :meth:`check`, but a crashed role is started again, up to ``max_restarts`` times
        with a doubling pause, its log saying so; returns what was restarted. A role that
        exits 0 where that is expected, or with :data:`EXIT_BANNED`, is not restarted."""
        restarted = []
        for role in list(self.roles.values()):
            code = role.popen.poll()
            if code is None or role.name in self.retired:
                continue
            if code == 0 and role.name in expected_done:
                continue
            if code == EXIT_BANNED or role.restarts >= self.max_restarts:
                raise self._exited(role)
            time.sleep(self.restart_backoff_s * 2**role.restarts)
            note = f"{role.name} exited with status {code}; restart {role.restarts + 1}"
            with open(role.log_path, "ab") as log:
                log.write(f"--- {time.strftime('%H:%M:%S')} {note}\n".encode())
            role.restarts += 1  # carried over to the new process by start()
            self.start(role.name, role.command, role.env)
            self.events.append(f"{time.strftime('%H:%M:%S')} {note}")
            restarted.append(role.name)
        return restarted

    def retire(self, name: str) -> None:
        """From now on an exit of role ``name`` is expected (e.g. a worker that was banned)."""
        self.retired.add(name)

    # -- stopping -------------------------------------------------------------------------
    def stop(self, name: str, sig: signal.Signals = signal.SIGTERM) -> int:
        """Send ``sig`` to role ``name``'s process group; SIGKILL after the grace period.

        Returns the exit status.
        """
        role = self.roles[name]
        self.retired.add(name)
        self._signal_group(role, sig)
        try:
            return role.popen.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(role, signal.SIGKILL)
            return role.popen.wait(timeout=self.grace_s)

    def stop_soon(self, names: Sequence[str]) -> None:
        """SIGTERM the process groups of ``names`` without waiting for them (they finish what
        they are doing and exit; :meth:`shutdown` collects them at the end)."""
        for name in names:
            self.retired.add(name)
            self._signal_group(self.roles[name], signal.SIGTERM)

    def kill(self, name: str) -> int:
        """SIGKILL role ``name`` at once (fault tests: a machine that vanishes)."""
        role = self.roles[name]
        self.retired.add(name)
        self._signal_group(role, signal.SIGKILL)
        return role.popen.wait(timeout=self.grace_s)

    @staticmethod
    def _signal_group(role: RoleProcess, sig: signal.Signals) -> None:
        """``sig`` to the role's process group and to what it started outside that group."""
        for pid, started in _descendants(role.pid).items():
            try:
                if os.getpgid(pid) != role.pid:
                    role.strays[pid] = started
            except ProcessLookupError:
                pass
        try:
            os.killpg(role.pid, sig)  # the role leads its own group: pgid == pid
        except ProcessLookupError:
            pass
        for pid, started in list(role.strays.items()):
            fields = _stat_fields(pid)
            if fields is None or fields[19] != started:  # gone, or the pid is someone else's
                del role.strays[pid]
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                del role.strays[pid]

    def shutdown(self) -> None:
        """SIGTERM every role group, wait up to the grace period, SIGKILL what is left.

        Groups are signalled even when their leader has already exited, so a role's own
        children cannot outlive it.
        """
        roles = list(self.roles.values())
        for role in roles:
            self._signal_group(role, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for role in roles:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                role.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
        for role in roles:
            self._signal_group(role, signal.SIGKILL)
            if role.popen.poll() is None:
                role.popen.wait(timeout=self.grace_s)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt, so cleanup runs as for Ctrl-C."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
