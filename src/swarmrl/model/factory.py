"""Create the random-init tiny policy used by the built-in tasks.

A standard ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (Qwen2 = Llama plus q/k/v biases) with
tied input/output embeddings, sized by ``TinyModelConfig`` and the tokenizer's vocabulary.
Weights come from the global torch RNG: the caller seeds it (``torch.manual_seed``).

Knows nothing about training, tasks or where the model is stored.
"""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from swarmrl.config.model import TinyModelConfig


def tiny_model_config(
    tiny: TinyModelConfig, tokenizer: PreTrainedTokenizerBase
) -> LlamaConfig | Qwen2Config:
    """The HF config of the tiny model (no weights allocated)."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-6,
        initializer_range=tiny.initializer_range,
    )
    if tiny.arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, use_sliding_window=False)


def create_tiny_model(tiny: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised tiny causal LM in float32 on CPU, in eval mode."""
    config = tiny_model_config(tiny, tokenizer)
    cls = LlamaForCausalLM if tiny.arch == "llama" else Qwen2ForCausalLM
    model = cls(config)
    model.eval()
    return model
