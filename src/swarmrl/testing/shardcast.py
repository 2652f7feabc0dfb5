"""Loopback helpers for tests and benchmarks: small checkpoint dirs and servers over stores.

Everything here is real (real safetensors files, real uvicorn servers on 127.0.0.1 ephemeral
ports); nothing stands in for a component. Knows nothing about pytest.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.shardcast.server import RunningServer, serve_origin


def write_checkpoint(directory: str | Path, weights: dict[str, np.ndarray]) -> Path:
    """An HF-style checkpoint dir: config.json, model.safetensors, tokenizer.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "tensors": sorted(weights)})
    )
    (directory / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "WordLevel"}})
    )
    save_file(
        {k: np.ascontiguousarray(v) for k, v in weights.items()},
        str(directory / "model.safetensors"),
    )
    return directory


def random_weights(n_floats: int, seed: int = 0, tensors: int = 4) -> dict[str, np.ndarray]:
    """``tensors`` float32 tensors holding ``n_floats`` values in all, N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    per = max(1, n_floats // tensors)
    return {
        f"layer{i}.weight": (rng.standard_normal(per) * 0.02).astype(np.float32)
        for i in range(tensors)
    }


def serve_store(
    store_dir: str | Path, config: ShardcastConfig | None = None, role: str = "origin"
) -> RunningServer:
    """Serve the ready versions of ``store_dir`` (as an origin does) on an ephemeral port."""
    return serve_origin(store_dir, config, role=role)
