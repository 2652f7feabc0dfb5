"""Trainer checkpoints (``torch.distributed.checkpoint``): stop anywhere, resume where it was.

One checkpoint is a directory ``ROOT/step-000012/`` (12 = loop steps done)::

    .metadata, __R_0.distcp   model and optimizer state, one file per rank written in parallel
                              (DCP: loadable by another number of ranks)
    rng-rank{R}.pt            each rank's torch RNG state (CPU, and CUDA where there is one)
    source.pt                 where the trainer is in the rollout stream: the rollout source's
                              state (the pool source: groups taken but not yet trained, the ids
                              of every submission consumed); written by rank 0
    trainer.json              step, policy version, ranks, config fingerprint; written last

``ROOT/latest`` names the newest complete checkpoint; it is replaced atomically after every
rank has written its part, so a crash mid-save leaves the previous one in force. The two
newest are kept. The fingerprint (SHA-256 over the config sections that shape the model and
the run: ``model``, ``env``, ``rl`` without ``rl.steps``, ``run.seed``) is checked before
anything is written: a checkpoint of another model or config is a one-line
:class:`~swarmrl.errors.CheckpointMismatch`, and nothing in ROOT is touched.

Knows nothing about the pool or publishing; what a source's state holds is the source's
business.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from swarmrl.config import SwarmConfig
from swarmrl.errors import CheckpointMismatch, MissingPathError
from swarmrl.trainer.parallel import Parallel

KEEP = 2  # complete checkpoints kept


def fingerprint(config: SwarmConfig) -> str:
    """SHA-256 of what a checkpoint must agree with to be resumed (module docstring)."""
    shape = {
        "model": config.model.model_dump(mode="json"),
        "env": config.env.model_dump(mode="json"),
        "rl": config.rl.model_dump(mode="json", exclude={"steps"}),
        "seed": config.run.seed,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


@dataclass
class Resumed:
    """What a loaded checkpoint tells the trainer."""

    path: Path
    step: int  # loop steps done: the next step's index
    version: int  # policy version of the saved weights
    source_state: Any  # the rollout source's state (None when the source keeps none)


class Checkpointer:
    """Saves and loads the trainer's checkpoints under ``root`` (module docstring)."""

    def __init__(self, root: Path, config: SwarmConfig, parallel: Parallel) -> None:
        self.root, self.parallel = Path(root), parallel
        self.fingerprint = fingerprint(config)
        self.every = config.trainer.checkpoint_every

    def latest(self) -> Path | None:
        """The newest complete checkpoint, checked against this config; None when none."""
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        meta_file = path / "trainer.json"
        if not meta_file.is_file():
            raise MissingPathError(f"checkpoint {path} named by {pointer} is incomplete")
        meta = json.loads(meta_file.read_text())
        if meta.get("fingerprint") != self.fingerprint:
            raise CheckpointMismatch(
                f"checkpoint {path} was written for another model or config (fingerprint "
                f"{str(meta.get('fingerprint'))[:12]}…, this run {self.fingerprint[:12]}…); "
                f"use another trainer.checkpoint_dir or the run's original config"
            )
        return path

    def due(self, steps_done: int, last_step: int) -> bool:
        """Whether to save after ``steps_done`` steps (every K, and at the end of the run)."""
        return steps_done == last_step or bool(self.every and steps_done % self.every == 0)

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        version: int,
        source_state: Any,
    ) -> Path:
        """Write checkpoint ``step`` from every rank (collective); returns its directory."""
        name = f"step-{step:06d}"
        path = self.root / name
        if self.parallel.leader:
            shutil.rmtree(path, ignore_errors=True)  # an unfinished save of this step
            path.mkdir(parents=True)
        self.parallel.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():
            # one process saving alone is what no_dist asks for; torch warns about it anyway
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(
                {"model": model_state, "optim": optim_state},
                checkpoint_id=str(path),
                no_dist=not self.parallel.sharded,
            )
        torch.save(_rng_state(), path / f"rng-rank{self.parallel.rank}.pt")
        self.parallel.barrier()  # every rank's part is on disk
        if self.parallel.leader:
            torch.save(source_state, path / "source.pt")
            meta = {
                "step": step,
                "version": version,
                "world": self.parallel.world,
                "fingerprint": self.fingerprint,
            }
            (path / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n")
            _replace(self.root / "latest", name)
            self._prune(keep=name)
        self.parallel.barrier()
        return path

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Resumed:
        """Load checkpoint ``path`` into ``model`` and ``optimizer`` on every rank (collective)."""
        meta = json.loads((path / "trainer.json").read_text())
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path), no_dist=not self.parallel.sharded)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        rng = path / f"rng-rank{self.parallel.rank}.pt"
        if rng.is_file():  # absent when resuming on more ranks than saved: seeds stay as set
            _set_rng_state(torch.load(rng, weights_only=False))
        source_state = None
        if self.parallel.leader and (path / "source.pt").is_file():
            # the trainer's own file, written above: its pickled groups are trusted
            source_state = torch.load(path / "source.pt", weights_only=False)
        return Resumed(path, int(meta["step"]), int(meta["version"]), source_state)

    def _prune(self, keep: str) -> None:
        done = sorted(p for p in self.root.glob("step-*") if (p / "trainer.json").is_file())
        for old in done[:-KEEP]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _replace(pointer: Path, text: str) -> None:
    scratch = pointer.with_name(pointer.name + ".tmp")
    try:
        scratch.write_text(text + "\n")
        os.replace(scratch, pointer)
    except OSError:
        scratch.unlink(missing_ok=True)  # a full disk leaves no empty file behind
        raise
