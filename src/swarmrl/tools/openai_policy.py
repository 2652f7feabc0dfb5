"""One policy answering OpenAI-style requests: prompt ids, generation on one engine thread, text
as it is decoded, stop strings, and requests abandoned mid-way.

Prompts are laid out as training laid them out (``swarmrl.model.prompts``): a tokenizer with a
chat template renders the messages with it; one without gets ``<bos>``, the system text, a
blank line and the rest. Sampling is the engine's seeded Gumbel-max rule (``seed`` makes an
answer repeatable; ``temperature = 0`` is greedy).

Every generation runs on the one engine thread (the engine holds one model and is not shared
between threads), in the order submitted. After each output token the engine calls back
(``TorchEngine.generate(on_step=…)``): the new tokens are decoded and their text handed to
``emit`` as ``(choice index, text, finish_reason or None)``, held back while it could still be
the start of a stop string or is an incomplete character. A request whose ``abandoned`` event is
set (its client went away) stops at the next token with :class:`Abandoned`, or does not start.
A choice ends with ``finish_reason`` "stop" (the model's EOS, or a stop string, which is cut
off) or "length" (``max_new_tokens`` reached); generation ends as soon as every choice has.

Knows nothing about HTTP (``swarmrl.tools.openai_api``), limits of a request's size, runs or the
command line.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from swarmrl.errors import Abandoned, BadRequest
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.prompts import decode_completion, encode_prompt, has_chat_template
from swarmrl.protocol import SamplingParams

Delta = tuple[int, str, str | None]  # (choice index, new text, finish_reason once it ends)


class _AllFinished(Exception):
    """Every choice has ended (stop strings) before the engine's own end: stop it early."""


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the engine, already checked against the server's limits."""

    temperature: float
    top_p: float
    max_new_tokens: int
    n: int  # completions per prompt
    seed: int | None  # None: a random one; choice i of a prompt samples with seed + i
    stops: tuple[str, ...] = ()  # text that ends a choice (cut off)
    ignore_eos: bool = False  # only max_new_tokens and stop strings end a choice


@dataclass
class Choice:
    """One completion as it is generated."""

    index: int  # OpenAI's choice index: prompt number × n + i
    tokens: list[int] = field(default_factory=list)  # output ids, a final EOS included
    text: str = ""  # decoded so far; cut before a stop string once one appeared
    sent: int = 0  # characters of ``text`` already emitted
    prefix: int = 0  # tokens[prefix:read] are decoded again beside each new token
    read: int = 0  # tokens[:read] are in ``text``
    finish_reason: str | None = None  # "stop" or "length" once ended


def _text(content: str | list[dict[str, object]]) -> str:
    """A message's text: the string, or its ``{"type": "text"}`` parts joined."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        text = part.get("text")
        if part.get("type") != "text" or not isinstance(text, str):
            raise BadRequest("only text content parts are supported", "messages")
        parts.append(text)
    return "".join(parts)


def message_texts(
    messages: Sequence[tuple[str, str | list[dict[str, object]]]],
) -> list[tuple[str, str]]:
    """``(role, content)`` pairs as ``(role, text)``, the "developer" role read as "system"."""
    return [("system" if role == "developer" else role, _text(c)) for role, c in messages]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str]]) -> list[int]:
    """Prompt ids of a conversation of ``(role, text)`` pairs, laid out as in training."""
    if has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in pairs],
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(tokenizer.encode(str(rendered), add_special_tokens=False))
    system = "\n\n".join(c for r, c in pairs if r == "system") or None
    text = "\n\n".join(c for r, c in pairs if r != "system")
    return encode_prompt(tokenizer, text, system)


def text_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Prompt ids of raw text: ``<bos>`` (when the tokenizer has one) and the text's pieces."""
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    if tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


