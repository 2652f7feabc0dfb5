"""Front processes on the orchestrator's port: ``swarmrl orchestrator --fronts N``.

The orchestrator (one process, one database writer) listens on a Unix socket in a fresh
directory only this user can enter and starts N front processes (``swarmrl.pool.web.front``) on
the public port, all with ``SO_REUSEPORT``; the first binds the port asked for (0: a free one)
and the others the one it got. Fronts parse HTTP and check signatures on the cores the
orchestrator's event loop does not use, and bring every request to it (``swarmrl.pool.web.bridge``).
The orchestrator stops them when it stops and stops when one of them ends.

Process wiring only; knows nothing about pool rules.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import UserError
from swarmrl.roles.orchestrator.workers import all_alive, listening_port, stop_all


class FrontGroup:
    """N front processes for one orchestrator (the ``Fronts`` of ``swarmrl.pool.server``)."""

    def __init__(
        self, count: int, config: PoolConfig, keep_alive_s: float, timeout_s: float = 60.0
    ) -> None:
        if count < 1:
            raise UserError(f"--fronts must be at least 1, not {count}")
        self.count, self.config, self.keep_alive_s = count, config, keep_alive_s
        self.timeout_s = timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="swarmrl-fronts-"))  # mode 0700
        self.bridge = str(self._dir / "orchestrator.sock")
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, host: str, port: int) -> int:
        for i in range(self.count):
            port_file = self._dir / f"front-{i}.port"
            cfg = self.config
            command = [
                sys.executable, "-m", "swarmrl.pool.web.front", "--bridge", self.bridge,
                "--host", host, "--port", str(port), "--port-file", str(port_file),
                "--max-body-bytes", str(cfg.max_body_bytes),
                "--window-s", str(cfg.request_window_s),
                "--future-s", str(cfg.request_future_skew_s),
                "--keep-alive-s", str(self.keep_alive_s),
                "--full-gc-every-s", str(cfg.full_gc_every_s),
            ]  # fmt: skip
            proc = subprocess.Popen(command)
            self.procs.append(proc)
            deadline = time.monotonic() + self.timeout_s
            port = listening_port(proc, port_file, "front", port, deadline)
        return port

    def alive(self) -> bool:
        return all_alive(self.procs, lambda _: "a front")

    def stop(self) -> None:
        stop_all(self.procs)
        shutil.rmtree(self._dir, ignore_errors=True)
