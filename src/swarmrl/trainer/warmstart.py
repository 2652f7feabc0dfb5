"""The starting policy of a run: a given model directory, or the cached SFT warm start.

With ``model.path`` unset, the tiny model for the environment's alphabet is created (seeded by
``run.seed``); with ``model.path`` set and ``model.warm_start`` on, that model is loaded. Either
is trained by :mod:`swarmrl.trainer.sft` for ``sft.steps`` steps on the environment's
demonstrations and saved under ``run.cache_dir/warmstart/<digest>/`` where the digest covers
every setting that shapes it (the base model — tiny shape, or the given model's path and file
sizes —, environment and the bytes of a local dataset file, SFT settings, seed). A later run with the same settings reuses it. A
given model without ``model.warm_start`` is the starting policy as it is. The SFT optimizer state is saved beside the weights so the control arm can *continue* the
warm start's own training.

Knows nothing about RL.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.errors import ConfigError
from swarmrl.model import build_char_tokenizer, create_tiny_model, load_policy, save_policy
from swarmrl.trainer.episodes import warm_start_episodes
from swarmrl.trainer.sft import SFTData, SFTTrainer, warm_start_examples

FORMAT = 1  # bump when the warm-start recipe changes, so old caches are not reused


@dataclass
class WarmStart:
    """Where the starting policy lives and what making it cost."""

    path: Path
    cached: bool
    seconds: float  # SFT wall time when it was made (0 for a given model.path)
    steps: int
    final_loss: float | None


def _base_model_spec(config: SwarmConfig) -> object:
    """What identifies the model SFT starts from: the tiny shape, or the given model's files."""
    if config.model.path is None:
        return config.model.tiny.model_dump(mode="json")
    path = Path(config.model.path).expanduser()
    files = sorted((p.name, p.stat().st_size) for p in path.glob("*") if p.is_file())
    return {"path": str(path.resolve()) if path.is_dir() else config.model.path, "files": files}


def _dataset_spec(config: SwarmConfig) -> str | None:
    """SHA-256 of a local dataset file, so an edited file is not served a stale warm start."""
    dataset = config.env.dataset
    path = Path(dataset).expanduser() if dataset is not None else None
    if path is None or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def warm_start_digest(config: SwarmConfig) -> str:
    spec = {
        "format": FORMAT,
        "tiny": _base_model_spec(config),
        "env": config.env.model_dump(mode="json"),
        "data": _dataset_spec(config),
        "sft": config.sft.model_dump(mode="json"),
        "seed": config.run.seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_dir(config: SwarmConfig) -> Path:
    return Path(config.run.cache_dir).expanduser() / "warmstart" / warm_start_digest(config)


def sft_data(config: SwarmConfig, env: Environment, tokenizer: PreTrainedTokenizerBase) -> SFTData:
    if isinstance(env, MultiTurnEnvironment):  # whole demonstrated episodes
        return warm_start_episodes(
            env, tokenizer, config.sft.train_examples, config.sft.label_noise, config.run.seed
        )
    return warm_start_examples(
        env, tokenizer, config.sft.train_examples, config.sft.label_noise, config.run.seed
    )


def ensure_warm_start(
    config: SwarmConfig,
    env: Environment,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmStart:
    """The warm-start directory for ``config``, trained now unless it is cached."""
    if config.model.path is not None and not config.model.warm_start:
        return WarmStart(
            Path(config.model.path), cached=True, seconds=0.0, steps=0, final_loss=None
        )
    if config.model.path is None and env.alphabet is None:
        raise ConfigError(
            f"env {env.name!r} needs a pretrained model: set model.path (a local HF directory)"
        )
    out = warm_start_dir(config)
    meta_path = out / "warmstart.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return WarmStart(out / "policy", True, meta["seconds"], meta["steps"], meta["final_loss"])
    model, tokenizer = _base_model(config, env)
    trainer = SFTTrainer(
        model,
        sft_data(config, env, tokenizer),
        config.sft.batch_size,
        config.sft.lr,
        config.run.seed,
    )
    start = time.perf_counter()
    loss = trainer.run(steps=config.sft.steps, on_step=on_step)
    seconds = time.perf_counter() - start
    # Write into a scratch directory and rename, so a half-written cache is never reused.
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    save_policy(model, tokenizer, scratch / "policy")
    torch.save(trainer.optimizer.state_dict(), scratch / "sft_optimizer.pt")
    meta = {
        "seconds": seconds,
        "steps": trainer.step,
        "final_loss": loss,
        "digest": warm_start_digest(config),
    }
    (scratch / "warmstart.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)
    return WarmStart(out / "policy", False, seconds, trainer.step, loss)


def _base_model(
    config: SwarmConfig, env: Environment
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model SFT starts from: the given ``model.path``, or a fresh tiny model (seeded)."""
    if config.model.path is not None:
        return load_policy(config.model.path)
    tokenizer = build_char_tokenizer(env.alphabet or "")
    torch.manual_seed(config.run.seed)
    return create_tiny_model(config.model.tiny, tokenizer), tokenizer


def load_start_policy(
    config: SwarmConfig, warm: WarmStart, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_policy(warm.path, dtype=config.model.dtype, device=device)


def continue_warm_start(
    config: SwarmConfig, env: Environment, warm: WarmStart, seconds: float
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, int]:
    """The control arm: the warm start's SFT resumed (same data, its optimizer state) for
    ``seconds`` of wall clock. Returns ``(model, tokenizer, extra_steps)``."""
    model, tokenizer = load_policy(warm.path)
    trainer = SFTTrainer(
        model,
        sft_data(config, env, tokenizer),
        config.sft.batch_size,
        config.sft.lr,
        config.run.seed + 1,
    )
    state = warm.path.parent / "sft_optimizer.pt"
    if state.is_file():
        trainer.optimizer.load_state_dict(torch.load(state))
    before = trainer.step
    trainer.run(seconds=seconds)
    return model, tokenizer, trainer.step - before
