"""An OpenAI-compatible HTTP API over one policy (``swarmrl.tools.openai_policy``).

Routes (the subset of the OpenAI API that clients use to try a model)::

    GET  /v1/models               the one model served, under its name
    POST /v1/completions          text in, text out: prompt (a string or a list of strings)
    POST /v1/chat/completions     messages in, one assistant message per choice out
    GET  /health                  {"ok": true, "model", "requests", "abandoned", "refused"}

``stream: true`` answers with server-sent events in OpenAI's chunk format
(``chat.completion.chunk`` / ``text_completion``), ending with ``data: [DONE]``;
``stream_options.include_usage`` adds a last chunk with the usage. vLLM's ``ignore_eos``
extension is honoured. Other OpenAI fields are accepted and have no effect.

What a client may cost is bounded (``swarmrl.config.serve.ServeLimits``), each limit checked
before the work it bounds: the request head (431, ``swarmrl.protocol.http_limits``), an API key
when one is set (401, before the body is read), the number of requests admitted at once (429),
the body's size and arrival time (413, 408), its JSON (depth, finite numbers, no NUL or lone
surrogate: ``swarmrl.protocol.bounded``), the prompt's length in characters before it is
tokenized, ``max_tokens``, ``n`` and the number of prompts before it waits for the engine (400).
A request whose client disconnects stops generating at the next token. Every refusal is an
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``, logged and counted in
``/health``; ``/health`` never waits for the engine and needs no key.

Knows nothing about runs, checkpoints on disk or the command line (``swarmrl.tools.serve``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from swarmrl.config.serve import ServeLimits
from swarmrl.errors import Abandoned, BadRequest
from swarmrl.tools.openai_policy import (
    Choice,
    Delta,
    Policy,
    Sampling,
    chat_prompt,
    message_texts,
    text_prompt,
)
from swarmrl.tools.openai_wire import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    Shape,
    error_body,
    parse_body,
    sse,
    validated,
)

log = logging.getLogger(__name__)


class _Refused(Exception):
    """A request answered with an HTTP error other than 400 (401, 408, 413, 429)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.kind, self.headers = status, code, kind, headers or {}


async def _watch_disconnect(request: Request, abandoned: threading.Event) -> None:
    """Set ``abandoned`` when the client goes away (the body is read: the next message is
    ``http.disconnect``, which uvicorn sends when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    abandoned.set()


class _Api:
    """The routes' state: the policy, the limits, requests admitted and what was refused."""

    def __init__(self, policy: Policy, limits: ServeLimits) -> None:
        self.policy, self.limits = policy, limits
        self.admitted = 0  # requests between admission and their answer's end
        self.abandoned = 0  # generations stopped (or never started) because the client left
        self.refused: Counter[int] = Counter()  # by HTTP status

    # -- admission and the body -----------------------------------------------------------
    def admit(self) -> None:
        if self.admitted >= self.limits.max_concurrent:
            raise _Refused(
                429,
                f"this server is answering {self.admitted} requests, its limit; try again",
                "rate_limit_exceeded",
                "requests",
                {"Retry-After": "1"},
            )
        self.admitted += 1

    def leave(self) -> None:
        self.admitted -= 1

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise self._too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise self._too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise _Refused(
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                "request_timeout",
                headers={"Connection": "close"},
            ) from None
        return parse_body(b"".join(chunks))

    @staticmethod
    def _too_large(limit: int) -> _Refused:
        return _Refused(
            413,
            f"the request body is over this server's limit of {limit} bytes",
            "request_too_large",
            headers={"Connection": "close"},
        )

    # -- what a request asks for ------------------------------------------------------------
    def sampling(self, req: SamplingFields, max_tokens: int | None) -> Sampling:
        limits = self.limits
        if req.model not in (None, self.policy.name):
            raise BadRequest(
                f"model {req.model!r} is not served here (try {self.policy.name!r})", "model"
            )
        if req.n > limits.max_n:
            raise BadRequest(f"n = {req.n} is over this server's limit of {limits.max_n}", "n")
        new = max_tokens or limits.max_tokens
        if new > limits.max_tokens_limit:
            raise BadRequest(
                f"max_tokens = {new} is over this server's limit of {limits.max_tokens_limit}",
                "max_tokens",
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise BadRequest(
                f"give at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters",
                "stop",
            )
        return Sampling(
            req.temperature,
            req.top_p,
            new,
            req.n,
            req.seed,
            tuple(s for s in stops if s),
            req.ignore_eos,
        )

    def check_length(self, texts: list[str], param: str) -> None:
        chars = sum(len(t) for t in texts)
        if chars > self.limits.max_prompt_chars:
            raise BadRequest(
                f"the prompt is {chars} characters, over this server's limit of "
                f"{self.limits.max_prompt_chars}",
                param,
            )

    async def tokenized(
        self, encode: Callable[[], list[list[int]]], max_new: int
    ) -> list[list[int]]:
        prompts = await anyio.to_thread.run_sync(encode)
        for ids in prompts:
            self.policy.check_fits(ids, max_new)
        return prompts

    # -- answers --------------------------------------------------------------------------
    async def whole(
        self, request: Request, prompts: list[list[int]], sampling: Sampling
    ) -> list[Choice] | None:
        """All choices, or None when the client went away first."""
        abandoned = threading.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, abandoned))
        job = self.policy.submit(prompts, sampling, abandoned)
        try:
            return await asyncio.wrap_future(job)
        except Abandoned:
            self.abandoned += 1
            log.info("stopped a generation: %s", _client(request))
            return None
        finally:
            abandoned.set()  # a task cancelled meanwhile leaves nothing running
            watcher.cancel()

    async def stream(
        self,
        request: Request,
        prompts: list[list[int]],
        sampling: Sampling,
        chunk: Callable[[Delta], dict[str, Any]],
        start: list[dict[str, Any]],
        usage: Callable[[list[Choice]], dict[str, Any]] | None,
    ) -> AsyncGenerator[bytes, None]:
        """Server-sent events: ``start``, a chunk per piece of text, the usage, ``[DONE]``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | None] = asyncio.Queue()
        abandoned = threading.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, abandoned))
        try:
            job = self.policy.submit(
                prompts,
                sampling,
                abandoned,
                lambda d: loop.call_soon_threadsafe(queue.put_nowait, d),
            )
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
            for event in start:
                yield sse(event)
            while (delta := await queue.get()) is not None:
                yield sse(chunk(delta))
            failed = job.exception()
            if isinstance(failed, Abandoned):
                self.abandoned += 1
                log.info("stopped a generation: %s", _client(request))
                return
            if failed is not None:  # our fault, after the 200 went out: say so in the stream
                log.error("generation failed", exc_info=failed)
                yield sse(error_body(f"generation failed: {failed}", "server_error", None, None))
                return
            choices = job.result()
            if usage is not None:
                yield sse(usage(choices))
            yield b"data: [DONE]\n\n"
        finally:
            abandoned.set()
            watcher.cancel()


def _client(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown client"


class _Streamed(Response):
    """A stream of server-sent events; ``on_end`` runs when it ends, however it ends (the
    client gone before the first byte included)."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_end: Callable[[], None]) -> None:
        self.events, self.on_end = events, on_end
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.on_end()
            await self.events.aclose()


