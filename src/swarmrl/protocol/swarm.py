"""What a role reports about itself to whoever supervises it: one JSON status file per role.

Each role started with ``--status-dir DIR`` rewrites ``DIR/<name>.json`` every few seconds
(atomically: write a temporary file, then rename), so ``swarmrl run``'s live display and its
final report read a consistent picture without talking to any role over the network. On a
real multi-machine swarm the files are simply not written (no ``--status-dir``).

Example::

    {"role": "worker", "name": "worker-0", "node_id": "3f1c…", "updated_at": 1764490000.5,
     "state": "generating", "policy_version": 4,
     "metrics": {"rollouts": 512, "tokens_per_s": 830.2, "submitted": 16}}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

RoleName = Literal["trainer", "worker", "validator", "orchestrator", "relay"]


class RoleStatus(BaseModel):
    """A role's latest self-report."""

    role: RoleName = Field(description="which kind of role wrote this")
    name: str = Field(description="the role's name in its swarm, e.g. 'worker-0'")
    node_id: str | None = Field(None, description="pool node id (32 hex); None: not a pool node")
    updated_at: float = Field(default_factory=time.time, description="unix time of this report, s")
    state: str = Field(
        "starting", description="one short phrase: 'starting', 'waiting for …', 'done', 'banned'"
    )
    policy_version: int | None = Field(
        None, description="policy version the role holds (trainer: last published); None: none yet"
    )
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "role-specific counters and gauges; trainer: step, reward_mean, accuracy, idle_fraction; "
            "worker: rollouts, tokens_per_s, submitted; validator: accepted, rejected, "
            "tokens_replayed"
        ),
    )
    metrics_url: str | None = Field(
        None, description="where this role serves Prometheus metrics; None: not served"
    )
    events: list[str] = Field(
        default_factory=list,
        description="the last few notable events, newest last (e.g. 'banned node 3f1c…')",
    )

    def write(self, status_dir: str | Path) -> Path:
        """Atomically replace ``status_dir/<name>.json`` with this report."""
        directory = Path(status_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        tmp = directory / f".{self.name}.json.tmp"
        try:
            tmp.write_text(self.model_dump_json())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk leaves no empty file behind
            raise
        return path

    @classmethod
    def read_dir(cls, status_dir: str | Path) -> dict[str, RoleStatus]:
        """Every readable status file in ``status_dir`` by role name (unreadable ones skipped)."""
        out: dict[str, RoleStatus] = {}
        directory = Path(status_dir)
        if not directory.is_dir():
            return out
        for path in sorted(directory.glob("*.json")):
            try:
                status = cls.model_validate(json.loads(path.read_text()))
            except (OSError, ValueError, ValidationError):
                continue
            out[status.name] = status
        return out
