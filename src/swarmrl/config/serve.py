"""What ``swarmrl serve`` lets one client cost it: sizes, lengths, counts and time.

Every limit is checked as early as it can be: the request head and body sizes before the body is
parsed, the prompt's length in characters before it is tokenized, ``max_tokens`` and ``n``
before the request waits for the engine. Each field is a flag of ``swarmrl serve``
(``max_body_bytes`` is ``--max-body-bytes``). Not part of a run's config: a run does not decide
who may reach a server started over it later.

Knows nothing about HTTP or models; imports no torch.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from swarmrl.config.base import Section


class ServeLimits(Section):
    """Bounds of the torch engine's OpenAI-compatible server (``swarmrl.tools.openai_api``)."""

    max_head_bytes: int = Field(
        32 << 10, ge=1024, description="largest request head (request line + headers), bytes"
    )
    head_timeout_s: float = Field(
        10.0, gt=0, description="time a connection has to send a complete request head, s"
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="largest request body, bytes; more is answered 413"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="time a request has to send its body once its head is in, s"
    )
    max_prompt_chars: int = Field(
        65536,
        gt=0,
        description="longest prompt text of one request (all messages or prompts), characters; "
        "checked before tokenizing",
    )
    max_tokens: int = Field(64, gt=0, description="new tokens a request gets when it names none")
    max_tokens_limit: int = Field(
        1024, gt=0, description="most new tokens a request may ask for (max_tokens)"
    )
    max_n: int = Field(8, gt=0, description="most completions a request may ask for per prompt (n)")
    max_prompts: int = Field(32, gt=0, description="most prompts in one /v1/completions request")
    max_concurrent: int = Field(
        8,
        gt=0,
        description="requests admitted at once (reading, waiting for the engine or generating); "
        "more are answered 429",
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> ServeLimits:
        if self.max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) is over max_tokens_limit ({self.max_tokens_limit})"
            )
        return self
