"""Character-level tokenizer for the built-in tasks, as a standard HF fast tokenizer.

Each character of ``alphabet`` is one token; ids 0..3 are the special tokens
``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``, and alphabet characters follow in the order given.
Encoding adds no special tokens by itself (callers put ``<bos>``/``<eos>`` where their task
format wants them); decoding fuses characters back without spaces (``decoders.Fuse``).

Knows nothing about tasks or models: it only maps characters to ids and back, and saves/loads
as ordinary HF tokenizer files.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with one token per distinct character of ``alphabet``.

    Duplicate characters are kept once (first occurrence wins). Characters outside the alphabet
    encode to ``<unk>``.
    """
    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        if ch in vocab:
            continue
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character into its own piece; [\s\S] also matches newlines.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
