"""The pool as a rollout source: step n's batch from the orchestrator's accepted rollouts.

``next_batch(n, v)`` leases accepted submissions from the orchestrator (``/batches``:
versions ≥ n − async_level), splits them into per-task groups (G completions each)
with every reward recomputed by the environment (:func:`swarmrl.trainer.source.
submission_groups`: the worker's word is never used), keeps the informative groups (the one
online-filter rule, :func:`swarmrl.rl.is_informative`), and waits, bounded by
``swarm.batch_timeout_s``, until ``rl.prompts_per_step`` groups are there. Surplus informative
groups carry over to the next step while still fresh enough. ``commit(n, v')`` hands the new
version to the role's ``announce`` (publish through the origin, tell the orchestrator) and then
acknowledges (``/batches/ack``) every submission the committed step used up: all its groups
trained, filtered out, or dropped as too stale to carry. Unacknowledged submissions return to
the orchestrator's queue when their lease runs out (``swarmrl.pool.batches``), so a trainer
that dies mid-step loses no rollout; a submission served again while still held is used once.

Why it lives in the trainer role and not in the learning library (``swarmrl.trainer``): it
needs the pool client (``swarmrl.pool``, a sibling of ``swarmrl.trainer`` on the subsystem
floor, which the learning library may not import) and the roles' bounded retry
(``swarmrl.rolekit``, a floor above). What it does with the rollouts — regrouping, rescoring,
the filter — is the learning library's code, shared with the colocated source.

Knows nothing about the optimizer, proofs or how rollouts were produced.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment
from swarmrl.errors import WaitTimeout
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import TrainableSubmission
from swarmrl.rl import is_informative
from swarmrl.rolekit.toolkit import StatusReporter, retry
from swarmrl.trainer.batch import Group
from swarmrl.trainer.source import StepRollouts, group_version, submission_groups

NOTE_EVERY_S = 30.0  # how often a long wait for rollouts is logged
POLL_S = 0.2  # pause between empty answers from /batches


class PoolSource:
    """Step batches from the orchestrator; each new version announced (module docstring)."""

    def __init__(
        self,
        pool: PoolClient,
        pool_id: str,
        env: Environment,
        tokenizer: PreTrainedTokenizerBase,
        config: SwarmConfig,
        log: logging.Logger,
        status: StatusReporter,
        announce: Callable[[int], None],
    ) -> None:
        self.pool, self.pool_id, self.env, self.tokenizer = pool, pool_id, env, tokenizer
        self.config, self.log, self.status, self.announce = config, log, status, announce
        self.holder = uuid.uuid4().hex  # this process's batch leases
        self.carry: list[tuple[str, Group]] = []  # (submission id, informative group) kept over
        self.consumed: list[str] = []  # ids of every submission acknowledged, in order
        self.announced = 0  # version 0 is announced by the role before the loop starts
        self._outstanding: dict[str, int] = {}  # submission id → groups not yet used up
        self._finished: list[str] = []  # used up; acknowledged once the step commits
        self._served: set[str] = set()

    def next_batch(self, step: int, policy_version: int) -> StepRollouts:
        """Step ``step``'s groups; raises WaitTimeout when the pool stays starved."""
        rl, swarm = self.config.rl, self.config.swarm
        need, oldest = rl.prompts_per_step, step - rl.async_level
        self.status.set(state=f"waiting for step {step} rollouts")
        kept: list[tuple[str, Group]] = []
        for sid, group in self.carry:
            if group_version(group) >= oldest:
                kept.append((sid, group))
            else:
                self._used(sid)
        seen: list[Group] = []
        start = time.monotonic()
        next_note = start + NOTE_EVERY_S
        while len(kept) < need:
            for sub in self._take(step):
                self._split(sub, kept, seen)
            if len(kept) >= need:
                break
            waited = time.monotonic() - start
            if waited > swarm.batch_timeout_s:
                raise WaitTimeout(
                    f"step {step}: {len(kept)}/{need} informative groups after "
                    f"{waited:.0f} s waiting for accepted rollouts with version ≥ {oldest}"
                )
            if time.monotonic() > next_note:
                note = "step %d: %d/%d groups; waiting for accepted rollouts"
                self.log.info(note, step, len(kept), need)
                next_note += NOTE_EVERY_S
            time.sleep(POLL_S)
        self.carry = kept[need:]
        for sid, _ in kept[:need]:
            self._used(sid)
        self.status.set(state=f"training step {step}")
        return StepRollouts(groups=[g for _, g in kept[:need]], seen=seen)

    def commit(self, step: int, policy_version: int) -> None:
        """Step ``step`` is trained: publish and announce the new version, then acknowledge
        the submissions it used up."""
        if policy_version != self.announced:
            self.announce(policy_version)
            self.announced = policy_version
        if self._finished:
            done, swarm = list(self._finished), self.config.swarm
            retry(
                lambda: self.pool.ack_batch(self.pool_id, done),
                f"acknowledge the {len(done)} submissions step {step} used",
                self.log,
                give_up_s=swarm.give_up_s,
                pause_s=swarm.retry_s,
            )
            self.consumed += done
            self._finished = self._finished[len(done) :]

    def _split(
        self, sub: TrainableSubmission, kept: list[tuple[str, Group]], seen: list[Group]
    ) -> None:
        """Regroup one served submission; filtered-out groups are used up at once."""
        sid, rl = sub.submission_id, self.config.rl
        if sid in self._served:
            return  # served again after its lease ran out while we still held it
        self._served.add(sid)
        groups = submission_groups(sub, self.env, self.tokenizer, rl.group_size)
        self._outstanding[sid] = len(groups) + 1  # + 1 so that a group-less one finishes too
        for group in groups:
            seen.append(group)
            if not rl.online_filter or is_informative(group.rewards):
                kept.append((sid, group))
            else:
                self._used(sid)
        self._used(sid)

    def _used(self, submission_id: str) -> None:
        self._outstanding[submission_id] -= 1
        if self._outstanding[submission_id] == 0:
            del self._outstanding[submission_id]
            self._finished.append(submission_id)

    def state(self) -> dict[str, Any]:
        """Where this source is in the rollout stream, for a checkpoint taken after a commit:
        the groups held over, the submissions not yet used up (unacknowledged: the pool serves
        them again once their lease runs out, and ``served`` makes sure they are used once),
        and the acknowledged ones."""
        return {
            "carry": list(self.carry),
            "consumed": list(self.consumed),
            "outstanding": dict(self._outstanding),
            "finished": list(self._finished),
            "served": sorted(self._served),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.carry, self.consumed = list(state["carry"]), list(state["consumed"])
        self._outstanding = dict(state["outstanding"])
        self._finished = list(state["finished"])
        self._served = set(state["served"])

    def _take(self, step: int) -> list[TrainableSubmission]:
        """One answer of ``/batches`` for ``step``, leased to this process."""
        swarm = self.config.swarm
        reply = retry(
            lambda: self.pool.batch(self.pool_id, step, 64, self.holder),
            f"fetch accepted rollouts for step {step}",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
        )
        return reply.submissions
