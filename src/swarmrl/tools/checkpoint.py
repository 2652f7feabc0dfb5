"""Find the policy a run directory or checkpoint path names.

An HF checkpoint is recognised by what it holds: a ``config.json`` that names a model
(``model_type``) and weights beside it (``model.safetensors``, ``pytorch_model.bin`` or a
sharded index of either). A run directory has a ``config.json`` of its own (the resolved run
config, no ``model_type``), so a ``config.json`` alone says nothing.

Accepted, in this order:

- an HF checkpoint directory itself (a run's ``policy/``, a published version, a base model);
- a run directory (colocated or swarm) whose ``policy/`` is a checkpoint: the final policy,
  written when RL is over;
- a swarm run directory still running or stopped before the end: the newest ready version the
  trainer's origin published (``trainer/origin/vNNNNNNNN``, see ``swarmrl.shardcast.store``).

Knows nothing about loading models or serving them; it only names a directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from swarmrl.errors import MissingPathError
from swarmrl.shardcast import store

ORIGIN_STORE = Path("trainer") / "origin"
FINAL_POLICY = Path("policy")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
LOOKED_FOR = (
    "an HF checkpoint (config.json with a model_type, and model.safetensors or "
    "pytorch_model.bin) in the directory itself, in policy/, or in a ready version under "
    f"{ORIGIN_STORE}/"
)


def is_checkpoint(path: Path) -> bool:
    """True when ``path`` holds an HF model: a model config and its weights."""
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):  # absent, unreadable or not JSON: not a model config
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)


def find_policy(path: str | Path) -> Path:
    """The HF checkpoint directory ``path`` stands for; ``MissingPathError`` if none."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise MissingPathError(f"no such run directory or checkpoint: {root}")
    if is_checkpoint(root):
        return root
    if is_checkpoint(root / FINAL_POLICY):
        return root / FINAL_POLICY
    published = root / ORIGIN_STORE
    for version in reversed(store.ready_versions(published)):
        if is_checkpoint(store.ready_dir(published, version)):
            return store.ready_dir(published, version)
    raise MissingPathError(f"{root} holds no policy: looked for {LOOKED_FOR}")
