"""Config of the swarm subsystem."""

from __future__ import annotations

from swarmrl.config.base import Section


class SwarmConfig(Section):
    """Settings of `swarmrl.swarm`."""
