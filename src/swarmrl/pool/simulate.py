"""Synthetic pool participants for tests and benchmarks: a node that answers work units with
random tokens, and a local orchestrator on a loopback ephemeral port.

The synthetic samples are well-formed but meaningless (no model runs); a validator replaying
them would reject them. Knows nothing about inference.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

from swarmrl.config.pool import PoolConfig
from swarmrl.identity.keys import KeyPair
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.protocol.pool import NodeMetadata, Sample, WorkUnit

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
