"""The base class every config section derives from: strict, documented, immutable-ish.

Knows nothing about TOML or the command line (see ``swarmrl.config.load``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys fail loudly, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
