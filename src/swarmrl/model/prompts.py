"""Prompt and completion text ↔ token ids, the one way every path does it.

The worker (which generates and proves), the validator (which replays) and the trainer (which
computes the loss) all turn a task's prompt into ids here, so they see the same ids.

Layout of the prompt ids:

- a tokenizer **with** a chat template (``tokenizer.chat_template`` set): the template renders
  ``[system?, user]`` messages with the generation prompt appended (``add_generation_prompt``),
  and that text is encoded with no further special tokens (the template writes its own BOS
  when it wants one, so none is added twice);
- a tokenizer **without** one: ``<bos>`` (when the tokenizer has one) followed by the prompt's
  characters or pieces, with no other special tokens; a system prompt then goes before the
  prompt, separated by a blank line.

A completion's text is its output ids decoded with special tokens (EOS, pad, end-of-turn)
removed. Knows nothing about models or environments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from swarmrl.errors import ConfigError


class PromptLike(Protocol):
    """Anything with a prompt text and an optional system prompt (an environment's task)."""

    @property
    def prompt(self) -> str: ...

    @property
    def system(self) -> str | None: ...


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str, system: str | None = None) -> str:
    """The prompt text before encoding: the chat template's rendering, or the plain layout."""
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": text}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(rendered)
    return f"{system}\n\n{text}" if system else text


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | PromptLike, system: str | None = None
) -> list[int]:
    """Prompt ids of ``prompt`` (a text, or a task carrying its own system prompt)."""
    if not isinstance(prompt, str):
        prompt, system = prompt.prompt, prompt.system
    ids = list(tokenizer.encode(render_prompt(tokenizer, prompt, system), add_special_tokens=False))
    if not has_chat_template(tokenizer) and tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str | PromptLike]
) -> list[list[int]]:
    """:func:`encode_prompt` of each of ``prompts``, encoded in one batch (the same ids)."""
    texts = [
        render_prompt(tokenizer, p)
        if isinstance(p, str)
        else render_prompt(tokenizer, p.prompt, p.system)
        for p in prompts
    ]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    bos = (
        []
        if has_chat_template(tokenizer) or tokenizer.bos_token_id is None
        else [int(tokenizer.bos_token_id)]
    )
    return [bos + list(ids) for ids in encoded]


def decode_completion(tokenizer: PreTrainedTokenizerBase, output_tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(output_tokens), skip_special_tokens=True)


def unknown_characters(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """The characters of ``text`` that ``tokenizer`` can only map to its unknown token ("" when
    it has no unknown token, as byte-level tokenizers, or when every character is covered)."""
    unk = tokenizer.unk_token_id
    if unk is None or unk not in tokenizer.encode(text, add_special_tokens=False):
        return ""
    return "".join(
        ch for ch in dict.fromkeys(text) if unk in tokenizer.encode(ch, add_special_tokens=False)
    )


def check_prompts_encodable(
    tokenizer: PreTrainedTokenizerBase, prompts: Iterable[str | PromptLike]
) -> None:
    """Refuse, at start, a tokenizer that would silently turn a task's prompt into unknowns."""
    for i, prompt in enumerate(prompts):
        text = (
            prompt
            if isinstance(prompt, str)
            else render_prompt(tokenizer, prompt.prompt, prompt.system)
        )
        missing = unknown_characters(tokenizer, text)
        if missing:
            raise ConfigError(
                f"the tokenizer cannot encode {missing!r} (prompt {i}: {text[:60]!r}); "
                "choose a model whose tokenizer covers the task's text (model.path)"
            )
