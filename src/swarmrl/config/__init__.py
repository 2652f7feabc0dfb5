"""The config tree (pydantic) and its loading: defaults → TOML → dotted overrides.

Imports no torch. Each section lives in its own module, documented where declared.
"""

from swarmrl.config.load import (
    EMBEDDED_DEFAULT,
    build_config,
    load_config,
    parse_override,
    save_config,
)
from swarmrl.config.root import SwarmConfig

__all__ = [
    "EMBEDDED_DEFAULT",
    "SwarmConfig",
    "build_config",
    "load_config",
    "parse_override",
    "save_config",
]
