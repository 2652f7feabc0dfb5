"""How completions are sampled, and how a completion ended: one type each, used everywhere.

:class:`SamplingParams` is the one sampling-parameter type of swarmrl: the pool puts it in a
:class:`~swarmrl.protocol.pool.PoolSpec` and every work unit, the worker hands it to the engine
unchanged, the proof bundle carries it (and its binding digest hashes it, see
``swarmrl.protocol.proofs``), and the validator replays with it. The user-facing
``rl.sampling`` config section (``swarmrl.config.rl.SamplingConfig``) declares a subset of
these fields under the same names, so ``SamplingParams.model_validate(section.model_dump())``
is the whole conversion (the config sits below this package and cannot import it).

:data:`FinishReason` says how a sample ended. Knows nothing about tensors, models or transport.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["eos", "length", "stop"]
"""How a sample ended: ``eos``/``stop``: its last output token is a stop token (the model's EOS
or one of ``stop_token_ids``); ``length``: it reached ``max_new_tokens``. The engine reports
``eos`` for every stop token; ``stop`` is accepted from peers that tell the two apart."""

MAX_NEW_TOKENS = 1_000_000
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class SamplingParams(BaseModel):
    """How to turn logits into tokens (seeded Gumbel-max, ``swarmrl.inference.sampling``).

    Immutable. Unknown fields, NaN and infinities are refused. Example::

        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 16,
         "stop_token_ids": []}
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    temperature: float = Field(
        1.0, ge=0, le=100, description="softmax temperature; 0 = greedy (argmax, log-probs at T=1)"
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="keep the smallest most-likely set of this mass; 1 = all"
    )
    top_k: int = Field(
        0, ge=0, le=1_000_000, description="keep the k most likely, before top_p; 0 = all"
    )
    max_new_tokens: int = Field(16, gt=0, le=MAX_NEW_TOKENS, description="decode limit, tokens")
    stop_token_ids: tuple[TokenId, ...] = Field(
        (), max_length=64, description="token ids that end a sample besides the model's EOS"
    )

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature 0)."""
        return self.temperature == 0.0


__all__ = ["MAX_NEW_TOKENS", "FinishReason", "SamplingParams"]
