"""Announcing and publishing the trainer's policy versions without holding up its next step.

:class:`Announcer` tells the orchestrator each new version at once, from a thread of its own (the
next step does not wait the round trip: across a slow link to the orchestrator that was one
round trip a step), and saves, shards and signs it through the origin
(:class:`swarmrl.roles.trainer.origin.Origin`) in another background thread, from a snapshot of
the weights that later optimizer steps do not touch. Knows nothing about the training loop
beyond the learner whose weights it snapshots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from swarmrl.config import SwarmConfig
from swarmrl.model.io import save_policy
from swarmrl.pool.client import PoolClient
from swarmrl.rolekit.toolkit import StatusReporter, retry
from swarmrl.roles.trainer.origin import Origin
from swarmrl.trainer.learner import Learner


def weights_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s weights that later optimizer steps do not touch (tensors the model
    shares, like tied embeddings, stay shared in the copy)."""
    copies: dict[int, torch.Tensor] = {}
    snapshot = {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        snapshot[name] = copies[key]
    return snapshot


class Announcer:
    """Tells the orchestrator each new version and publishes it through the origin in a
    background thread, so that the next step does not wait for it.

    ``announce(v)`` sends the orchestrator the new version at once (so nothing more is leased
    for the old one) without waiting for its answer, takes a snapshot of the weights (the next
    optimizer step changes them) and queues the save, shard and sign; versions are told and go
    out in order. A failure is raised by the next ``announce``, by ``wait`` or by ``tell``.
    ``pool`` is this announcer's own client (its threads do not share one with the training
    loop). ``announce(v, final=True)``
    also waits for everything queued and tells the orchestrator the run is over, so workers and
    validators stop.

    ``version_offset``: versions minus steps trained (0 unless a resumed trainer skipped
    versions, ``continue_versions``). The orchestrator sizes leases by how many versions the run
    has left, so it is told the version the run ends at, ``rl.steps + version_offset``: told
    ``rl.steps`` after a skip, it would refuse the last steps' work as past the run's end.
    """

    def __init__(
        self,
        origin: Origin,
        pool: PoolClient,
        pool_id: str,
        learner: Learner,
        scratch: Path,
        config: SwarmConfig,
        log: logging.Logger,
        status: StatusReporter,
    ) -> None:
        self.origin, self.pool, self.pool_id, self.learner = origin, pool, pool_id, learner
        self.scratch, self.config, self.log, self.status = scratch, config, log, status
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._telling = ThreadPoolExecutor(1, thread_name_prefix="tell")  # in order, one at a time
        self._pending: list[Future[None]] = []  # tells and publishes not yet seen done
        self.version_offset = 0
        self._queued: set[int] = set()  # versions handed to the publishing thread
        self.published: list[tuple[float, int]] = []  # (Unix s, version) once announced

    def __call__(self, version: int, final: bool = False) -> None:
        self._raise_failures()
        if version not in self.origin.versions and version not in self._queued:
            snapshot = self._writer()
            # the orchestrator learns the version at once, so that no unit is leased for the
            # old one meanwhile; the weights follow (a worker waits for them to download)
            self._pending.append(self._telling.submit(self._tell, version))
            self._queued.add(version)
            self._pending.append(self._executor.submit(self._publish, version, snapshot))
        if final:
            self.wait()
            self.tell(version, finished=True)
            self.log.info(
                "the run's last step is trained (v%d); told the orchestrator the run is "
                "finished, so its workers and validators stop",
                version,
            )

    def wait(self) -> None:
        """Block until every queued version is told and out; raise the first failure."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        self._telling.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    def told(self) -> int:
        """The version the orchestrator holds as current (the last one told)."""
        return retry(
            lambda: self.pool.pool(self.pool_id).current_version,
            "read the pool's current version",
            self.log,
            give_up_s=self.config.swarm.give_up_s,
            pause_s=self.config.swarm.retry_s,
        )

    def tell(self, version: int, finished: bool = False) -> None:
        """``/version`` with the run's plan, now, after the versions already queued were told
        (so an older one never arrives after it)."""
        self._telling.submit(lambda: None).result()  # the queue before it is drained
        self._raise_failures()
        self._tell(version, finished)

    def _tell(self, version: int, finished: bool = False) -> None:
        """``/version`` with the run's plan (the version it ends at and its batch size, for
        admission)."""
        swarm, rl = self.config.swarm, self.config.rl
        retry(
            lambda: self.pool.set_version(
                self.pool_id,
                version,
                steps=rl.steps + self.version_offset,
                tasks_per_step=rl.prompts_per_step,
                finished=finished,
            ),
            f"announce v{version}" + (" and the end of the run" if finished else ""),
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
        )

    def _writer(self) -> Callable[[Path], Path]:
        """A writer of the version as it is now, whatever later steps do: with LoRA the base
        plus the current adapter, else a snapshot of the whole weights."""
        learner = self.learner
        if learner.versions is not None:
            return learner.version_writer()
        weights = weights_snapshot(learner.policy)
        return lambda out: save_policy(learner.policy, learner.tokenizer, out, weights)

    def _publish(self, version: int, snapshot: Callable[[Path], Path]) -> None:
        started = time.monotonic()
        self.origin.publish(snapshot, version, self.scratch)
        self.published.append((time.time(), version))
        self.status.set(version=version)
        self.status.add(versions_published=1, publish_seconds=time.monotonic() - started)

    def _raise_failures(self) -> None:
        done = [f for f in self._pending if f.done()]
        for future in done:
            future.result()
        self._pending = [f for f in self._pending if not f.done()]
