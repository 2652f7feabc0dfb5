"""A worker's membership of its pool: joining, the heartbeat thread, and rejoining after an
ejection for silence.

The heartbeat beats on a fixed grid at the node's own phase, telling the orchestrator the node
is alive and which version it holds; it learns from a ``NodeBanned`` refusal (or the reply)
that the node was banned, from the reply that the run is finished (so a node waiting for a
version the trainer will never publish, or left with, stops within a beat), and from a
``NotMember`` refusal that it was ejected for silence. A rejoin uses the node's own key and
no invite (``swarmrl.pool.trust.joins``), pausing longer after each failed attempt up to
:data:`REJOIN_MAX_PAUSE_S`; the heartbeat and work threads may both call it. Knows nothing
about leases or generation (``swarmrl.roles.worker.node``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from swarmrl.config import SwarmConfig
from swarmrl.errors import InfraError, NodeBanned, NotFound, NotMember, PeerError, WaitTimeout
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import Heartbeat, Invite, NodeMetadata
from swarmrl.rolekit.ticks import FixedRate
from swarmrl.rolekit.toolkit import StatusReporter, retry

REJOIN_MAX_PAUSE_S = 30.0  # longest pause between attempts to rejoin after an ejection


class Membership:
    """Joins ``pool_id`` through ``pool`` and keeps the node in it (module docstring).

    ``banned`` is called (with the reason) once the pool says the node is banned; ``finished``
    once a heartbeat's reply says the trainer finished the run; ``beat`` gives each heartbeat's
    content; ``stop`` ends the heartbeat thread and every wait.
    """

    def __init__(
        self,
        pool: PoolClient,
        pool_id: str,
        invite: Invite | None,
        config: SwarmConfig,
        status: StatusReporter,
        log: logging.Logger,
        stop: threading.Event,
        banned: Callable[[object], None],
        beat: Callable[[], Heartbeat],
        finished: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.pool_id = pool_id
        self.invite = invite
        self.config = config
        self.status = status
        self.log = log
        self.stop = stop
        self._banned = banned
        self._beat = beat
        self._finished = finished
        self._rejoin_lock = threading.Lock()  # the heartbeat and work threads may both notice
        self.rejoins = 0  # times the node came back after an ejection

    def metadata(self) -> NodeMetadata:
        return NodeMetadata(engine=self.config.inference.backend, memory_gb=0.0, accelerator="cpu")

    def join(self) -> None:
        meta = self.metadata()
        swarm = self.config.swarm

        def call() -> None:
            # joining again is harmless: a member gets its current view back, and a node let go
            # for silence is taken back without spending the invite again
            view = self.pool.join(self.pool_id, meta, self.invite)
            self.log.info("joined pool %s as node %s (%s)", self.pool_id, view.node_id, view.state)

        retry(
            call,
            f"join pool {self.pool_id}",
            self.log,
            give_up_s=swarm.give_up_s,
            pause_s=swarm.retry_s,
            stop=self.stop,
        )

    def heartbeats(self) -> None:
        """The heartbeat thread: beat until ``stop``, a ban, or a rejoin refused for good."""
        # on a fixed grid at this node's own phase, not "a period after the last answer": a
        # slow moment of the orchestrator must not bunch the beats of the nodes it delayed
        ticks = FixedRate.random_phase(self.config.pool.heartbeat_interval_s / 2, time.monotonic())
        while not self.stop.wait(ticks.wait_s(time.monotonic())):
            try:
                reply = self.pool.heartbeat(self.pool_id, self._beat())
            except NodeBanned as exc:
                self._banned(exc)
                return
            except NotMember as exc:
                if not self._rejoin_after(exc):
                    return
                continue
            except (InfraError, PeerError) as exc:  # PeerError: the pool refused the beat
                if self.stop.is_set():  # stopping: the client may be closed under the beat
                    return
                self.log.warning("heartbeat failed: %s", exc)
                continue
            finally:
                ticks.advance(time.monotonic())
            if reply.state == "banned":
                self._banned("heartbeat reply")
                return
            if reply.run_finished:  # beats go on: a unit in hand may still be handed in
                self._finished()

    def _rejoin_after(self, refusal: NotMember) -> bool:
        """The heartbeat thread learned the node is not a member: rejoin. False when the node
        must stop (banned, or stopped while trying)."""
        try:
            self.rejoin(refusal)
        except NodeBanned as exc:
            self._banned(exc)
            return False
        except WaitTimeout:
            return not self.stop.is_set()  # the work thread meets the same refusal and decides
        except PeerError as exc:  # refused for good (e.g. requirements): beating again is noise
            self.log.error("cannot rejoin the pool (%s); heartbeats stop", exc)
            return False
        return True

    def rejoin(self, refusal: NotMember) -> None:
        """Come back after an ejection for silence, with this node's key and no invite.

        Transient failures (the pool unreachable, its join rate spent) back off, doubling the
        pause up to :data:`REJOIN_MAX_PAUSE_S`. A pool that does not know the node at all (its
        database was replaced) gets a plain join with the node's invite; any other refusal
        (banned, requirements) is raised. The heartbeat and work threads may both call it: the
        second finds the node a member again and gets its view back at the cost of one request.
        """
        swarm = self.config.swarm
        with self._rejoin_lock:
            self.log.warning("the orchestrator let this node go (%s); rejoining", refusal)
            self.status.set(state="rejoining")
            try:
                view = retry(
                    lambda: self.pool.rejoin(self.pool_id, self.metadata()),
                    f"rejoin pool {self.pool_id}",
                    self.log,
                    give_up_s=swarm.give_up_s,
                    pause_s=swarm.retry_s,
                    max_pause_s=max(swarm.retry_s, REJOIN_MAX_PAUSE_S),
                    stop=self.stop,
                )
            except NotFound:
                self.log.warning("the pool does not know this node; joining it anew")
                self.join()
                return
            self.rejoins += 1
            self.status.event(f"rejoined the pool ({view.state})")
            self.log.info("rejoined pool %s as node %s", self.pool_id, view.node_id)
