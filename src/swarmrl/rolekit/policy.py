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

from swarmrl.config.inference import InferenceConfig
from swarmrl.inference.interface import Engine, open_engine
from swarmrl.model.io import load_tokenizer
from swarmrl.shardcast import store


@dataclass
class LoadedVersion:
    """One policy version loaded into an engine."""

    version: int
    root_digest: str
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    path: Path


def version_digest(path: str | Path) -> str:
    """Root digest from the signed manifest of a ready version directory."""
    return store.load_manifest(Path(path)).root_digest


def load_version(
    path: str | Path,
    version: int,
    device: str = "cpu",
    inference: InferenceConfig | None = None,
    dtype: str = "float32",
) -> LoadedVersion:
    """Load the checkpoint in ``path`` (a ready shardcast version directory) into the engine
    ``inference.backend`` names (the torch engine by default), in ``dtype``."""
    engine = open_engine(path, inference or InferenceConfig(), dtype=dtype, device=device)
    return LoadedVersion(version, version_digest(path), engine, load_tokenizer(path), Path(path))


def swap_version(loaded: LoadedVersion, path: str | Path, version: int) -> LoadedVersion:
    """Replace the weights of ``loaded`` in place with those in ``path`` (same architecture)."""
    loaded.engine.load_checkpoint(path)
    loaded.version = version
    loaded.root_digest = version_digest(path)
    loaded.path = Path(path)
    return loaded


def set_threads(threads: int) -> None:
    """Bound torch's CPU threads (many roles share one machine in a local swarm)."""
    torch.set_num_threads(threads)
