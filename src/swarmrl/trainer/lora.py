"""LoRA training with peft: adapters on a frozen base, and versions that carry the adapter only.

With ``[model.lora] enabled = true`` the learner trains ``peft.get_peft_model(policy)``: every
base weight frozen, the optimizer holding the adapter factors alone. After each step the
leader's whole policy is refreshed with the merged weights (``W + alpha/r · B @ A``,
:func:`swarmrl.inference.lora.merge_peft_state`), which is what is evaluated and saved as
``policy/``. A published version (:class:`AdapterVersions`) is the base checkpoint, written
once and linked into every version so shardcast sends its unchanged bytes once, plus ``lora/``
(the adapter in peft's format and the digests of the base it belongs to).

:func:`check_lora` runs before anything is trained or written: peft missing or a target module
the model lacks is one :class:`~swarmrl.errors.ConfigError` line.

Knows nothing about the loss, rollouts or how versions travel.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from swarmrl.config import SwarmConfig
from swarmrl.config.model import LoraConfig
from swarmrl.errors import ConfigError
from swarmrl.inference.lora import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    BASE_FILE,
    base_weight_files,
    file_sha256,
)
from swarmrl.model.io import save_policy

PEFT_INSTALL = "pip install 'swarmrl[lora]'"


def require_peft() -> Any:
    """The peft module; a one-line ConfigError naming the install command when it is absent."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            f"model.lora.enabled = true needs peft, which is not installed: {PEFT_INSTALL}"
        ) from exc
    return peft


def linear_names(model: torch.nn.Module) -> set[str]:
    """Full names of the model's linear layers (what LoRA target modules are matched against)."""
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """A target matches a linear layer whose name is it or ends in ``.<target>`` (as in peft)."""
    names = linear_names(model)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(
            f"model.lora.target_modules: {missing} match no linear layer of the model "
            f"(its linear layers: {known})"
        )


def _skeleton(config: SwarmConfig) -> torch.nn.Module | None:
    """The policy's module tree without weights (meta device), or None when its config cannot be
    read here (a hub id not cached): then the targets are checked on the loaded policy."""
    model = config.model
    if model.path is None:
        tiny = model.tiny
        shape = dict(
            vocab_size=8,
            hidden_size=tiny.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_heads,
            intermediate_size=tiny.intermediate_size,
        )
        hf = LlamaConfig(**shape) if tiny.arch == "llama" else Qwen2Config(**shape)
    else:
        try:
            hf = AutoConfig.from_pretrained(model.path)
        except (OSError, ValueError):
            return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def check_lora(config: SwarmConfig) -> None:
    """Refuse, before anything is trained or written, a LoRA config that cannot run."""
    lora = config.model.lora
    if not lora.enabled:
        return
    require_peft()
    skeleton = _skeleton(config)
    if skeleton is not None:
        check_targets(skeleton, lora.target_modules)


def wrap(model: PreTrainedModel, lora: LoraConfig) -> PreTrainedModel:
    """``model`` (modified in place) inside peft LoRA adapters; its own weights frozen."""
    peft = require_peft()
    check_targets(model, lora.target_modules)
    spec = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped: PreTrainedModel = peft.get_peft_model(model, spec)
    return wrapped


def scaling(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank


class AdapterVersions:
    """Writes LoRA versions: the base checkpoint (saved once) plus ``lora/`` per version."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, lora: LoraConfig
    ) -> None:
        """``model`` holds the base weights (before any step)."""
        self.lora = lora
        self.base_dir = save_policy(model, tokenizer, tempfile.mkdtemp(prefix="swarmrl-lora-"))
        self.base_sha256 = {
            name: file_sha256(self.base_dir / name) for name in base_weight_files(self.base_dir)
        }

    def save(self, adapter: dict[str, torch.Tensor], peft_config: Any, out: Path) -> Path:
        """Write the version directory ``out``: the base files (hard links where the disk
        allows) and ``lora/`` with ``adapter`` (peft-format tensors) and its config."""
        out.mkdir(parents=True, exist_ok=True)
        for item in self.base_dir.iterdir():
            if item.is_file():
                try:
                    os.link(item, out / item.name)
                except OSError:  # another filesystem, or no hard links: copy
                    shutil.copyfile(item, out / item.name)
        folder = out / ADAPTER_DIR
        folder.mkdir(exist_ok=True)
        peft_config.save_pretrained(str(folder))
        save_file(adapter, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / BASE_FILE).write_text(json.dumps({"sha256": self.base_sha256}, indent=1) + "\n")
        return out

    def close(self) -> None:
        shutil.rmtree(self.base_dir, ignore_errors=True)
