"""Plain data types of the inference engine's results.

``Generation`` is one sampled completion with everything a worker reports and a validator
replays (tokens, per-token log-probs, final-norm hidden states); ``Prefill`` is the validator's
view of a fixed prompt + completion. The engine is asked with the one sampling-parameter type,
``swarmrl.protocol.SamplingParams``, exactly as a work unit carries it.

Knows nothing about models, devices or how results travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarmrl.protocol.sampling import FinishReason


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
