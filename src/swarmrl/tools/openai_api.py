"""An OpenAI-compatible HTTP API over one policy on the built-in torch engine.

Routes (the subset of the OpenAI API that clients use to try a model)::

    GET  /v1/models               the one model served, under its name
    POST /v1/completions          text in, text out: prompt (a string or a list of strings)
    POST /v1/chat/completions     messages in, one assistant message out
    GET  /health                  {"ok": true, "model": …}

Prompts are laid out as training laid them out (``swarmrl.model.prompts``): a tokenizer with a
chat template renders the messages with it; one without gets ``<bos>``, the system text, a
blank line and the rest. Sampling is the engine's seeded Gumbel-max rule (``seed`` makes an
answer repeatable; ``temperature = 0`` is greedy). ``stop`` strings cut the text at the first
match. Bad requests get HTTP 400 with OpenAI's error body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``; ``stream`` is
refused that way (answers are returned whole). Requests are served one at a time: the engine
holds one model and is not shared between threads.

Knows nothing about runs, checkpoints on disk or the command line (``swarmrl.tools.serve``).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import PreTrainedTokenizerBase

from swarmrl.errors import BadRequest
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.prompts import decode_completion, encode_prompt, has_chat_template
from swarmrl.protocol import SamplingParams

MAX_CHOICES = 8
MAX_PROMPTS = 32  # one request may not queue unbounded work on the single engine


class _Sampling(BaseModel):
    """Fields both routes share; other OpenAI fields are accepted and have no effect."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0, description="new tokens at most")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(description="one prompt, or up to MAX_PROMPTS of them")

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


def _text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: the string, or its ``{"type": "text"}`` parts joined."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage]) -> list[int]:
    """Prompt ids of a conversation, in the layout the policy was trained on."""
    pairs = [("system" if m.role == "developer" else m.role, _text(m.content)) for m in messages]
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


def _cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class Policy:
    """One engine and tokenizer answering requests one at a time."""

    def __init__(
        self,
        engine: TorchEngine,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        default_max_tokens: int = 64,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.name = name
        self.default_max_tokens = default_max_tokens
        self.context = int(getattr(engine.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.lock = threading.Lock()

    def complete(
        self, prompt_ids: list[int], req: _Sampling, max_tokens: int | None
    ) -> tuple[list[tuple[str, str]], int]:
        """``n`` answers ``(text, finish_reason)`` and the number of completion tokens."""
        if req.stream:
            raise BadRequest("streaming is not supported; send stream=false", "stream")
        new = max_tokens or self.default_max_tokens
        if len(prompt_ids) + new > self.context:
            raise BadRequest(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({new}) exceeds the model's "
                f"context of {self.context} tokens",
                "max_tokens",
            )
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, max_new_tokens=new)
        base = req.seed if req.seed is not None else secrets.randbits(62)
        seeds = [(base + i) % 2**63 for i in range(req.n)]
        with self.lock:
            generations = self.engine.generate([prompt_ids] * req.n, params, seeds)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        answers, used = [], 0
        for gen in generations:
            used += len(gen.output_tokens)
            text, stopped = _cut_at_stop(
                decode_completion(self.tokenizer, gen.output_tokens), stops
            )
            reason = "stop" if stopped or gen.finish_reason != "length" else "length"
            answers.append((text, reason))
        return answers, used


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _error(status: int, message: str, param: str | None) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


def build_app(policy: Policy) -> FastAPI:
    """The OpenAI-compatible app over ``policy``."""
    app = FastAPI(title="swarmrl serve", docs_url=None, redoc_url=None)

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", ".".join(loc) or None)

    def _check_model(req: _Sampling) -> None:
        if req.model not in (None, policy.name):
            raise BadRequest(f"model {req.model!r} is not served here (try {policy.name!r})")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "model": policy.name}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": policy.name, "object": "model", "created": 0, "owned_by": "swarmrl"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        _check_model(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for prompt in prompts:
            ids = text_prompt(policy.tokenizer, prompt)
            answers, used = policy.complete(ids, req, req.max_tokens)
            prompt_tokens += len(ids) * req.n
            completion_tokens += used
            for text, reason in answers:
                choice = {"index": len(choices), "text": text, "logprobs": None}
                choices.append(choice | {"finish_reason": reason})
        return {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": policy.name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict[str, Any]:
        _check_model(req)
        ids = chat_prompt(policy.tokenizer, req.messages)
        answers, used = policy.complete(ids, req, req.max_completion_tokens or req.max_tokens)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            for i, (text, reason) in enumerate(answers)
        ]
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": policy.name,
            "choices": choices,
            "usage": _usage(len(ids) * req.n, used),
        }

    return app
