"""CPU seconds of processes from ``/proc``, for the pool benchmark (``bench/pool.py``): an
orchestrator's process group, the orchestrator alone, a PostgreSQL server by its port."""

from __future__ import annotations

import os
from pathlib import Path


def _stats() -> list[list[str]]:
    """The fields after the command name of every process's ``/proc/<pid>/stat``."""
    found = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            found.append([path.parent.name, *path.read_text().rsplit(")", 1)[1].split()])
        except OSError:  # ended meanwhile
            continue
    return found


def _cpu(fields: list[str]) -> float:  # fields as _stats gives them: pid first
    return (int(fields[12]) + int(fields[13])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of the process group ``pid`` leads: the orchestrator and its further server
    processes (``--workers``) or fronts (``--fronts``), which it starts in its own session."""
    return sum(_cpu(f) for f in _stats() if f[3] == str(pid))


def own_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` alone (the orchestrator without its fronts)."""
    return sum(_cpu(f) for f in _stats() if f[0] == str(pid))


def postgres_cpu_seconds(port: int | None) -> float:
    """CPU seconds of the PostgreSQL server on ``port`` (its postmaster and its children); 0
    without one. Backends that ended took their CPU time with them: the orchestrators keep
    their connections, so few do."""
    if port is None:
        return 0.0
    flag = f" -p {port} ".encode()
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if flag in b" " + path.read_bytes().replace(b"\0", b" "):
                postmaster = path.parent.name
                break
        except OSError:
            continue
    else:
        return 0.0
    return sum(_cpu(f) for f in _stats() if postmaster in (f[0], f[2]))
