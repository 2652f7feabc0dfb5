"""Policy versions as the roles see them: fetched through shardcast, loaded into an engine.

A published version is an HF checkpoint directory (config, weights, tokenizer files) under a
shardcast store, with a signed manifest whose ``root_digest`` names the weights; proofs bind to
that digest. :class:`LoadedVersion` is one version ready to generate or replay with.

Knows nothing about pools or training; it loads what shardcast delivered.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from swarmrl.inference.engine import TorchEngine
from swarmrl.model.io import load_policy
from swarmrl.shardcast import store


@dataclass
class LoadedVersion:
    """One policy version loaded into an engine."""

    version: int
    root_digest: str
    engine: TorchEngine
    tokenizer: PreTrainedTokenizerBase
    path: Path


def version_digest(path: str | Path) -> str:
    """Root digest from the signed manifest of a ready version directory."""
    return store.load_manifest(Path(path)).root_digest


def load_version(path: str | Path, version: int, device: str = "cpu") -> LoadedVersion:
    """Load the checkpoint in ``path`` (a ready shardcast version directory) into an engine."""
    model, tokenizer = load_policy(str(path), device=device)
    return LoadedVersion(
        version, version_digest(path), TorchEngine(model, tokenizer, device), tokenizer, Path(path)
    )


def swap_version(loaded: LoadedVersion, path: str | Path, version: int) -> LoadedVersion:
    """Replace the weights of ``loaded`` in place with those in ``path`` (same architecture)."""
    model, _ = load_policy(str(path), device=str(loaded.engine.device))
    loaded.engine.load_state_dict(model.state_dict())
    loaded.version = version
    loaded.root_digest = version_digest(path)
    loaded.path = Path(path)
    return loaded


def set_threads(threads: int) -> None:
    """Bound torch's CPU threads (many roles share one machine in a local swarm)."""
    torch.set_num_threads(threads)
