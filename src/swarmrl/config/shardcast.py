"""Config of the shardcast subsystem."""

from __future__ import annotations

from swarmrl.config.base import Section


class ShardcastConfig(Section):
    """Settings of `swarmrl.shardcast`."""
