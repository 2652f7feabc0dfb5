"""The untrusted inference node: join a pool, follow policy versions, lease, generate, submit.

Three loops run side by side:

- weights (thread): downloads each new policy version as soon as it is announced, while
  generation goes on with the version already loaded (``swarmrl.roles.worker.versions``);
- heartbeat (thread): tells the orchestrator the node is alive and which version it holds;
  learns from a ``NodeBanned`` refusal (or the reply) when the node has been banned, and from a
  ``NotMember`` one that it was ejected for silence (it then rejoins;
  ``swarmrl.roles.worker.membership``);
- work (main thread): leases a work unit, switches to the newest downloaded version between
  units, generates all samples with proofs, and submits them signed, asking for the next unit
  while the submission is on its way (``swarm.lease_ahead``, ``swarmrl.roles.worker.leases``).

Every call to a peer is retried with a bounded, logged wait (``swarmrl.rolekit.toolkit``). A
refusal from the orchestrator (stale version, expired lease) drops that unit and goes on; a
``NotMember`` refusal (the node went silent long enough to be declared dead or ejected) rejoins
with the node's own key, no invite (``swarmrl.pool.trust.joins``), pausing longer after each failed
attempt, and logs the ejection once; ``NodeBanned`` stops the node
with exit status 3. A lease
answered ``wait`` (admission control: the trainer has enough) pauses for the reply's
``retry_after_s``, logging each kind of reason at most once a minute; ``finished`` (the trainer
finished the run), in a lease's answer or a heartbeat's, stops the node with exit status 0:
a wait for a version ends at once, a unit in hand is still handed in. Refusals
are told apart by their type (``swarmrl.errors``), never by their message.

Knows nothing about training or validation; it only produces rollouts and proofs.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarmrl.config import SwarmConfig
from swarmrl.config.swarm import cheat_after, cheat_kind
from swarmrl.envs import build_env
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.errors import (
    HarnessFailed,
    NodeBanned,
    NotMember,
    PeerError,
    StaleWork,
    WaitTimeout,
)
from swarmrl.identity import KeyPair
from swarmrl.inference.types import Generation
from swarmrl.model.io import load_policy
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, Invite, Sample, Submission, WorkUnit, reason_kind
from swarmrl.rolekit.policy import LoadedVersion, load_version, swap_version
from swarmrl.rolekit.supervisor import EXIT_BANNED
from swarmrl.rolekit.toolkit import StatusReporter, retry, wait_for
from swarmrl.roles.worker.forged import forger_for
from swarmrl.roles.worker.leases import LeaseAhead
from swarmrl.roles.worker.membership import Membership
from swarmrl.roles.worker.rollouts import corrupt_weights, generate_samples
from swarmrl.roles.worker.versions import VersionFollower
from swarmrl.shardcast import WeightClient
from swarmrl.toploc.bundle import build_bundles

WAIT_LOG_EVERY_S = 60.0  # a worker told to wait logs it at most this often per kind of reason
STALE_RETRY_MARGIN_S = 1.0  # a stale unit is generated again only with this much lease left
DOWNLOAD_NOTE_S = 0.5  # longest block while waiting for a version, between checks for a stop


@dataclass
class WorkerSettings:
    """Where the node finds its peers and keeps its files."""

    orchestrator: str
    pool_id: str
    weight_sources: list[str]
    publisher_key: str
    work_dir: Path
    invite: Invite | None = None


class WorkerNode:
    """One inference node (see module docstring)."""

    def __init__(
        self,
        config: SwarmConfig,
        settings: WorkerSettings,
        keypair: KeyPair,
        status: StatusReporter,
        log: logging.Logger,
    ) -> None:
        self.config = config
        self.settings = settings
        self.keypair = keypair
        self.status = status
        self.log = log
        self.env = build_env(config.env, scores=False)  # workers never run completions' code
        self.pool = PoolClient(settings.orchestrator, keypair, config.swarm.peer_timeout_s)
        self.weights = WeightClient(
            settings.weight_sources,
            settings.publisher_key,
            settings.work_dir / "weights",
            config.shardcast,
            client_id=keypair.node_id[:12],
        )
        self.stop = threading.Event()
        self.banned = threading.Event()
        self.finished = threading.Event()  # the orchestrator said the run is over
        self._wait_logged: dict[str, float] = {}  # kind of wait → when last logged
        self.versions = VersionFollower(self.weights, config.swarm, status, log, self.stop)
        self.policy: LoadedVersion | None = None
        self.tokens_per_s: float | None = None
        self.submitted = 0
        self.units_by_version: dict[int, int] = {}
        self.membership = Membership(
            self.pool,
            settings.pool_id,
            settings.invite,
            config,
            status,
            log,
            self.stop,
            banned=self._banned_by_pool,
            beat=self._beat,
            finished=self._finished_by_pool,
        )
        self.ahead = LeaseAhead(lambda: self.pool.lease(self.settings.pool_id), log)
        self.cheat_after = cheat_after(config.swarm.cheat)
        forges = cheat_kind(config.swarm.cheat) == "forge_env_after"  # TEST-ONLY
        self._forger = forger_for(config.env, self.env, config.swarm.cheat) if forges else None
        self.cheating = False  # the test-only misbehaviour has started
        self._tokenizer_dir: tempfile.TemporaryDirectory | None = None  # harness tasks' renderer
        self.corrupted = False  # generating with corrupted weights

    # -- weights --------------------------------------------------------------------------
    def _take_newest(self) -> None:
        """Switch the engine to the newest downloaded version, if it is newer."""
        ready = self.versions.newest()
        if ready is None or (self.policy is not None and ready[0] <= self.policy.version):
            return
        version, path = ready
        if self.policy is None:
            self.policy = load_version(
                path, version, inference=self.config.inference, dtype=self.config.engine_dtype
            )
            self.log.info("engine: %s", self.policy.engine.describe())
        else:
            swap_version(self.policy, path, version)
        if self.corrupted:
            self._corrupt()
        self.status.set(version=version)
        self.log.info("generating with policy v%d", version)

    def _corrupt(self) -> None:
        """TEST-ONLY misbehaviour: generate with tampered weights from now on."""
        assert self.policy is not None
        model, _ = load_policy(str(self.policy.path))
        state = corrupt_weights(model.state_dict(), seed=self.policy.version)
        self.policy.engine.load_state_dict(state)

    def _beat(self) -> Heartbeat:
        return Heartbeat(
            status="ok",
            model_version=self.policy.version if self.policy else None,
            tokens_per_s=self.tokens_per_s,
        )

    # -- work -----------------------------------------------------------------------------
    def _prove(self, generations: list[Generation], params: SamplingParams) -> list[dict]:
        assert self.policy is not None
        bundles = build_bundles(
            generations,
            keypair=self.keypair,
            policy_version=self.policy.version,
            model_digest=self.policy.root_digest,
            params=params,
            chunk_size=self.config.toploc.chunk_size,
            topk=self.config.toploc.topk,
        )
        return [b.model_dump(mode="json") for b in bundles]

    def _pace(self) -> None:
        """After ``units_per_version`` units on one version, wait briefly for a newer one.

        Rollouts far ahead of the trainer only grow stale; the bounded wait keeps a slow
        trainer from ever stalling the node.
        """
        swarm = self.config.swarm
        assert self.policy is not None
        if not swarm.units_per_version:
            return
        if self.units_by_version.get(self.policy.version, 0) < swarm.units_per_version:
            return
        self.status.set(state=f"paced: {swarm.units_per_version} units on v{self.policy.version}")
        deadline = time.monotonic() + swarm.version_wait_s
        while time.monotonic() < deadline and not self._stopping():
            if self.versions.newer_than(self.policy.version):
                break
            self.stop.wait(0.1)
        self._take_newest()

    def _work_once(self) -> None:
        swarm = self.config.swarm
        self._take_newest()
        self._pace()
        if self._stopping():  # the run finished (a heartbeat said so) after the last unit
            return
        reply = self.ahead.take() or retry(
            lambda: self.pool.lease(self.settings.pool_id),
            "lease work",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
            stop=self.stop,
        )
        if reply.outcome == "finished":
            said = reply.reason or ""  # the pool's own words, where they add to "finished"
            self._finished_by_pool(
                f"lease reply: {said}" if "finished" not in said else "lease reply"
            )
            self.stop.set()
            return
        if reply.work is None:
            self._wait(reply.reason or "no work", reply.retry_after_s)
            return
        work: WorkUnit = reply.work
        assert self.policy is not None
        if self.policy.version < work.min_version:
            self._wait_for_version(work.min_version, swarm.give_up_s)
        while True:
            used = self._answer(work)
            if used is None:
                return
            # stale: the trainer moved on while this unit was generated; the lease is still
            # ours, so the unit is generated again on a newer version (the pool's next policy
            # is announced within moments) while its deadline allows
            # the deadline is in the orchestrator's time, and this machine's clock may be off
            left_s = work.deadline - self.pool.server_time() - STALE_RETRY_MARGIN_S
            if left_s <= 0 or self.stop.is_set():
                self.log.warning("lease %s ran out after a stale submission", work.lease_id[:8])
                return
            try:
                self._wait_for_version(used + 1, left_s)
            except WaitTimeout:
                if self.stop.is_set():
                    raise
                self.log.warning("no newer policy before lease %s ran out", work.lease_id[:8])
                return

    def _wait_for_version(self, version: int, timeout_s: float) -> None:
        """Until policy ``version`` (or newer) is downloaded and loaded, at most ``timeout_s``
        (:class:`WaitTimeout`)."""
        self.status.set(state=f"waiting for v{version}")

        def caught_up() -> bool | None:
            self.versions.wait(version, DOWNLOAD_NOTE_S)  # woken by the download, not a poll
            self._take_newest()
            assert self.policy is not None
            if self.policy.version >= version:
                return True
            self._stopping()  # a finished trainer may never publish it
            return None

        wait_for(
            caught_up,
            f"policy v{version} to download",
            self.log,
            timeout_s=timeout_s,
            pause_s=0.0,
            stop=self.stop,
        )

    def _answer(self, work: WorkUnit) -> int | None:
        """Generate ``work`` on the current policy and submit it. Returns the policy version
        used where the pool refused the samples as stale (:class:`StaleWork`: the lease is
        still open), else None (submitted, or refused for good)."""
        swarm = self.config.swarm
        assert self.policy is not None
        self.status.set(state="generating")
        start = time.perf_counter()
        self._cheat_when_due()
        try:
            samples = self._generate(work)
        except HarnessFailed as exc:  # the harness program failed on this unit: not submitted
            self.log.warning("%s; the unit is left to expire", exc)
            self.status.add(refused=1)
            return None
        seconds = time.perf_counter() - start
        tokens = sum(len(s.output_tokens) for s in samples)
        used = min(s.policy_version for s in samples)
        self.tokens_per_s = tokens / max(seconds, 1e-6)
        self.status.set(state="submitting", tokens_per_s=self.tokens_per_s)
        if self._asks_ahead():
            self.ahead.start()
        try:
            receipt = retry(
                lambda: self.pool.submit(
                    self.settings.pool_id, Submission(lease_id=work.lease_id, samples=samples)
                ),
                "submit rollouts",
                self.log,
                give_up_s=swarm.give_up_s,
                pause_s=swarm.retry_s,
                stop=self.stop,
            )
        except (NodeBanned, NotMember):
            raise  # not a member any more: handled by _work_until_stopped and run
        except StaleWork as exc:
            self.log.info("submission stale, generating it again on a newer policy: %s", exc)
            self.status.add(stale=1)
            return used
        except PeerError as exc:  # the pool refused it (expired lease, broken rule...)
            self.log.warning("submission refused: %s", exc)
            self.status.add(refused=1)
            return None
        self.submitted += 1
        self.units_by_version[used] = self.units_by_version.get(used, 0) + 1
        self.status.add(submitted=1, rollouts=len(samples), tokens=tokens)
        self.log.info(
            "submitted %d samples (v%d, %.0f tok/s): %s",
            len(samples),
            self.policy.version,
            self.tokens_per_s,
            receipt.status,
        )
        return None

    def _asks_ahead(self) -> bool:
        """Whether to ask for the next unit beside this submission: where asking ahead is on
        and the next unit would not wait for a newer version first (:meth:`_pace`: the unit
        would hold its lease idle)."""
        swarm = self.config.swarm
        assert self.policy is not None
        if not swarm.lease_ahead or self.stop.is_set() or self.finished.is_set():
            return False
        done = self.units_by_version.get(self.policy.version, 0) + 1  # this one included
        return not swarm.units_per_version or done < swarm.units_per_version

    def _cheat_when_due(self) -> None:
        """TEST-ONLY: start the configured misbehaviour once ``cheat_after`` units were
        submitted (0: from the first unit)."""
        if self.cheat_after is None or self.cheating or self.submitted < self.cheat_after:
            return
        self.cheating = True
        if self._forger is not None:
            self.log.warning("TEST-ONLY cheat: forging the environment's turns from now on")
            self.env = self._forger
        else:
            self.log.warning("TEST-ONLY cheat: generating with corrupted weights from now on")
            self.corrupted = True
            self._corrupt()

    def _generate(self, work: WorkUnit) -> list[Sample]:
        """The samples of ``work`` on the current policy: completions, or episodes."""
        policy = self.policy
        assert policy is not None
        if isinstance(self.env, VerifiersV1Env) and self._tokenizer_dir is None:
            # the harness's renderer loads the tokenizer from a directory
            self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="swarmrl-worker-")
            policy.tokenizer.save_pretrained(self._tokenizer_dir.name)
        saved = self._tokenizer_dir.name if self._tokenizer_dir is not None else None
        return generate_samples(
            policy.engine, self.env, policy.tokenizer, work, policy.version, self._prove, saved
        )

    def _wait(self, reason: str, retry_after_s: float) -> None:
        """Told to wait: one log line per kind of reason (``reason_kind``) and minute (not
        per retry), then the bounded pause."""
        kind, now = reason_kind(reason), time.monotonic()
        if now - self._wait_logged.get(kind, -WAIT_LOG_EVERY_S) >= WAIT_LOG_EVERY_S:
            self.log.info("no work for now (%s); asking again every %.1f s", reason, retry_after_s)
            self._wait_logged[kind] = now
        self.status.set(state=f"idle: {reason}")
        self.status.add(waits=1)
        self.stop.wait(min(max(retry_after_s, 0.2), 5.0))

    def run(self) -> int:
        """Work until stopped or banned; returns the process exit status (3: banned)."""
        try:
            self._start()
            self._work_until_stopped()
        except NodeBanned as exc:
            self._banned_by_pool(exc)
        except WaitTimeout:
            if not self.stop.is_set():
                raise
        finally:
            self.stop.set()
            self.pool.close()
            self.weights.close()
            if self.policy is not None:
                self.policy.engine.close()
        if self.banned.is_set():
            self.status.set(state="banned")
            self.status.flush()  # before exiting, so a supervisor sees why
            return EXIT_BANNED
        if self.finished.is_set():
            self.status.set(state="done: the run is finished")
            self.status.flush()
        return 0

    def _start(self) -> None:
        """Join, start the weights and heartbeat threads, wait for the first version."""
        self.status.set(state="joining")
        self.membership.join()
        threads = [
            threading.Thread(target=self.versions.run, name="weights", daemon=True),
            threading.Thread(target=self.membership.heartbeats, name="heartbeat", daemon=True),
        ]
        for thread in threads:
            thread.start()
        self.status.set(state="waiting for weights")
        wait_for(
            lambda: None if self._stopping() else self.versions.newest(),
            "the first policy version from the weight sources",
            self.log,
            timeout_s=self.config.swarm.first_version_timeout_s,
            stop=self.stop,
        )

    def _work_until_stopped(self) -> None:
        """Work units one after another; a refusal drops the unit, an ejection rejoins. Raises
        NodeBanned, and the refusal of a rejoin (the pool no longer knows the node)."""
        while not self.stop.is_set():
            try:
                self._work_once()
            except NodeBanned:
                raise
            except NotMember as exc:  # declared dead or ejected for silence
                self.membership.rejoin(exc)
            except PeerError as exc:  # only the pool client raises it here
                self.log.warning("orchestrator refused: %s", exc)
                self.stop.wait(self.config.swarm.retry_s)

    def _finished_by_pool(self, reason: str = "heartbeat reply") -> None:
        """The trainer finished the run: the node stops with exit status 0, once it has handed
        in the unit it holds (a submission on its way is not dropped), and every wait for a
        version ends at once (:meth:`_stopping`)."""
        if not self.finished.is_set():
            self.log.info("the run is finished (%s); stopping", reason)
        self.finished.set()

    def _stopping(self) -> bool:
        """Whether the node stops: it was told to, or the run is finished (which stops it, so
        every wait ends)."""
        if self.finished.is_set():
            self.stop.set()
        return self.stop.is_set()

    def _banned_by_pool(self, reason: object) -> None:
        """Stop everything: the pool will never accept this node again."""
        self.log.error("the orchestrator banned this node (%s); stopping", reason)
        self.status.event("banned by the orchestrator")
        self.banned.set()
        self.stop.set()