class BearerAuth:
    """ASGI middleware: ``/v1/…`` needs ``Authorization: Bearer <key>`` (401 before the body
    is read); ``/health`` is open."""

    def __init__(self, app: Any, key: str, refused: Counter[int]) -> None:
        self.app, self.key, self.refused = app, key.encode(), refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                self.refused[401] += 1
                log.info("refused %s: no valid API key", scope.get("client"))
                body = error_body(
                    "a valid API key is required: send Authorization: Bearer <key>",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                answer = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    policy: Policy, limits: ServeLimits | None = None, api_key: str | None = None
) -> FastAPI:
    """The OpenAI-compatible app over ``policy``; ``api_key``: required of ``/v1`` clients."""
    api = _Api(policy, limits or ServeLimits())
    app = FastAPI(title="swarmrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    if api_key:
        app.add_middleware(BearerAuth, key=api_key, refused=api.refused)

    def refusal(
        request: Request, status: int, body: dict[str, Any], headers: dict[str, str]
    ) -> JSONResponse:
        api.refused[status] += 1
        log.info("refused %s (%d): %s", _client(request), status, body["error"]["message"])
        return JSONResponse(body, status, headers=headers)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        body = error_body(str(exc), "invalid_request_error", exc.param, None)
        return refusal(request, 400, body, {})

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: _Refused) -> JSONResponse:
        return refusal(
            request, exc.status, error_body(str(exc), exc.kind, None, exc.code), exc.headers
        )

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        body = error_body(str(exc.detail), "invalid_request_error", None, None)
        return refusal(request, exc.status_code, body, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refusal(request, 400, error_body(str(exc), "invalid_request_error", None, None), {})

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = error_body(f"the server failed: {type(exc).__name__}", "server_error", None, None)
        return JSONResponse(body, 500)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=400)  # nobody reads it: the client left while sending

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "ok": True,
            "model": policy.name,
            "requests": api.admitted,
            "abandoned": api.abandoned,
            "refused": {str(k): v for k, v in sorted(api.refused.items())},
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": policy.name, "object": "model", "created": 0, "owned_by": "swarmrl"}
        return {"object": "list", "data": [card]}

    async def answer(request: Request, kind: Literal["chat", "text"]) -> Response:
        api.admit()
        streaming = False
        try:
            data = await api.read_json(request)
            if kind == "chat":
                chat = validated(ChatRequest, data)
                req: SamplingFields = chat
                sampling = api.sampling(chat, chat.max_completion_tokens or chat.max_tokens)
                pairs = message_texts([(m.role, m.content) for m in chat.messages])
                api.check_length([c for _, c in pairs], "messages")
                prompts = await api.tokenized(
                    lambda: [chat_prompt(policy.tokenizer, pairs)], sampling.max_new_tokens
                )
            else:
                text = validated(CompletionRequest, data)
                req = text
                sampling = api.sampling(text, text.max_tokens)
                texts = [text.prompt] if isinstance(text.prompt, str) else text.prompt
                if not 1 <= len(texts) <= api.limits.max_prompts:
                    raise BadRequest(f"give 1 to {api.limits.max_prompts} prompts", "prompt")
                api.check_length(texts, "prompt")
                prompts = await api.tokenized(
                    lambda: [text_prompt(policy.tokenizer, t) for t in texts],
                    sampling.max_new_tokens,
                )
            shape = Shape(kind, policy.name, sum(len(p) for p in prompts) * sampling.n)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                events = api.stream(
                    request,
                    prompts,
                    sampling,
                    shape.chunk,
                    shape.start(len(prompts) * sampling.n),
                    shape.usage_chunk if include_usage else None,
                )
                streaming = True  # the stream leaves admission when it ends
                return _Streamed(events, api.leave)
            choices = await api.whole(request, prompts, sampling)
            if choices is None:
                return Response(status_code=400)  # nobody reads it: the client left
            return JSONResponse(shape.whole(choices))
        finally:
            if not streaming:
                api.leave()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, "text")

    return app
