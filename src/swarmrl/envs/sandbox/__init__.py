"""Running untrusted Python (a completion's code) under limits, on the trusted side only.

Three modes; ``auto`` (the default) takes the first of ``bwrap`` and ``unshare`` that starts
here, and where neither does, the sandbox refuses to start, in one line that names why and what
to install or enable. It never falls back by itself to a mode that does not isolate.

- ``bwrap`` (Debian's ``bubblewrap``, found on the ``PATH``): new user, PID, network, IPC, UTS
  and cgroup namespaces (``--unshare-all``), and no further user namespaces inside
  (``--disable-userns``, bubblewrap 0.8 and later).
- ``unshare``: the same namespaces made by the kernel directly (``unshare(2)``, ``mount(2)``,
  ``pivot_root(2)`` from ``isolate.py``; no helper binary, no privilege: it needs only user
  namespaces for unprivileged processes, which Linux gives unless a distribution restricts them,
  e.g. ``kernel.apparmor_restrict_unprivileged_userns = 1``),
  every capability dropped and ``no_new_privs`` set before the program runs, and no further
  user namespaces inside.
- ``rlimit``: limits only. It does **not** isolate the network, other processes or the
  filesystem; it runs only when named (``env.sandbox.mode = "rlimit"``), with a warning.

What the program sees under ``bwrap`` and ``unshare``: no network but a loopback of its own; only
its own processes (a fresh ``/proc``), none of which can signal the caller; ``/usr`` (with the
``/bin``, ``/lib`` links) and the interpreter's installation read-only; the program read-only at
``/task``; size-capped tmpfs (``4 × file_mb`` each) as its working directory ``/sandbox``, as
``/tmp`` and as ``/dev/shm``; ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``. Host
files, ``/etc``, ``/home``, ``/root``, run directories, databases and the host's ``/tmp`` and
``/dev/shm`` are not there at all. Every filesystem it can write is one of those capped tmpfs
(``/`` and ``/dev`` are read-only, and it can neither mount nor make a user namespace).

In every mode: when the caller is root, the program runs as an otherwise unused uid (so it cannot
read or write files only root may, and its process count is its own; where root cannot take
such uids, in a container of its own user namespace, it runs as the caller); the environment is
replaced by a minimal one (no host variables); stdin is the given input; stdout and stderr go to
files outside the sandbox of which at most ``output_bytes`` are kept; the whole process tree is
killed when the wall-clock limit passes. Limits (``setrlimit`` in the child before ``exec``): CPU
time (``RLIMIT_CPU``), address space (``RLIMIT_AS``), processes (``RLIMIT_NPROC``), file size
(``RLIMIT_FSIZE``, which also caps output), no core files.

Not isolated in any mode: CPU caches and timing, the kernel itself (a kernel exploit escapes
any namespace), reading world-readable files under ``/usr`` and the Python installation.
Not capped: System V shared memory of the run's own IPC namespace (freed when the run ends).

Knows nothing about tasks or rewards: code and input in, a :class:`RunResult` out.
"""

from __future__ import annotations

import itertools
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from swarmrl.envs.sandbox.modes import LAUNCHERS, Launcher
from swarmrl.errors import SandboxError

SandboxMode = Literal["auto", "bwrap", "unshare", "rlimit"]
ISOLATING = ("bwrap", "unshare")  # what auto tries, in this order
Verdict = Literal["ok", "error", "timeout", "memory", "output", "killed"]
EXIT_MEMORY = 90  # the runner's exit status for a MemoryError (see RUNNER)
SYSTEM_PYTHON = "/usr/bin/python3"
FIRST_UID = 200_000  # sandboxed programs run as FIRST_UID + n when the caller is root
UID_RANGE = 100_000
_uids = itertools.count()
_uid_lock = threading.Lock()
log = logging.getLogger(__name__)

# Runs the program as __main__ and turns a MemoryError into a distinct exit status, so the
# verdict never depends on reading the program's own output. (Not runpy, whose imports cost
# more than a trivial program's run.)
RUNNER = f"""\
import os, sys
sys.argv = ["main.py"]
try:
    main = type(sys)("__main__")
    main.__file__ = "/task/main.py"
    sys.modules["__main__"] = main
    with open("/task/main.py", "rb") as source:
        code = compile(source.read(), "/task/main.py", "exec")
    exec(code, main.__dict__)
except MemoryError:
    os._exit({EXIT_MEMORY})
except SystemExit:
    raise
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
"""


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    processes: int = 16
    output_bytes: int = 65536
    file_mb: int = 16


