"""Config of the pool subsystem."""

from __future__ import annotations

from swarmrl.config.base import Section


class PoolConfig(Section):
    """Settings of `swarmrl.pool`."""
