"""The forward pass the engine drives: a Protocol, and the generic transformers fallback.

A backbone runs a causal LM over a left-padded batch with a key/value cache and returns the
final-norm hidden states (the LM-head input) plus logits where asked. Two implementations:
``swarmrl.inference.llama.LlamaBackbone`` (a lean forward for Llama/Qwen2 weights) and
``HFBackbone`` below (any ``transformers`` causal LM through its own ``forward`` and cache).

Knows nothing about sampling, seeds or results; the engine owns those.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

LogitsAt = Literal["last", "all", "none"]


class Backbone(Protocol):
    """One causal-LM forward over a slice of positions, filling a cache as it goes."""

    vocab_size: int
    hidden_size: int

    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty cache for ``batch`` rows of up to ``max_len`` positions."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor | None,
        cache: Any,
        start: int,
        logits_at: LogitsAt,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run positions ``start .. start+S-1`` of every row.

        tokens: int64 [B, S]; positions: int64 [B, S] rotary positions (left padding excluded);
        key_valid: bool [B, start+S], False at padding, or None when no row is padded; cache: from ``new_cache`` (the slots
        ``start .. start+S-1`` get written). Returns (final-norm hidden [B, S, hidden] in the
        model dtype, float32 logits [B, vocab] for "last", [B, S, vocab] for "all", or None).
        """
        ...

    def select_rows(self, cache: Any, rows: torch.Tensor) -> Any:
        """The cache of only ``rows`` (int64 [B']), in that order, for a shrunken batch."""
        ...

    def reload(self) -> None:
        """Re-read weights from the wrapped model after they changed."""
        ...


class HFBackbone:
    """Any transformers causal LM, driven through its own forward and ``DynamicCache``."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        # transformers 5 renamed `past_key_values` to `cache`; accept either.
        names = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"

    def new_cache(self, batch: int, max_len: int) -> DynamicCache:
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor | None,
        cache: Any,
        start: int,
        logits_at: LogitsAt,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.model(
            input_ids=tokens,
            attention_mask=key_valid.long() if key_valid is not None else None,
            position_ids=positions,
            use_cache=cache is not None,
            output_hidden_states=True,
            logits_to_keep=1 if logits_at == "last" else 0,
            **{self._cache_arg: cache},
        )
        hidden = out.hidden_states[-1]  # [B, S, hidden], post final norm in HF causal LMs
        if logits_at == "none":
            return hidden, None
        logits = out.logits.float()
        return hidden, logits[:, -1] if logits_at == "last" else logits

    def select_rows(self, cache: Any, rows: torch.Tensor) -> Any:
        cache.batch_select_indices(rows)
        return cache

    def reload(self) -> None:
        """Nothing to do: the forward reads the module's parameters directly."""
