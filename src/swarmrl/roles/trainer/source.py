"""The pool as a rollout source: step n's batch from the orchestrator's accepted rollouts.

``next_batch(n, v)`` leases accepted submissions from the orchestrator (``/batches``:
versions ≥ n − async_level), splits them into per-task groups (G completions each)
with every reward recomputed by the environment (:func:`swarmrl.trainer.source.
submission_groups`: the worker's word is never used), keeps the informative groups (the one
online-filter rule, :func:`swarmrl.rl.is_informative`), and waits, bounded by
``swarm.batch_timeout_s``, until ``rl.prompts_per_step`` groups are there. Each request asks
for about what the step still lacks (the shortfall divided by the share of recent groups the
filter kept, :func:`swarmrl.trainer.source.tasks_to_ask`): what no step needs yet stays queued
at the orchestrator, where admission control counts it and older work is served first. Surplus
informative groups carry over to the next step while still fresh enough. Once step n has its groups, a
prefetch thread leases step n + 1's rollouts while step n trains, so a step finds its batch
ready whenever the pool has the work. ``commit(n, v')`` hands the new version to the role's
``announce`` (which publishes through the origin and tells the orchestrator in the background;
it is told when the step is the run's last: the trainer role then tells the orchestrator the
run is finished, once that step is checkpointed) and then acknowledges
(``/batches/ack``) every submission the committed step used up: all its groups trained,
filtered out, or dropped as too stale to carry. A submission none of whose groups is trained
(all filtered out or stale) is acknowledged as soon as it is used up, so the orchestrator's
admission control (``swarmrl.pool.flow.admission``) does not count it as work the trainer holds. Unacknowledged submissions return to
the orchestrator's queue when their lease runs out (``swarmrl.pool.flow.batches``), so a trainer
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
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment
from swarmrl.errors import ForgedEpisode, HarnessTimedOut, InfraError, PeerError, WaitTimeout
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.batches import TrainableSubmission
from swarmrl.rl import is_informative
from swarmrl.rolekit.toolkit import StatusReporter, retry
from swarmrl.roles.trainer.acks import Acknowledger
from swarmrl.trainer.batch import Group
from swarmrl.trainer.source import (
    Feed,
    StepRollouts,
    group_version,
    held_through,
    submission_groups,
    tasks_to_ask,
)

NOTE_EVERY_S = 30.0  # how often a long wait for rollouts is logged
FILTER_MEMORY = 256  # groups whose filter outcome sizes the next request (tasks_to_ask)
POLL_S = 0.2  # pause between empty answers from /batches
# a step waiting for its batch asks the orchestrator to hold an empty answer this long and
# answer as soon as work arrives (``swarmrl.pool.web.waits``); the prefetch, which a step's start
# stops and joins, does not wait there
HOLD_S = 2.0
T = TypeVar("T")


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
        announce: Callable[[int, bool], None],
        acks: PoolClient | None = None,
    ) -> None:
        """``acks``: a client of its own for the acknowledgements, which are then posted
        off the step's path (``swarmrl.roles.trainer.acks``); None: posted in line."""
        self.pool, self.pool_id, self.env, self.tokenizer = pool, pool_id, env, tokenizer
        self.config, self.log, self.status, self.announce = config, log, status, announce
        self.holder = uuid.uuid4().hex  # this process's batch leases
        self.carry: list[tuple[str, Group]] = []  # (submission id, informative group) kept over
        self.consumed: list[str] = []  # ids of every submission acknowledged, in order
        self.acks: list[tuple[float, int]] = []  # (Unix s, submissions) of each acknowledgement
        self.announced = 0  # version 0 is announced by the role before the loop starts
        self._outstanding: dict[str, int] = {}  # submission id → groups not yet used up
        self._finished: list[str] = []  # used up, not yet acknowledged
        self._in_step: set[str] = set()  # with a group in the step not yet committed
        self._served: set[str] = set()
        # submissions with a group trained or filtered out; one used up without either (every
        # group dropped as too stale to carry) goes to ``stale_dropped``: acknowledged, so the
        # pool counts it trained, yet nothing of it was
        self._useful: set[str] = set()
        self.stale_dropped: list[str] = []
        # submissions whose episodes differ from the trusted recomputation: never trained
        self.forged: list[str] = []
        # informative groups held over that went too stale before a step took them (their
        # submission counts as trained when another of its groups was)
        self.stale_groups = 0
        # the prefetch thread and the loop share the fields above and the client
        self._lock = threading.RLock()
        self._client_lock = threading.Lock()
        self._seen_ahead: list[Group] = []  # groups the prefetch drew for the next step
        # whether each recently drawn group passed the online filter: a request asks for what
        # a step lacks divided by that share, so the pool keeps what no step needs yet
        self._informative: deque[bool] = deque(maxlen=FILTER_MEMORY)
        self._prefetch: tuple[threading.Thread, threading.Event] | None = None
        self.told_through = -1  # the last step told to the pool as held ahead (set_progress)
        # policy version minus step: 0 unless a restarted trainer published its weights under a
        # new number (``swarmrl.roles.trainer.process.continue_versions``). The pool counts a
        # batch's step in versions (step n trains version n and takes versions ≥ n −
        # async_level), so every step this source names to the pool is ``step + version_offset``
        self.version_offset = 0
        self._acker = (
            None
            if acks is None
            else Acknowledger(
                lambda ids: acks.ack_batch(pool_id, ids),
                self._acknowledged,
                log,
                give_up_s=config.swarm.give_up_s,
                pause_s=config.swarm.retry_s,
            )
        )

    def next_batch(self, step: int, policy_version: int, early: Feed | None = None) -> StepRollouts:
        """Step ``step``'s groups; raises WaitTimeout when the pool stays starved. What the
        prefetch gathered while the previous step trained is used first; once this step has
        its groups, the prefetch for the next one starts. Whenever the step must wait for
        more, ``early`` gets the groups it holds that it was not handed yet."""
        rl, swarm = self.config.rl, self.config.swarm
        need, oldest = rl.prompts_per_step, self._at(step) - rl.async_level
        self._stop_prefetch()
        self.status.set(state=f"waiting for step {step} rollouts")
        with self._lock:
            kept: list[tuple[str, Group]] = []
            for sid, group in self.carry:
                if group_version(group) >= oldest:
                    kept.append((sid, group))
                else:
                    self.stale_groups += 1
                    self._used(sid)
            seen, self._seen_ahead = self._seen_ahead, []
        start = time.monotonic()
        next_note = start + NOTE_EVERY_S
        fed = 0
        while len(kept) < need:
            if early is not None and fed < len(kept):  # computed while the rest is awaited
                early([g for _, g in kept[fed:]])
                fed = len(kept)
            asked = time.monotonic()
            served = self._take(self._at(step), need - len(kept), wait_s=HOLD_S)
            with self._lock:
                for sub in served:
                    self._split(sub, kept, seen)
            self._acknowledge(self._claim_unused(), f"step {step}'s filtered-out rollouts")
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
            if not served and time.monotonic() - asked < POLL_S:  # not held: do not spin
                time.sleep(POLL_S)
        with self._lock:
            self.carry = kept[need:]
            self._in_step = {sid for sid, _ in kept[:need]}
            self._useful |= self._in_step
            for sid, _ in kept[:need]:
                self._used(sid)
        if step + 1 < rl.steps:
            self._start_prefetch(self._at(step + 1))
        else:  # the last step: the pool leases nothing more (the prefetch may have told it)
            self._tell_held(self._at(step), [group_version(g) for _, g in kept])
        self.status.set(state=f"training step {step}")
        return StepRollouts(groups=[g for _, g in kept[:need]], seen=seen)

    def commit(self, step: int, policy_version: int) -> None:
        """Step ``step`` is trained: hand the new version to ``announce`` (which publishes it
        in the background; ``final`` tells it the step is the run's last), then acknowledge the
        submissions the step used up."""
        final = step + 1 >= self.config.rl.steps
        if policy_version != self.announced or final:
            self.announce(policy_version, final)
            self.announced = policy_version
        with self._lock:
            self._in_step = set()
            done, self._finished = self._finished, []
        self._acknowledge(done, f"the submissions step {step} used")
        if final and self._acker is not None:  # the run's end is told after its last acks
            self._acker.flush()

    def _claim_unused(self) -> list[str]:
        """Take the used-up submissions none of whose groups is in the uncommitted step (all
        filtered out or dropped as stale): they can be acknowledged at once, so the pool does
        not count them as rollouts the trainer still holds."""
        with self._lock:
            ready = [sid for sid in self._finished if sid not in self._in_step]
            self._finished = [sid for sid in self._finished if sid in self._in_step]
        return ready

    def _acknowledge(self, ids: list[str], what: str) -> None:
        if not ids:
            return
        if self._acker is not None:
            self._acker.send(ids, what)
            return
        swarm = self.config.swarm
        retry(
            lambda: self._call(lambda: self.pool.ack_batch(self.pool_id, ids)),
            f"acknowledge {what} ({len(ids)})",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
        )
        self._acknowledged(ids)

    def _acknowledged(self, ids: list[str]) -> None:
        with self._lock:
            self.consumed += ids
            self.acks.append((time.time(), len(ids)))

    def close(self) -> None:
        """Stop the prefetch (what it holds stays leased and returns to the pool in time) and
        post the acknowledgements still queued."""
        self._stop_prefetch()
        if self._acker is not None:
            self._acker.close(self.config.swarm.peer_timeout_s + 5.0)

    def _start_prefetch(self, step: int) -> None:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._prefetch_loop, args=(step, stop), name="prefetch", daemon=True
        )
        self._prefetch = (thread, stop)
        thread.start()

    def _stop_prefetch(self) -> None:
        if self._prefetch is None:
            return
        thread, stop = self._prefetch
        stop.set()
        thread.join(self.config.swarm.peer_timeout_s + 5.0)
        self._prefetch = None

    def _at(self, step: int) -> int:
        """The loop's ``step`` as the pool counts it: the version it trains (``version_offset``)."""
        return step + self.version_offset

    def _prefetch_loop(self, step: int, stop: threading.Event) -> None:
        """While step ``step − 1`` trains: lease ``step``'s rollouts until enough informative
        groups are held (into ``carry``). ``step`` as the pool counts it (:meth:`_at`). A
        failure is logged; ``next_batch`` then fetches again itself and raises if the pool
        stays unreachable."""
        rl = self.config.rl
        oldest = step - rl.async_level
        try:
            while not stop.is_set():
                with self._lock:
                    versions = [group_version(g) for _, g in self.carry]
                fresh = sum(v >= oldest for v in versions)
                if fresh >= rl.prompts_per_step:
                    self._tell_held(step, versions)
                    return
                served = self._take(step, rl.prompts_per_step - fresh, stop)
                with self._lock:
                    for sub in served:
                        self._split(sub, self.carry, self._seen_ahead)
                self._acknowledge(self._claim_unused(), f"step {step}'s filtered-out rollouts")
                if not served:
                    stop.wait(POLL_S)
        except (InfraError, PeerError, WaitTimeout) as exc:
            self.log.warning("prefetching step %d's rollouts failed: %s", step, exc)

    def _tell_held(self, step: int, versions: list[int]) -> None:
        """Step ``step``'s batch is held: when the groups held also fill later steps' batches,
        or ``step`` is the run's last, tell the pool the last step held (never past the run's
        last), so that it leases no work only those steps could train, or none at all
        (``swarmrl.pool.flow.admission``, "Batches held ahead"). Steps as the pool counts them
        (:meth:`_at`). One try: the pool leasing a little more without it is the worst a lost
        message costs."""
        rl = self.config.rl
        last = self._at(rl.steps - 1)
        through = min(held_through(step, versions, rl.prompts_per_step, rl.async_level), last)
        if through <= self.told_through or (through <= step and through != last):
            return
        try:
            self._call(lambda: self.pool.set_progress(self.pool_id, through))
        except (InfraError, PeerError) as exc:
            self.log.warning(
                "telling the pool the batches held up to step %d failed: %s", through, exc
            )
            return
        self.told_through = through

    def _split(
        self, sub: TrainableSubmission, kept: list[tuple[str, Group]], seen: list[Group]
    ) -> None:
        """Regroup one served submission; filtered-out groups are used up at once."""
        sid, rl = sub.submission_id, self.config.rl
        if sid in self._served:
            return  # served again after its lease ran out while we still held it
        self._served.add(sid)
        try:
            groups = submission_groups(
                sub, self.env, self.tokenizer, rl.group_size, rl.sampling.max_new_tokens
            )
        except ForgedEpisode as exc:  # unchecked work a passed check released: not trained
            self.log.warning("submission %s is not trained: %s", sid, exc)
            self.forged.append(sid)
            groups = []
        except HarnessTimedOut as exc:  # its harness could not be replayed here: not trained
            self.log.warning("submission %s is not trained: %s", sid, exc)
            groups = []
        self._outstanding[sid] = len(groups) + 1  # + 1 so that a group-less one finishes too
        for group in groups:
            seen.append(group)
            informative = not rl.online_filter or is_informative(group.rewards)
            self._informative.append(informative)
            if informative:
                kept.append((sid, group))
            else:
                self._useful.add(sid)
                self._used(sid)
        self._used(sid)

    def _used(self, submission_id: str) -> None:
        self._outstanding[submission_id] -= 1
        if self._outstanding[submission_id] == 0:
            del self._outstanding[submission_id]
            self._finished.append(submission_id)
            if submission_id in self._useful:
                self._useful.discard(submission_id)
            elif submission_id not in self.forged:
                self.stale_dropped.append(submission_id)

    def state(self) -> dict[str, Any]:
        """Where this source is in the rollout stream, for a checkpoint taken after a commit:
        the groups held over, the submissions not yet used up (unacknowledged: the pool serves
        them again once their lease runs out, and ``served`` makes sure they are used once),
        and the acknowledged ones."""
        with self._lock:
            return self._state()

    def _state(self) -> dict[str, Any]:
        return {
            "carry": list(self.carry),
            "consumed": list(self.consumed),
            "outstanding": dict(self._outstanding),
            # sent for acknowledgement and not yet acknowledged: acknowledged again on resume
            "finished": [*self._finished, *(self._acker.pending() if self._acker else [])],
            "served": sorted(self._served),
            "useful": sorted(self._useful),
            "stale_dropped": list(self.stale_dropped),
            "forged": list(self.forged),
            "stale_groups": self.stale_groups,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.carry, self.consumed = list(state["carry"]), list(state["consumed"])
        self._outstanding = dict(state["outstanding"])
        self._finished = list(state["finished"])
        self._served = set(state["served"])
        self._useful = set(state.get("useful", ()))  # absent in older checkpoints
        self.stale_dropped = list(state.get("stale_dropped", ()))
        self.forged = list(state.get("forged", ()))
        self.stale_groups = int(state.get("stale_groups", 0))

    def _take(
        self, step: int, short: int, stop: threading.Event | None = None, wait_s: float = 0.0
    ) -> list[TrainableSubmission]:
        """One answer of ``/batches`` for ``step``, leased to this process: about enough tasks
        for ``short`` more informative groups (:func:`tasks_to_ask`); ``wait_s``: how long the
        orchestrator may hold an empty answer until work arrives."""
        swarm = self.config.swarm
        with self._lock:
            tasks = tasks_to_ask(short, self._informative)
        reply = retry(
            lambda: self._call(
                lambda: self.pool.batch(
                    self.pool_id, step, 64, self.holder, wait_s=wait_s, max_tasks=tasks
                )
            ),
            f"fetch accepted rollouts for step {step}",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
            stop=stop,
        )
        return reply.submissions

    def _call(self, request: Callable[[], T]) -> T:
        """One request on the shared client (the prefetch thread and the loop take turns)."""
        with self._client_lock:
            return request()