class Policy:
    """One engine and tokenizer; generations run one after another on the engine thread."""

    def __init__(self, engine: TorchEngine, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.name = name
        self.context = int(getattr(engine.model.config, "max_position_embeddings", 0) or 1 << 30)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve-engine")
        self._closing = threading.Event()  # set: a running generation stops at its next token

    def check_fits(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for ``max_new_tokens`` in the model's context."""
        if len(prompt_ids) + max_new_tokens > self.context:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_new_tokens}) exceeds "
                f"the model's context of {self.context} tokens",
                "max_tokens",
            )

    def submit(
        self,
        prompts: Sequence[list[int]],
        sampling: Sampling,
        abandoned: threading.Event,
        emit: Callable[[Delta], None] | None = None,
    ) -> Future[list[Choice]]:
        """Queue the ``n`` choices of each prompt for the engine thread; the future holds them
        all (prompt by prompt), or :class:`Abandoned` once ``abandoned`` was set."""
        return self._thread.submit(self._generate, prompts, sampling, abandoned, emit)

    def close(self) -> None:
        """Stop generating: those queued are dropped, a running one stops at its next token."""
        self._closing.set()
        self._thread.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread ----------------------------------------------------------------
    def _generate(
        self,
        prompts: Sequence[list[int]],
        sampling: Sampling,
        abandoned: threading.Event,
        emit: Callable[[Delta], None] | None,
    ) -> list[Choice]:
        choices: list[Choice] = []
        base = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        seeds = [(base + i) % 2**63 for i in range(sampling.n)]
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
        )
        for ids in prompts:
            if abandoned.is_set():
                raise Abandoned("the client went away before its generation ended")
            batch = [Choice(len(choices) + i) for i in range(sampling.n)]
            choices.extend(batch)
            _Decoder(self, batch, sampling, abandoned, emit).run(ids, params, seeds)
        return choices


class _Decoder:
    """Turns the engine's tokens for one prompt's choices into text, as they come."""

    def __init__(
        self,
        policy: Policy,
        choices: list[Choice],
        sampling: Sampling,
        abandoned: threading.Event,
        emit: Callable[[Delta], None] | None,
    ) -> None:
        self.policy, self.choices, self.sampling = policy, choices, sampling
        self.abandoned, self.emit = abandoned, emit
        self.eos = set() if sampling.ignore_eos else set(policy.engine.eos_ids)
        # text that could still grow into a stop string is held back this many characters
        self.hold = max((len(s) for s in sampling.stops), default=1) - 1

    def run(self, prompt_ids: list[int], params: SamplingParams, seeds: list[int]) -> None:
        try:
            self.policy.engine.generate(
                [prompt_ids] * len(self.choices),
                params,
                seeds,
                ignore_eos=self.sampling.ignore_eos,
                on_step=self._step,
            )
        except _AllFinished:
            pass
        for choice in self.choices:  # the engine ran to max_new_tokens (or stopped early)
            if choice.finish_reason is None:
                self._finish(choice, "length")

    def _step(self, t: int, rows: list[int], tokens: list[int]) -> None:
        if self.abandoned.is_set() or self.policy._closing.is_set():
            raise Abandoned("the client went away, or the server is stopping")
        for row, token in zip(rows, tokens, strict=True):
            choice = self.choices[row]
            if choice.finish_reason is None:
                self._advance(choice, token)
        if all(c.finish_reason is not None for c in self.choices):
            raise _AllFinished

    def _advance(self, choice: Choice, token: int) -> None:
        choice.tokens.append(token)
        before = len(choice.text)
        choice.text += self._new_text(choice)
        # a stop string ending in the new text starts at most (longest stop - 1) chars earlier
        tail = max(0, before - self.hold)
        cuts = [i for i in (choice.text.find(s, tail) for s in self.sampling.stops) if i >= 0]
        if cuts:
            choice.text = choice.text[: min(cuts)]
            self._finish(choice, "stop", cut=True)
        elif token in self.eos:
            self._finish(choice, "stop")
        elif len(choice.tokens) >= self.sampling.max_new_tokens:
            self._finish(choice, "length")
        elif len(choice.text) - self.hold > choice.sent:
            safe = len(choice.text) - self.hold
            self._send(choice, choice.text[choice.sent : safe], None)
            choice.sent = safe

    def _new_text(self, choice: Choice, final: bool = False) -> str:
        """The text the newest tokens add. ``tokens[prefix:]`` are decoded again with each new
        token, beside ``tokens[prefix:read]`` alone (a token may be part of a character, or
        change how its neighbour reads), so a step decodes a few tokens, not the completion;
        ``final``: whatever is left, an incomplete character included."""
        tokenizer, tokens = self.policy.tokenizer, choice.tokens
        known = decode_completion(tokenizer, tokens[choice.prefix : choice.read])
        full = decode_completion(tokenizer, tokens[choice.prefix :])
        if not final and (len(full) <= len(known) or full.endswith("\ufffd")):
            return ""  # nothing yet, or a character still arriving
        choice.prefix, choice.read = choice.read, len(tokens)
        return full[len(known) :]

    def _finish(self, choice: Choice, reason: str, cut: bool = False) -> None:
        if not cut and choice.read < len(choice.tokens):
            choice.text += self._new_text(choice, final=True)
        choice.finish_reason = reason
        rest = choice.text[choice.sent :]
        choice.sent = len(choice.text)
        self._send(choice, rest, reason)

    def _send(self, choice: Choice, text: str, reason: str | None) -> None:
        if self.emit is not None:
            self.emit((choice.index, text, reason))
