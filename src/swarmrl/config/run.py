"""Config of a run as a whole: seed, where it writes, how it executes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section, path_key


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME/swarmrl`` (``~/.cache/swarmrl`` when unset): the same cache wherever a
    run is started, so a warm start is trained once per machine, not once per directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "swarmrl")


class RunConfig(Section):
    """Identity and placement of one run."""

    name: str = Field("arith", description="run name, used in the run directory")
    seed: int = Field(0, description="master seed; everything random derives from it")
    run_dir: str = Field(
        "runs", description="parent directory of run directories", json_schema_extra=path_key()
    )
    cache_dir: str = Field(
        default_factory=user_cache_dir,
        description="warm-start and other caches (default: the user cache directory)",
        json_schema_extra=path_key(),
    )
    threads: int = Field(
        1,
        ge=1,
        description="torch intra-op threads (the tiny model's matrices are too small to share)",
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="where tensors live")
