"""Config of the policy model: which weights to load, or which tiny model to create."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section, path_key
from swarmrl.errors import MissingPathError


def looks_local(path: str) -> bool:
    """Whether ``model.path`` names a local directory: a hub id is ``name`` or ``org/name``;
    anything else (absolute, ./, ~, deeper) is local."""
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or "\\" in path
        or Path(path).exists()
    )


def model_dir(path: str | Path) -> Path:
    """``path`` as a local HF model directory; :class:`MissingPathError` when it has no
    ``config.json`` (checked without loading anything: ``swarmrl run`` checks it before any
    role starts)."""
    local = Path(path).expanduser()
    if not (local / "config.json").is_file():
        raise MissingPathError(f"model directory not found or has no config.json: {local}")
    return local


class TinyModelConfig(Section):
    """Shape of a random-init model created by ``swarmrl.model.factory`` for built-in tasks."""

    arch: Literal["llama", "qwen2"] = Field("llama", description="HF architecture family")
    hidden_size: int = Field(128, gt=0, description="width of the residual stream")
    num_layers: int = Field(4, gt=0, description="transformer blocks")
    num_heads: int = Field(4, gt=0, description="attention heads (key/value heads equal)")
    intermediate_size: int = Field(512, gt=0, description="MLP inner width")
    max_position_embeddings: int = Field(256, gt=0, description="longest sequence, in tokens")
    initializer_range: float = Field(
        0.1,
        gt=0,
        description="std of the normal init of weight matrices and embeddings (HF's usual 0.02 "
        "left the tiny model on a loss plateau for 700+ warm-start steps; 0.1 learns in ~250)",
    )


LORA_TARGETS_DEFAULT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """Low-rank adapters (peft LoRA): the trainer trains only the adapters on a frozen base,
    and each published version carries the adapter alone beside the unchanged base."""

    enabled: bool = Field(
        False, description="train LoRA adapters instead of every weight (needs swarmrl[lora])"
    )
    rank: int = Field(8, gt=0, description="rank r of each adapter (A: [r, in], B: [out, r])")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is alpha/r · B @ A")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter input while training"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS_DEFAULT),
        min_length=1,
        description="names of the linear layers that get adapters (module-name suffixes); "
        "each must exist in the model",
    )


class ModelConfig(Section):
    """Where the policy comes from.

    ``path`` is a local HF directory or a hub id; ``None`` means: create the tiny model for the
    configured environment (and warm-start it with ``swarmrl sft``, cached by config digest).
    """

    path: str | None = Field(
        None,
        description="HF model dir or hub id; None = built-in tiny model",
        json_schema_extra=path_key("path or hub id"),
    )
    warm_start: bool = Field(
        False,
        description="also warm-start a given model.path by SFT on the environment's "
        "demonstrations (sft.*), cached like the tiny model's; the built-in tiny model always is",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the policy is loaded and trained in"
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