@dataclass(frozen=True)
class RunResult:
    """What one run did. ``stdout``/``stderr`` hold at most ``output_bytes`` each."""

    verdict: Verdict
    exit_code: int | None  # the program's exit status; None when it died by a signal
    stdout: str
    stderr: str
    wall_s: float


def default_python() -> str:
    """The system's ``python3`` (under ``/usr``, readable by the sandbox's uid) when there is
    one, else the interpreter running swarmrl."""
    return SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable


def _uids_mapped(first: int, count: int) -> bool:
    """Whether uids ``first`` … ``first + count − 1`` exist in this process's user namespace
    (all of them on a host; not in a rootless container, where root cannot switch to them)."""
    try:
        lines = Path("/proc/self/uid_map").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        inner, _, length = (int(field) for field in line.split())
        if inner <= first and first + count <= inner + length:
            return True
    return False


def _user_threads(uid: int) -> int:
    """Live tasks (processes and threads) of ``uid``: what ``RLIMIT_NPROC`` counts, less
    zombies (the kernel counts those too until reaped; the limit keeps a margin)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip()[:1] in ("Z", "X"):
            continue  # exited, waiting to be reaped: nothing left to kill
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` (a sandbox uid; only when the caller is root).

    A helper process takes the uid and signals ``-1`` (every process it may signal: exactly
    that uid's), again until ``/proc`` shows none left, so children that left the process
    group or were forked meanwhile die too.
    """
    for _ in range(100):
        if _user_threads(uid) == 0:
            return
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child only kills and exits
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.01)


