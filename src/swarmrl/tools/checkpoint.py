"""Find the policy a run directory or checkpoint path names.

Accepted, in this order:

- an HF checkpoint directory (it holds ``config.json``);
- a colocated run directory: its trained policy in ``policy/``;
- a swarm run directory: the newest ready version the trainer's origin published
  (``trainer/origin/vNNNNNNNN``, see ``swarmrl.shardcast.store``).

Knows nothing about loading models or serving them; it only names a directory.
"""

from __future__ import annotations

from pathlib import Path

from swarmrl.errors import MissingPathError
from swarmrl.shardcast import store

ORIGIN_STORE = Path("trainer") / "origin"


def find_policy(path: str | Path) -> Path:
    """The HF checkpoint directory ``path`` stands for; ``MissingPathError`` if none."""
    root = Path(path).expanduser()
    if not root.exists():
        raise MissingPathError(f"no such run directory or checkpoint: {root}")
    if (root / "config.json").is_file():
        return root
    if (root / "policy" / "config.json").is_file():
        return root / "policy"
    versions = store.ready_versions(root / ORIGIN_STORE)
    if versions:
        return store.ready_dir(root / ORIGIN_STORE, versions[-1])
    raise MissingPathError(
        f"{root} holds no policy: expected config.json, policy/config.json "
        f"or ready versions under {ORIGIN_STORE}/"
    )
