"""Plain data types of the inference engine: sampling parameters and results.

``SamplingParams`` is what a work unit asks for; ``Generation`` is one sampled completion with
everything a worker reports and a validator replays (tokens, per-token log-probs, final-norm
hidden states); ``Prefill`` is the validator's view of a fixed prompt + completion.

Knows nothing about models, devices or the wire format (see ``swarmrl.protocol``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into tokens (seeded Gumbel-max, see ``swarmrl.inference.sampling``).

    temperature: softmax temperature; 0 means greedy (argmax, log-probs taken at T = 1).
    top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p`` (1 = all).
    top_k: keep the ``top_k`` most likely tokens (0 = all); applied before ``top_p``.
    max_new_tokens: decode at most this many tokens.
    stop_token_ids: extra token ids that end a sequence, besides the engine's EOS id.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass
class Generation:
    """One sampled completion.

    prompt_tokens: the prompt as given (no padding).
    output_tokens: sampled tokens; ends with the stop token when ``finish_reason == "eos"``.
    logprobs: one per output token, natural log, under log_softmax(logits / T) restricted to
        the top-k/top-p set and renormalised (T = 1 when greedy).
    finish_reason: "eos" (a stop token was sampled) or "length" (max_new_tokens reached).
    seed: the sampling seed (the Gumbel noise is a function of seed and decode step only).
    hidden_states: [P + n - 1, hidden] float32 final-norm states at positions
        0 .. P+n-2 of prompt+output (position P-1+j produced output token j); None unless
        requested.
    """

    prompt_tokens: list[int]
    output_tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    seed: int
    hidden_states: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class Prefill:
    """The model's view of a fixed prompt + completion (one forward pass, no sampling).

    logits: [n, vocab] float32; row j holds the logits that produced output token j.
    hidden_states: [P + n - 1, hidden] float32 final-norm states (same positions as
        ``Generation.hidden_states``).
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor


def check_token_ids(tokens: Sequence[int], vocab: int, what: str) -> list[int]:
    """Return ``tokens`` as ints, rejecting ids outside [0, vocab) with a ValueError."""
    out = [int(t) for t in tokens]
    bad = [t for t in out if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} holds token ids outside [0, {vocab}): {bad[:5]}")
    return out
