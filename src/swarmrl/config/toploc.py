"""Config of the toploc subsystem."""

from __future__ import annotations

from swarmrl.config.base import Section


class ToplocConfig(Section):
    """Settings of `swarmrl.toploc`."""
