"""Prompt and completion text ↔ token ids, the one way every trainer path does it.

Prompt ids are ``<bos>`` (when the tokenizer has one) followed by the prompt's characters or
pieces with no other special tokens; a completion's text is its output ids decoded with special
tokens (EOS, pad) removed. Knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


def decode_completion(tokenizer: PreTrainedTokenizerBase, output_tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(output_tokens), skip_special_tokens=True)

