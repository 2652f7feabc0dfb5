"""Prompt and completion text ↔ token ids, the one way every trainer path does it.

Prompt ids are ``<bos>`` (when the tokenizer has one) followed by the prompt's characters or
pieces with no other special tokens; a completion's text is its output ids decoded with special
tokens (EOS, pad) removed. Knows nothing about models.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


def decode_completion(tokenizer: PreTrainedTokenizerBase, output_tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(output_tokens), skip_special_tokens=True)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (same on every machine)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)
