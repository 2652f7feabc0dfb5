"""Config of the policy model: which weights to load, or which tiny model to create."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class TinyModelConfig(Section):
    """Shape of a random-init model created by ``swarmrl.model.factory`` for built-in tasks."""

    arch: Literal["llama", "qwen2"] = Field("llama", description="HF architecture family")
    hidden_size: int = Field(128, gt=0, description="width of the residual stream")
    num_layers: int = Field(4, gt=0, description="transformer blocks")
    num_heads: int = Field(4, gt=0, description="attention heads (key/value heads equal)")
    intermediate_size: int = Field(512, gt=0, description="MLP inner width")
    max_position_embeddings: int = Field(256, gt=0, description="longest sequence, in tokens")
    initializer_range: float = Field(
        0.02, gt=0, description="std of the normal init of weight matrices and embeddings"
    )


class ModelConfig(Section):
    """Where the policy comes from.

    ``path`` is a local HF directory or a hub id; ``None`` means: create the tiny model for the
    configured environment (and warm-start it with ``swarmrl sft``, cached by config digest).
    """

    path: str | None = Field(None, description="HF model dir or hub id; None = built-in tiny model")
    warm_start: bool = Field(
        False,
        description="also warm-start a given model.path by SFT on the environment's "
        "demonstrations (sft.*), cached like the tiny model's; the built-in tiny model always is",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the policy is loaded and trained in"
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
