"""How each sandbox mode starts a program: the command line, the processes it adds, how its
exit status reads, and why it cannot start here (when it cannot).

- :class:`Bubblewrap` runs Debian's ``bwrap`` (found on the ``PATH``, run by absolute path);
- :class:`Namespaces` runs the interpreter on ``isolate.py``, which isolates itself with
  ``unshare(2)``, ``mount(2)`` and ``pivot_root(2)`` (no helper binary);
- :class:`Unisolated` runs the interpreter directly: resource limits only.

Knows nothing about rlimits, uids or verdicts (the :class:`~swarmrl.envs.sandbox.Sandbox` applies
and reads those): only the argument vectors and what a mode needs from the host.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

ISOLATE = Path(__file__).with_name("isolate.py")
TMPFS_PER_FILE = 4  # each tmpfs the program can write holds this many of its largest files


def installation_prefix(exe: str) -> str:
    """The installation directory of interpreter ``exe`` (``.../bin/python`` → ``...``)."""
    return str(Path(os.path.realpath(exe)).parent.parent)


def tmpfs_bytes(file_mb: int) -> int:
    """The size cap of each writable filesystem the program sees."""
    return file_mb * TMPFS_PER_FILE * 2**20


class Launcher(Protocol):
    name: str
    helpers: int  # processes of the run besides the program (they count in RLIMIT_NPROC)
    signal_in_status: bool  # a status > 128 means death by signal (status − 128)

    def unavailable(self) -> str | None:
        """Why this mode cannot start here (one line), or None when it may: a cheap check;
        the sandbox's probe run decides."""
        ...

    def argv(self, python: str, base: Path, task: Path, file_mb: int) -> tuple[list[str], str]:
        """The command and its working directory for the program in ``task``
        (``main.py``, ``runner.py``); ``base`` is the run's private scratch directory."""
        ...


class Bubblewrap:
    """``bwrap --unshare-all``: see the package docstring."""

    name = "bwrap"
    helpers = 2
    signal_in_status = True

    def unavailable(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
        return None

    def argv(self, python: str, base: Path, task: Path, file_mb: int) -> tuple[list[str], str]:
        bwrap = shutil.which("bwrap") or "bwrap"
        prefix = installation_prefix(python)
        args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if _bwrap_disables_userns(bwrap):
            args += ["--unshare-user", "--disable-userns"]
        args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for top in ("bin", "lib", "lib32", "lib64", "sbin"):
            host = Path("/") / top
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                args += ["--ro-bind", str(host), str(host)]
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
        size = str(tmpfs_bytes(file_mb))
        args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
        args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox"]
        args += ["--ro-bind", str(task), "/task", "--chdir", "/sandbox"]
        args += ["--remount-ro", "/dev", "--remount-ro", "/"]  # bwrap's own tmpfs: no size cap
        return [*args, os.path.realpath(python), "-I", "/task/runner.py"], str(task)


@functools.cache
def _bwrap_disables_userns(bwrap: str) -> bool:
    """Whether this bubblewrap has ``--disable-userns`` (0.8.0 and later)."""
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in usage.stdout + usage.stderr


class Namespaces:
    """Kernel namespaces set up by ``isolate.py``: see its docstring."""

    name = "unshare"
    helpers = 2
    signal_in_status = False

    def unavailable(self) -> str | None:
        if not Path("/proc/self/ns/user").exists():
            return "the kernel has no user namespaces (CONFIG_USER_NS)"
        return None

    def argv(self, python: str, base: Path, task: Path, file_mb: int) -> tuple[list[str], str]:
        root = base / "root"
        root.mkdir()
        os.chmod(root, 0o755)
        prefix = installation_prefix(python)
        if prefix == "/usr" or prefix.startswith("/usr/"):
            prefix = ""
        size = str(tmpfs_bytes(file_mb))
        script = base / "isolate.py"  # a copy the sandbox's uid can read
        script.write_text(_isolate_source())
        os.chmod(script, 0o644)
        exe = os.path.realpath(python)  # the installation itself, not a venv's link to it
        return [exe, "-I", str(script), str(root), str(task), prefix, size], str(task)


@functools.cache
def _isolate_source() -> str:
    return ISOLATE.read_text()


class Unisolated:
    """The interpreter alone, under the rlimits: no namespaces at all."""

    name = "rlimit"
    helpers = 0
    signal_in_status = False

    def unavailable(self) -> str | None:
        return None

    def argv(self, python: str, base: Path, task: Path, file_mb: int) -> tuple[list[str], str]:
        runner = task / "runner.py"
        runner.write_text(runner.read_text().replace("/task/", f"{task}/"))
        work = base / "work"
        work.mkdir()
        return [python, "-I", str(runner)], str(work)


LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher for launcher in (Bubblewrap(), Namespaces(), Unisolated())
}
