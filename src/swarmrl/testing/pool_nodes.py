"""Synthetic pool participants for tests and benchmarks: a node that answers work units with
random tokens, and a local orchestrator on a loopback ephemeral port (in a thread, or as a
``swarmrl orchestrator`` child process).

The synthetic samples are well-formed but meaningless (no model runs); a validator replaying
them would reject them. Knows nothing about inference.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import WaitTimeout
from swarmrl.identity.keys import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import NodeMetadata, PoolSpec, Sample, WorkUnit

CPU_NODE = NodeMetadata(engine="torch", memory_gb=16.0, accelerator="cpu")


def synthetic_samples(
    work: WorkUnit,
    policy_version: int,
    *,
    prompt_len: int = 8,
    output_len: int | None = None,
    rng: random.Random | None = None,
) -> list[Sample]:
    """``samples_per_task`` well-formed random completions for every task of ``work``."""
    rng = rng or random.Random(work.seed)
    length = work.sampling.max_new_tokens if output_len is None else output_len
    return [
        Sample(
            task_index=task,
            prompt_tokens=[rng.randrange(1000) for _ in range(prompt_len)],
            output_tokens=[rng.randrange(1000) for _ in range(length)],
            logprobs=[-rng.random() * 5 for _ in range(length)],
            finish_reason="length",
            policy_version=policy_version,
            proof={"chunks": [rng.randbytes(8).hex()]},
        )
        for task in work.task_indices
        for _ in range(work.samples_per_task)
    ]


@contextlib.contextmanager
def local_orchestrator(
    run_dir: str | Path, key: KeyPair | None = None, config: PoolConfig | None = None
) -> Iterator[OrchestratorServer]:
    """An orchestrator serving ``run_dir``'s SQLite db and store on 127.0.0.1:<free port>."""
    server = OrchestratorServer(make_context(key or KeyPair.generate(), run_dir, config))
    with server:
        yield server


# pool settings under which silence never moves a node (unhealthy, dead, ejected) in a test's time
NEVER_SILENT = {"unhealthy_after_s": 3600, "dead_after_s": 7200, "eject_after_s": 10800}


@contextlib.contextmanager
def quiet_pool(run_dir: str | Path, pool_id: str) -> Iterator[tuple[OrchestratorServer, KeyPair]]:
    """A local orchestrator holding one small pool ``pool_id`` whose nodes are never judged
    unhealthy, dead or ejected for silence (heartbeats applied at once): ``(server, owner)``,
    the owner's key signing invites."""
    orch, owner = KeyPair.generate(), KeyPair.generate()
    with local_orchestrator(
        run_dir, orch, PoolConfig(heartbeat_flush_s=0, **NEVER_SILENT)
    ) as server:
        spec = PoolSpec(
            pool_id=pool_id,
            owner_key=owner.public_key_hex,
            task_count=10,
            samples_per_task=1,
            sampling=SamplingParams(max_new_tokens=4),
            validators=[KeyPair.generate().public_key_hex],
        )
        PoolClient(server.url, orch).create_pool(spec)
        yield server, owner


def spawn_orchestrator(
    run_dir: Path,
    key_file: Path,
    spec_files: list[Path],
    timeout_s: float = 60.0,
    settings: dict[str, object] | None = None,
    args: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """``swarmrl orchestrator`` as a child process in its own session on 127.0.0.1:<free port>.

    ``settings``: config keys to override (``{"pool.join_burst": 5000}`` → ``--set``);
    ``args``: further command-line arguments (``["--db", url, "--workers", "2"]``).

    Returns the process and its URL once it listens; its output goes to ``run_dir/orch.log``.
    The caller stops it (SIGTERM) and waits for it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    port_file = run_dir / "port"
    port_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "orchestrator",
        "--key",
        str(key_file),
        "--run-dir",
        str(run_dir),
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    for spec in spec_files:
        cmd += ["--pool", str(spec)]
    for key, value in (settings or {}).items():
        cmd += ["--set", f"{key}={value}"]
    cmd += list(args)
    log = (run_dir / "orch.log").open("ab")
    # own session: a clean process group, and on a machine with autogroup scheduling its own
    # fair share of CPU instead of one split with whoever started it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=10)
            tail = (run_dir / "orch.log").read_text(errors="replace")[-2000:]
            raise WaitTimeout(f"orchestrator did not start within {timeout_s} s:\n{tail}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"
