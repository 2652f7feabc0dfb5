"""Node health as a pure function of time since the last heartbeat and the node's own status.

::

    banned                                   stays banned (hard invalidation is final)
    ejected                                  stays ejected until the node joins again
    silence ≥ eject_after                  → ejected
    silence ≥ dead_after                   → dead      (its leases are released)
    silence ≥ unhealthy_after or status=error → unhealthy
    otherwise                              → healthy   (Unhealthy ⇄ Healthy as beats resume)

``silence`` is measured from the later of the last beat and the orchestrator's start, so a
restart of the orchestrator does not kill every node. Knows nothing about storage.
"""

from __future__ import annotations

from swarmrl.protocol.pool import NodeState


def next_state(
    state: NodeState,
    silence_s: float,
    status: str | None,
    *,
    unhealthy_after_s: float,
    dead_after_s: float,
    eject_after_s: float,
) -> NodeState:
    """The state a node should be in now (see module docstring)."""
    if state in ("banned", "ejected"):
        return state
    if silence_s >= eject_after_s:
        return "ejected"
    if silence_s >= dead_after_s:
        return "dead"
    if state == "dead":
        return "dead"  # a dead node's leases were released; only a fresh beat revives it
    if silence_s >= unhealthy_after_s or status == "error":
        return "unhealthy"
    return "healthy"


def may_work(state: NodeState) -> bool:
    """Whether a node in ``state`` may lease and submit."""
    return state == "healthy"
