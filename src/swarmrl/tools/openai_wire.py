"""OpenAI's wire format as ``swarmrl serve`` speaks it: request bodies, answers, stream chunks
and error bodies.

A request body is parsed as a bounded JSON value first (:func:`parse_body`: depth, finite
numbers, no NUL or lone surrogate, ``swarmrl.protocol.bounded``), then validated strictly
(``"n": "2"`` is refused, not read as 2): a malformed body is a :class:`BadRequest` naming the
field. Fields OpenAI defines that the server does not implement are accepted and ignored.

Knows nothing about HTTP servers, engines or limits of a deployment (``swarmrl.tools.openai_api``).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmrl.errors import BadRequest
from swarmrl.protocol.bounded import check_json
from swarmrl.tools.openai_policy import Choice, Delta

_M = TypeVar("_M", bound=BaseModel)

MAX_STOPS = 4  # as OpenAI: up to four stop strings
MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both routes share; other OpenAI fields are accepted and have no effect."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0, description="new tokens at most")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: run every choice to max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(description="one prompt, or a list of them")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# the codes of the refusals the HTTP layer answers before the app sees a request
HTTP_REFUSAL_CODES = {
    400: "invalid_request",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_too_large",
}


def openai_refusal(status: int, message: str) -> tuple[bytes, bytes]:
    """A refusal of the HTTP layer (``swarmrl.protocol.http_limits``) as an OpenAI error body,
    so a client sees one error shape whichever layer answered."""
    body = error_body(message, "invalid_request_error", None, HTTP_REFUSAL_CODES.get(status))
    return b"application/json", json.dumps(body).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object, refused (400) unless it is a bounded JSON value."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("the body nests too deeply to be a request") from None
    except ValueError as exc:  # not JSON, not UTF-8, NaN or Infinity
        raise BadRequest(f"the body is not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        check_json(data)
    except ValueError as exc:
        raise BadRequest(f"the body is refused: {exc}") from None
    return data


def validated(model: type[_M], data: dict[str, Any]) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{loc or 'body'}: {first['msg']}", loc or None) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


class Shape:
    """OpenAI's response bodies and stream chunks for one request."""

    def __init__(self, kind: Literal["chat", "text"], model: str, prompt_tokens: int) -> None:
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())
        self.completion_tokens = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        used = sum(len(c.tokens) for c in choices)
        if self.kind == "chat":
            body = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            head = self._head("chat.completion")
        else:
            body = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            head = self._head("text_completion")
        return head | {"choices": body, "usage": usage(self.prompt_tokens, used)}

    def start(self, n: int) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if self.kind != "chat":
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._chunk(i, delta, None) for i in range(n)]

    def chunk(self, delta: Delta) -> dict[str, Any]:
        index, text, reason = delta
        return self._chunk(index, {"content": text} if text else {}, reason, text)

    def _chunk(
        self, index: int, delta: dict[str, Any], reason: str | None, text: str = ""
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        used = sum(len(c.tokens) for c in choices)
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(self.prompt_tokens, used)}
