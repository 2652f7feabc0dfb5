"""The validator process: everything ``swarmrl validator`` runs once its arguments are parsed.

See :mod:`swarmrl.roles.validator.cli` for the command line; this module imports torch and
transformers, which the command line does not need for ``--help``. Once the orchestrator says
the trainer finished the run (``PoolInfo.run_finished``) and nothing is left to judge (workers
stop generating then, so what is pending still gets its verdict), the validator stops with
status 0.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from swarmrl.config import SwarmConfig
from swarmrl.config.swarm import SwarmSection
from swarmrl.envs import build_env
from swarmrl.envs.multiturn import require_recomputable
from swarmrl.errors import PeerError, PeerUnavailable, UserError, VersionGone, WaitTimeout
from swarmrl.identity import load_keypair
from swarmrl.identity.keys import parse_public_key
from swarmrl.inference.interface import require_backend
from swarmrl.logs import plain
from swarmrl.pool.client import PoolClient
from swarmrl.protocol import PoolInfo, Verdict, VerdictReceipt
from swarmrl.rolekit.metrics import serve_role_metrics
from swarmrl.rolekit.policy import LoadedVersion, load_version, set_threads, swap_version
from swarmrl.rolekit.supervisor import terminate_as_interrupt
from swarmrl.rolekit.toolkit import (
    StatusReporter,
    load_role_config,
    log_config,
    retry,
    setup_logging,
)
from swarmrl.roles.validator.judge import judge_many
from swarmrl.shardcast import WeightClient
from swarmrl.toploc.thresholds import measured_engines

# Engines kept loaded, by backend. A version beyond that is swapped into the least recently used
# engine in place: a vLLM engine takes tens of seconds (minutes on a busy CPU) to start and holds
# its own processes and KV cache, while loading new weights into it takes well under a second.
KEEP_LOADED = {"torch": 3, "vllm": 1}
FINISHED_CHECK_S = 2.0  # how often an idle validator asks whether the run is over
# an idle validator's claim is held by the orchestrator until submissions arrive, this long at
# most (``swarmrl.pool.web.waits``); an empty answer that came sooner is followed by a pause
CLAIM_HOLD_S = 1.0
CLAIM_PAUSE_S = 0.3
FOLLOW_WAIT_S = 5.0  # one long-poll for a newer version; the follower checks ``stop`` between
UNAVAILABLE_PAUSE_S = 30.0  # a version whose fetch gave up is not tried again before this


class Versions:
    """Policy versions on demand: fetched through shardcast, the last few kept loaded; a new
    version beyond ``KEEP_LOADED`` reuses the least recently used engine (weights swapped).

    ``follow`` (run in a thread) downloads each version as soon as a weight source announces
    it, so the first check on a new version does not wait for its download. One fetch runs at
    a time (the client's connections and its pruning of old versions are not shared), and a
    version is loaded under the same lock, so pruning never removes files being read. A version
    whose fetch gave up (its sources away for ``give_up_s``) is not fetched again for
    ``UNAVAILABLE_PAUSE_S``: its units are deferred at once meanwhile (``judge_many``).
    """

    def __init__(
        self, client: WeightClient, config: SwarmConfig, log: logging.Logger, stop: threading.Event
    ) -> None:
        self.client = client
        self.config = config
        self.log = log
        self.stop = stop
        self.loaded: OrderedDict[int, LoadedVersion] = OrderedDict()
        self._fetching = threading.Lock()
        self._gave_up: dict[int, float] = {}  # version → when its fetch last gave up

    def close(self) -> None:
        """Release every loaded engine (vLLM engines run their own processes)."""
        while self.loaded:
            self.loaded.popitem()[1].engine.close()

    def __call__(self, version: int) -> LoadedVersion:
        if version in self.loaded:
            self.loaded.move_to_end(version)
            return self.loaded[version]
        since = time.monotonic() - self._gave_up.get(version, -UNAVAILABLE_PAUSE_S)
        if since < UNAVAILABLE_PAUSE_S:  # its units are deferred, not each held a whole retry
            raise WaitTimeout(f"policy v{version}: its fetch gave up {since:.0f} s ago")
        with self._fetching:
            try:
                loaded = self._load(version)
            except WaitTimeout:
                self._gave_up[version] = time.monotonic()
                raise
        self._gave_up.pop(version, None)
        self.loaded[version] = loaded
        return loaded

    def _load(self, version: int) -> LoadedVersion:
        """Fetch ``version`` and load it into a new engine or the least recently used one."""
        swarm = self.config.swarm
        path = retry(
            lambda: self.client.fetch(version, allow_rollback=True),
            f"fetch policy v{version}",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
            stop=self.stop,
        )
        if len(self.loaded) < KEEP_LOADED[self.config.inference.backend]:
            loaded = load_version(
                path, version, inference=self.config.inference, dtype=self.config.engine_dtype
            )
            self.log.info("engine: %s", loaded.engine.describe())
            return loaded
        oldest = self.loaded.popitem(last=False)[1]
        try:
            return swap_version(oldest, path, version)
        except BaseException:
            oldest.engine.close()  # its weights are in an unknown state
            raise

    def follow(self, wait_s: float = FOLLOW_WAIT_S) -> None:
        """Download every newly announced version until ``stop`` is set (a thread's target)."""
        swarm = self.config.swarm
        while not self.stop.is_set():
            try:
                with self._fetching:
                    self.client.fetch("latest")
                self.client.wait_for_newer(timeout_s=wait_s)
            except (WaitTimeout, VersionGone):
                continue  # nothing newer yet, or it went before it came: ask again
            except PeerUnavailable as exc:  # e.g. nothing published yet (the warm start runs)
                self.log.debug("no version to download ahead yet (%s)", exc)
                self.stop.wait(swarm.retry_s)
            except PeerError as exc:
                self.log.info("could not download the newest version ahead (%s)", exc)
                self.stop.wait(swarm.retry_s)


def pool_info(
    pool: PoolClient, pool_id: str, swarm: SwarmSection, log: logging.Logger, what: str
) -> PoolInfo:
    return retry(
        lambda: pool.pool(pool_id), what, log, give_up_s=swarm.give_up_s, pause_s=swarm.retry_s
    )


def run_finished(pool: PoolClient, pool_id: str, swarm: SwarmSection, log: logging.Logger) -> bool:
    """Whether the orchestrator says the trainer finished the run (nothing more to judge)."""
    return pool_info(pool, pool_id, swarm, log, "ask whether the run is finished").run_finished


def require_same_evidence_terms(
    pool: PoolClient, pool_id: str, config: SwarmConfig, log: logging.Logger
) -> None:
    """Raise a one-line :class:`UserError` where this validator would judge the pool's nodes
    on other terms than the pool's:

    - evidence in another unit than the pool's (``PoolSpec.evidence_scale``): the pool adds up
      what every validator sends into one record per node, so units of two scales would make
      it mean nothing (a node flagged early, or never);
    - thresholds calibrated on fewer engines than the pool accepts
      (``PoolSpec.requirements.engines``; any engine where it names none): honest work on an
      engine the calibration never measured may sit beyond its honest means and be flagged.
      Checked where ``toploc.thresholds_path`` exists at start; a run's own calibration, written
      later, covers the pool's engines by construction (the trainer calibrates
      ``SwarmConfig.pool_engines``, which the orchestrator holds the spec to)."""
    spec = pool_info(pool, pool_id, config.swarm, log, "read the pool's spec").spec
    mine = config.toploc.evidence_scale
    if spec.evidence_scale != mine:
        raise UserError(
            f"pool {pool_id!r} measures evidence at evidence_scale {spec.evidence_scale:g} "
            f"and this validator's toploc.evidence_scale is {mine:g}: set it to the pool's "
            "(the run's config.json; swarmrl pool spec writes it from toploc.evidence_scale)"
        )
    path = config.toploc.thresholds_path
    measured = None if path is None else measured_engines(path)
    if measured is None:
        return
    accepted = list(spec.requirements.engines)
    if accepted and set(accepted) <= set(measured):
        return
    which = f"engines {', '.join(accepted)}" if accepted else "any engine"
    raise UserError(
        f"pool {pool_id!r} accepts {which} and this validator's thresholds ({path}) were "
        f"calibrated on {', '.join(measured)}: calibrate on every engine the pool accepts "
        "(swarmrl toploc calibrate --engines), or accept only those (toploc.engines, which "
        "swarmrl pool spec writes as requirements.engines)"
    )


def post_verdicts(
    pool: PoolClient,
    pool_id: str,
    verdicts: list[Verdict],
    poster: ThreadPoolExecutor,
    swarm: SwarmSection,
    log: logging.Logger,
) -> list[VerdictReceipt | PeerError]:
    """Post a batch's verdicts side by side (each retried while the orchestrator is away), so a
    batch costs one round trip to a far orchestrator, not one per verdict; answers in the
    verdicts' order, a refusal as its :class:`PeerError` (a peer that stays away raises)."""

    def post(verdict: Verdict) -> VerdictReceipt | PeerError:
        try:
            return retry(
                lambda: pool.verdict(pool_id, verdict),
                "post verdict",
                log,
                give_up_s=swarm.give_up_s,
                pause_s=swarm.retry_s,
            )
        except PeerError as exc:
            return exc

    return list(poster.map(post, verdicts))


def run(
    args: argparse.Namespace, config: SwarmConfig, log: logging.Logger, status: StatusReporter
) -> int:
    swarm = config.swarm
    keypair = load_keypair(args.key)
    env = build_env(config.env)
    require_recomputable(env)  # this validator could not check such episodes
    stop = threading.Event()
    work_dir = Path(args.work_dir or f"validator-{status.status.name}")
    weights = WeightClient(
        [u for item in args.weights for u in item.split(",") if u],
        parse_public_key(args.publisher_key),
        work_dir / "weights",
        config.shardcast,
        client_id=keypair.node_id[:12],
    )
    versions = Versions(weights, config, log, stop)
    threading.Thread(target=versions.follow, name="weights", daemon=True).start()
    banned: set[str] = set()
    poster = ThreadPoolExecutor(max(1, args.claim), thread_name_prefix="verdicts")
    try:
        with PoolClient(args.orchestrator, keypair, swarm.peer_timeout_s) as pool:
            require_same_evidence_terms(pool, args.pool, config, log)
            status.set(state="waiting for submissions")
            next_check = 0.0
            while True:
                asked = time.monotonic()
                pending = retry(
                    lambda: pool.claim(
                        args.pool, args.claim, wait_s=CLAIM_HOLD_S, engine=config.inference.backend
                    ),
                    "claim pending submissions",
                    log,
                    give_up_s=swarm.give_up_s,
                    pause_s=swarm.retry_s,
                )
                if not pending:
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + FINISHED_CHECK_S
                        if run_finished(pool, args.pool, swarm, log):
                            log.info("the run is finished and nothing awaits a verdict; stopping")
                            status.set(state="done: the run is finished")
                            return 0
                    status.set(state="waiting for submissions")
                    if time.monotonic() - asked < CLAIM_PAUSE_S:  # not held: do not spin
                        stop.wait(CLAIM_PAUSE_S)
                    continue
                # the claimed units replay together (batched prefills, judge_many)
                status.set(state=f"replaying {len(pending)} submission(s)")
                started = time.perf_counter()
                results = judge_many(
                    pending, env, versions, config.toploc, engine=config.inference.backend
                )
                status.add(replay_seconds=time.perf_counter() - started, replays=len(pending))
                verdicts = [r.verdict for r in results if r.verdict is not None]
                receipts = iter(post_verdicts(pool, args.pool, verdicts, poster, swarm, log))
                if not verdicts:  # every unit deferred: claimed again after a pause, not at once
                    stop.wait(swarm.retry_s)
                for sub, result in zip(pending, results, strict=True):
                    if result.verdict is None:
                        log.warning("could not judge %s now: %s", sub.submission_id, result.failure)
                        status.add(deferred=1)
                        continue
                    verdict = result.verdict
                    receipt = next(receipts)
                    if isinstance(receipt, PeerError):  # the pool refused it
                        # e.g. the submission was dropped when its node was banned meanwhile
                        log.info("verdict on %s not recorded: %s", sub.submission_id, receipt)
                        status.add(superseded=1)
                        continue
                    if verdict.accept and receipt.status == "rejected":  # the node's evidence
                        verdict = verdict.model_copy(
                            update=dict(accept=False, severity="hard", reasons=receipt.reasons)
                        )
                    status.count(
                        "verdicts",
                        outcome="accepted" if verdict.accept else "rejected",
                        severity="none" if verdict.accept else verdict.severity,
                    )
                    if verdict.accept or verdict.severity != "soft":  # a replay's own verdict
                        outcome = "accepted" if verdict.accept else "rejected"
                        # the words of swarmrl.ledger.counts; per node for the display
                        status.add(**{"checked": 1, f"checked.{sub.node_id}": 1})
                        status.add(**{f"{outcome}.{sub.node_id}": 1})
                    if verdict.accept:
                        status.add(accepted=1, tokens_replayed=verdict.measured_tokens)
                        log.info(  # the pairing whose honest means measured its evidence
                            "accepted %s from node %s (%s->%s, %d tokens replayed)",
                            sub.submission_id,
                            sub.node_id,
                            plain(str(sub.engine)),
                            config.inference.backend,
                            verdict.measured_tokens,
                        )
                        if result.rewards:
                            status.set(reward_mean=sum(result.rewards) / len(result.rewards))
                        continue
                    reason = verdict.reasons[0] if verdict.reasons else "rejected"
                    if verdict.severity == "soft":  # dropped without blame (e.g. expired)
                        log.info(
                            "dropped %s from node %s: %s", sub.submission_id, sub.node_id, reason
                        )
                        status.add(expired=1)
                        continue
                    status.add(rejected=1)
                    log.warning(
                        "rejected %s from node %s: %s", sub.submission_id, sub.node_id, reason
                    )
                    if sub.node_id not in banned:
                        banned.add(sub.node_id)
                        status.set(banned=len(banned))
                        status.event(f"banned node {sub.node_id[:8]}: {reason[:80]}")

    finally:
        stop.set()  # ends the version follower
        poster.shutdown(wait=True)
        versions.close()  # the follower only downloads files: no engine of its to wait for


def start(args: argparse.Namespace) -> int:
    """Run the role with parsed arguments (see :mod:`cli`); returns the exit status."""
    config = load_role_config(args)
    require_backend(config.inference.backend)
    keypair = load_keypair(args.key)
    name = args.name or f"validator-{keypair.node_id[:8]}"
    log = setup_logging(name)
    log_config(log, config)
    set_threads(config.swarm.role_threads)
    status = StatusReporter(
        "validator", name, args.status_dir, config.swarm.status_interval_s, keypair.node_id
    )
    serve_role_metrics(status, args, log)
    with terminate_as_interrupt(), status:
        try:
            return run(args, config, log, status)
        except KeyboardInterrupt:
            log.info("stopping")
            status.set(state="stopped")
            return 0
