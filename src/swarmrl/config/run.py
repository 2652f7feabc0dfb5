"""Config of a run as a whole: seed, where it writes, how it executes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class RunConfig(Section):
    """Identity and placement of one run."""

    name: str = Field("arith", description="run name, used in the run directory")
    seed: int = Field(0, description="master seed; everything random derives from it")
    run_dir: str = Field("runs", description="parent directory of run directories")
    cache_dir: str = Field(".cache/swarmrl", description="warm-start and other caches")
    threads: int = Field(2, ge=1, description="torch intra-op threads")
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="where tensors live")
