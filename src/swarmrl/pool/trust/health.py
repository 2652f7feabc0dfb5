"""Node health: the states, the silence thresholds that move a node between them, and who works.

::

    banned     stays banned (hard invalidation is final)
    ejected    stays ejected until the node joins again
    healthy | unhealthy | dead   silent ≥ eject_after_s      → ejected
    healthy | unhealthy          silent ≥ dead_after_s       → dead       (its leases are released)
    healthy                      silent ≥ unhealthy_after_s  → unhealthy
    any but banned/ejected       a heartbeat                 → healthy (unhealthy if it reports "error")

``silent`` is the time since the later of the node's last beat (or its join) and the
orchestrator's start, so a restart of the orchestrator does not kill every node. The sweeper
applies the rows of :data:`SILENCE_TRANSITIONS` in order, each as one set-based update.
Knows nothing about storage.
"""

from __future__ import annotations

from swarmrl.protocol.pool import NodeState

# (states it applies to, state it moves them to, name of the PoolConfig silence threshold)
SILENCE_TRANSITIONS: tuple[tuple[tuple[NodeState, ...], NodeState, str], ...] = (
    (("healthy", "unhealthy", "dead"), "ejected", "eject_after_s"),
    (("healthy", "unhealthy"), "dead", "dead_after_s"),
    (("healthy",), "unhealthy", "unhealthy_after_s"),
)
RELEASES_LEASES: frozenset[NodeState] = frozenset({"dead", "ejected", "banned"})


def may_work(state: NodeState) -> bool:
    """Whether a node in ``state`` may take new leases."""
    return state == "healthy"