class Sandbox:
    """Runs Python source under :class:`Limits` in ``mode`` (resolved and probed at start)."""

    def __init__(
        self, limits: Limits | None = None, mode: SandboxMode = "auto", python: str | None = None
    ) -> None:
        self.limits = limits or Limits()
        self.python = python or default_python()
        self.uids: set[int] = set()  # the uids its programs ran as (when the caller is root)
        self.root = os.geteuid() == 0 and _uids_mapped(FIRST_UID, UID_RANGE)
        if mode == "auto":
            causes = {}
            for name in ISOLATING:
                causes[name] = self._start(name)
                if causes[name] is None:
                    return
            raise SandboxError(_refusal(causes))
        if mode not in LAUNCHERS:
            raise SandboxError(
                f"env.sandbox.mode = {mode!r} is not one of auto, {', '.join(LAUNCHERS)}"
            )
        cause = self._start(mode)
        if cause is not None:
            raise SandboxError(f"env.sandbox.mode = {mode!r} cannot start: {cause}")
        if mode == "rlimit":
            log.warning(
                "env.sandbox.mode = 'rlimit': completions' code runs with resource limits only, "
                "and can read the host's files and processes and reach its network"
            )

    def _start(self, mode: str) -> str | None:
        """Take ``mode`` when it starts here (None), else say why not (one line)."""
        self.mode = mode
        self.launcher: Launcher = LAUNCHERS[mode]
        cause = self.launcher.unavailable()
        if cause is not None:
            return cause
        probe = self.run("print('ok')")
        if probe.verdict == "ok" and probe.stdout.strip() == "ok":
            return None
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        return lines[-1] if lines else f"the probe run ended {probe.verdict} ({probe.exit_code})"

    def _rlimits(self, uid: int | None) -> list[tuple[int, tuple[int, int]]]:
        """The limits the child sets before ``exec`` (computed here: no work after fork)."""
        lim = self.limits
        extra = lim.processes + 1 + self.launcher.helpers  # the program and the mode's helpers
        nproc = extra if uid is not None else _user_threads(os.getuid()) + extra
        return [
            (resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1)),
            (resource.RLIMIT_AS, (lim.memory_mb * 2**20,) * 2),
            (resource.RLIMIT_NPROC, (nproc, nproc)),
            (resource.RLIMIT_FSIZE, (lim.file_mb * 2**20,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]

    def _uid(self) -> int | None:
        if not self.root:
            return None
        with _uid_lock:
            uid = FIRST_UID + (os.getpid() * 97 + next(_uids)) % UID_RANGE
        self.uids.add(uid)
        return uid

    def run(self, source: str, stdin: str = "") -> RunResult:
        """Run ``source`` as ``main.py`` with ``stdin``; never raises for what the code does."""
        with tempfile.TemporaryDirectory(prefix="swarmrl-sandbox-") as tmp:
            base = Path(tmp)
            task_dir = base / "task"
            task_dir.mkdir()
            (task_dir / "main.py").write_text(source)
            (task_dir / "runner.py").write_text(RUNNER)
            uid = self._uid()
            argv, cwd = self.launcher.argv(self.python, base, task_dir, self.limits.file_mb)
            if uid is not None and cwd != str(task_dir):
                os.chown(cwd, uid, uid)  # the unisolated program's own directory
            for path in (base, task_dir, *task_dir.iterdir()):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            return self._execute(argv, cwd, base, stdin, uid)

    def _execute(
        self, argv: list[str], cwd: str, base: Path, stdin: str, uid: int | None
    ) -> RunResult:
        lim = self.limits
        env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8"}
        if self.mode == "rlimit":
            env["HOME"] = cwd
        (base / "stdin").write_text(stdin)
        limits = self._rlimits(uid)

        def preexec() -> None:  # in the child, between fork and exec
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            for what, value in limits:
                resource.setrlimit(what, value)

        start = time.monotonic()
        timed_out = False
        private = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with (
            (base / "stdin").open("rb") as fin,
            open(os.open(base / "stdout", private, 0o600), "wb") as fout,
            open(os.open(base / "stderr", private, 0o600), "wb") as ferr,
        ):
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            except OSError as exc:  # the interpreter or bwrap cannot be executed at all
                raise SandboxError(f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
            try:
                proc.wait(timeout=lim.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                self._kill_tree(proc, uid)
        wall = time.monotonic() - start
        return self._result(proc.returncode, base, timed_out, wall)

    def _kill_tree(self, proc: subprocess.Popen[bytes], uid: int | None) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if uid is not None:
            _kill_uid(uid)  # children that left the process group

    def _result(self, code: int, base: Path, timed_out: bool, wall: float) -> RunResult:
        lim = self.limits
        sizes = [(base / name).stat().st_size for name in ("stdout", "stderr")]
        out, err = (
            (base / name).open("rb").read(lim.output_bytes) for name in ("stdout", "stderr")
        )
        signum = -code if code < 0 else 0
        if self.launcher.signal_in_status and code > 128:
            signum = code - 128
        verdict: Verdict
        if timed_out or signum == signal.SIGXCPU:
            verdict = "timeout"
        elif sum(sizes) > lim.output_bytes or signum == signal.SIGXFSZ:
            verdict = "output"
        elif code == EXIT_MEMORY:
            verdict = "memory"
        elif signum:
            verdict = "killed"
        else:
            verdict = "ok" if code == 0 else "error"
        return RunResult(
            verdict=verdict,
            exit_code=None if signum else code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            wall_s=wall,
        )


def _refusal(causes: dict[str, str | None]) -> str:
    """The one line ``auto`` says when no isolating mode starts here."""
    why = "; ".join(f"{mode}: {cause}" for mode, cause in causes.items())
    return (
        f"no isolating sandbox can start here ({why}): install bubblewrap (Debian/Ubuntu: "
        "apt-get install bubblewrap) or allow user namespaces (sysctl "
        "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, "
        "kernel.apparmor_restrict_unprivileged_userns=0); "
        "env.sandbox.mode = 'rlimit' runs the code unisolated"
    )


class PromptsOnly(Sandbox):
    """Stands where a sandbox would in a process that never scores (a worker: workers draw tasks
    and build prompts; rewards are computed on the trusted side). Nothing is started, so such a
    process needs neither bubblewrap nor user namespaces; running code here is an error."""

    def __init__(self) -> None:  # deliberately starts nothing (see the class docstring)
        self.limits = Limits()
        self.python = default_python()
        self.uids = set()
        self.root = False
        self.mode = "none"

    def run(self, source: str, stdin: str = "") -> RunResult:
        raise SandboxError(
            "this process only builds prompts and has no code sandbox; completions are scored "
            "on the trusted side (validator, trainer)"
        )
