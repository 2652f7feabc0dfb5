"""``swarmrl serve`` (or ``swarmrl dashboard``) as a test or a benchmark meets it: a real server
process on loopback.

:class:`ServeProcess` starts ``python -m swarmrl.cli VERB PATH --port 0`` with the given flags,
waits (bounded) for the port it bound, and offers the server's memory as the kernel counts it.
Knows nothing about pytest or about what the server answers.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ServeProcess:
    """One ``swarmrl serve`` process (``verb="dashboard"``: a ``swarmrl dashboard`` one); a
    context manager that stops it on exit."""

    def __init__(
        self, path: Path, *flags: str, start_timeout_s: float = 120.0, verb: str = "serve"
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="swarmrl-serve-")
        port_file = Path(self._dir.name) / "port"
        self.log = Path(self._dir.name) / "log"
        argv = [sys.executable, "-m", "swarmrl.cli", verb, str(path), "--port", "0"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*argv, "--port-file", str(port_file), *flags], stdout=log, stderr=log
            )
        deadline = time.monotonic() + start_timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.log.read_text()
                self.stop()
                raise RuntimeError(f"swarmrl {verb} did not start:\n{output}")
            time.sleep(0.1)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def memory_kib(self) -> dict[str, int]:
        """``VmRSS`` (resident now) and ``VmHWM`` (the most resident so far), KiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in status)
        return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._dir.cleanup()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
