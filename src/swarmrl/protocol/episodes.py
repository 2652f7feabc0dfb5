"""Wire type of a multi-turn episode: model turns and environment turns as token sequences.

An episode is what a policy and an environment wrote together, turn by turn. It is recorded as
the model calls that made it: call k's prompt (the whole conversation so far, rendered) and the
tokens it sampled. Consecutive calls whose prompts extend each other exactly are one token
sequence, a *segment*::

    segment.tokens  = [context ............][model 0 ..][env 0 ....][model 1 ..]
    segment.turns   = context 0:P, model P:P+a, env P+a:P+a+b, model ...   (contiguous spans)
    model mask      = 1 on the model turns' tokens, 0 on context and environment tokens
    logprobs        = one per model token, in order (the behaviour log-probs of the sampling)

When a later call's prompt does *not* extend the earlier tokens (a chat template that renders
earlier turns differently once later turns exist, e.g. one that drops an earlier answer's
reasoning), a new segment starts whose context is that re-rendered prompt: each segment holds
exactly the tokens the model saw when it sampled, never a rendering it did not see. A segment
is one training sample; the samples of an episode share its reward.

Example (character vocabulary, ``tool_arith``; ``2`` is EOS)::

    {"seed": 77, "reward": 1.0, "segments": [{
      "tokens":  [1, 7,8,9,...,  14,15,7,...,16,2,   17,6,...,18,   6,...,2],
      "turns":   [{"role": "context", "start": 0, "end": 9},
                  {"role": "model", "start": 9, "end": 21},
                  {"role": "env", "start": 21, "end": 29},
                  {"role": "model", "start": 29, "end": 36}],
      "logprobs": [-0.01, ...]}]}                            (19 values: 12 + 7 model tokens)

Knows nothing about tokenizers, environments or models: it is token ids and spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TurnRole = Literal["context", "model", "env"]
MAX_EPISODE_TOKENS = 1_000_000


@dataclass(frozen=True)
class ModelCall:
    """One generation of an episode: the prompt it was given and what it sampled."""

    prompt_tokens: list[int]  # [P_k] the whole conversation before this turn, rendered
    output_tokens: list[int]  # [n_k] sampled, ending with the stop token when it stopped
    logprobs: list[float]  # [n_k] behaviour log-probs of output_tokens


class EpisodeTurn(BaseModel):
    """A span ``[start, end)`` of a segment's tokens and who wrote it."""

    model_config = ConfigDict(extra="forbid")

    role: TurnRole = Field(
        description="context: the rendered prompt a segment opens with (never trained); model: "
        "sampled by the policy; env: written by the environment (a tool result, feedback)"
    )
    start: int = Field(ge=0, description="first token of the turn, index into the segment")
    end: int = Field(ge=0, description="one past the turn's last token")


class EpisodeSegment(BaseModel):
    """One token sequence of an episode (one training sample)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tokens: list[int] = Field(max_length=MAX_EPISODE_TOKENS, description="[L] token ids")
    turns: list[EpisodeTurn] = Field(
        max_length=10_000, description="contiguous spans covering tokens, context first"
    )
    logprobs: list[float] = Field(
        max_length=MAX_EPISODE_TOKENS, description="[model tokens] nats, in sequence order"
    )

    @model_validator(mode="after")
    def _spans(self) -> EpisodeSegment:
        if not self.turns or self.turns[0].role != "context" or self.turns[0].start != 0:
            raise ValueError("a segment opens with a context turn starting at token 0")
        for before, turn in zip(self.turns, self.turns[1:], strict=False):
            if turn.start != before.end:
                raise ValueError(f"turn spans are not contiguous at token {turn.start}")
        for turn in self.turns:
            if turn.end < turn.start or (turn.end == turn.start and turn.role != "env"):
                raise ValueError(f"{turn.role} turn at token {turn.start} is empty or reversed")
            if turn.role == "context" and turn is not self.turns[0]:
                raise ValueError("only a segment's first turn is context")
        if self.turns[-1].end != len(self.tokens):
            raise ValueError(f"turns cover {self.turns[-1].end} of {len(self.tokens)} tokens")
        if len(self.logprobs) != sum(self.model_mask()):
            raise ValueError(
                f"{len(self.logprobs)} log-probs for {sum(self.model_mask())} model tokens"
            )
        return self

    def model_mask(self) -> list[int]:
        """[L] 1 where the policy sampled the token, 0 on context and environment tokens."""
        mask = [0] * len(self.tokens)
        for turn in self.turns:
            if turn.role == "model":
                mask[turn.start : turn.end] = [1] * (turn.end - turn.start)
        return mask

    def span(self, turn: EpisodeTurn) -> list[int]:
        return self.tokens[turn.start : turn.end]


class Episode(BaseModel):
    """A whole episode: its segments in order, its seed and (once scored) its reward."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(
        ge=0, lt=2**63, description="episode seed; call k samples with derive_seed('turn', seed, k)"
    )
    segments: list[EpisodeSegment] = Field(min_length=1, max_length=1_000)
    reward: float | None = Field(
        None,
        description="reward of the whole episode in [0, 1], computed on the trusted side; "
        "None: not scored yet",
    )

    def turns(self) -> list[tuple[int, EpisodeTurn]]:
        """Every turn as ``(segment index, turn)``, in order."""
        return [(i, t) for i, seg in enumerate(self.segments) for t in seg.turns]

    def calls(self) -> list[ModelCall]:
        """The model calls the episode claims: each model turn with the tokens before it in its
        segment as the prompt, and its share of the segment's log-probs."""
        out = []
        for seg in self.segments:
            used = 0
            for turn in seg.turns:
                if turn.role != "model":
                    continue
                n = turn.end - turn.start
                out.append(
                    ModelCall(
                        seg.tokens[: turn.start], seg.span(turn), seg.logprobs[used : used + n]
                    )
                )
                used += n
        return out

    def model_turns(self) -> int:
        return sum(1 for _, t in self.turns() if t.role == "model")

    def budget_tokens(self) -> int:
        """Tokens that count against an environment's token budget: model and env turns."""
        return sum(t.end - t.start for _, t in self.turns() if t.role != "context")


def episode_from_calls(
    calls: Sequence[ModelCall], seed: int, reward: float | None = None
) -> Episode:
    """The episode of ``calls`` (in order): one segment while each prompt extends the tokens
    before it exactly, its extra tokens the environment's turn; a new segment where it does not
    (module docstring)."""
    if not calls:
        raise ValueError("an episode has at least one model call")
    segments: list[EpisodeSegment] = []
    tokens: list[int] = []
    turns: list[EpisodeTurn] = []
    logprobs: list[float] = []
    for call in calls:
        if len(call.logprobs) != len(call.output_tokens):
            raise ValueError("one log-prob per output token needed")
        prompt = list(call.prompt_tokens)
        if turns and prompt[: len(tokens)] == tokens:
            turns.append(EpisodeTurn(role="env", start=len(tokens), end=len(prompt)))
        else:
            if turns:
                segments.append(EpisodeSegment(tokens=tokens, turns=turns, logprobs=logprobs))
            turns, logprobs = [EpisodeTurn(role="context", start=0, end=len(prompt))], []
        tokens = prompt + list(call.output_tokens)
        turns.append(EpisodeTurn(role="model", start=len(prompt), end=len(tokens)))
        logprobs = logprobs + list(call.logprobs)
    segments.append(EpisodeSegment(tokens=tokens, turns=turns, logprobs=logprobs))
    return Episode(seed=seed, segments=segments, reward=reward)
