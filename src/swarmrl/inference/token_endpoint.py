"""A token endpoint over one engine, on loopback: vLLM's ``POST /inference/v1/generate`` wire.

A harness program (``swarmrl.envs.vf1``) asks its model questions through verifiers'
interception, whose train client renders each conversation to token ids with the model's chat
template and posts them here; the engine samples the answer with swarmrl's seeded rule, so
every model call of an episode is replayable from the episode's seed::

    POST /inference/v1/generate   (header X-Session-ID: the episode, verifiers' trace id)
    {"model": "tiny", "token_ids": [22, 26, 23, 6],
     "sampling_params": {"temperature": 1.0, "max_tokens": 8, "seed": 7,
                         "stop_token_ids": [2], "logprobs": 1}}
    -> {"request_id": "…", "prompt_token_ids": [22, 26, 23, 6],
        "choices": [{"index": 0, "token_ids": [16, 2], "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "token_id:16", "logprob": -0.7},
                                              {"token": "token_id:2", "logprob": -0.1}]}}]}

    GET /v1/models -> {"data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]}

Seeding: ``sampling_params.seed`` is the *episode* seed; call k of a session (the k-th request
carrying its ``X-Session-ID``, from 0) samples with ``derive_seed("turn", seed, k)``, the rule of
``swarmrl.protocol.episodes`` and of the colocated driver (``swarmrl.trainer.episodes``). A
request without a seed or a session is refused: a call that cannot be replayed is not sampled.

Sampling keys honoured: ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` (at most
``max_new_tokens``), ``stop_token_ids``, ``seed``; ``logprobs`` (≤ 1: the sampled token's),
``skip_special_tokens``, ``spaces_between_special_tokens``, ``include_stop_str_in_output`` and
verifiers' ``routed_experts_prompt_start`` are accepted and change nothing. Any other key
(``min_p``, penalties, ``n`` > 1 …) is refused rather than silently ignored. A refusal is
HTTP 400 ``{"error": {"message", "type": "invalid_request_error"}}``; a body over
``max_body_bytes`` is 413. A session's calls are sequential (an episode waits for each answer):
a second call of a session while one is in flight is refused.

Batching: one thread drives the engine. Requests that arrive while it is busy are answered
together by its next call (one ``generate`` per sampling setting, at most ``max_batch`` rows);
each row keeps its own seed. A row the engine refuses (token ids outside its vocabulary) is
refused alone: its batch is run again without it.

Every answered call is recorded per session (:meth:`TokenEndpoint.calls`), so the caller can
hold the trace a harness returns against what was really sampled. Given ``prove`` (a worker's
proof builder, :data:`Prover`), the engine also returns hidden
states and each call's proof is recorded beside it (:meth:`TokenEndpoint.proofs`).

Knows nothing about verifiers, harnesses or rewards: token ids in, token ids out.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import ValidationError

from swarmrl.inference.interface import Engine
from swarmrl.inference.types import Generation
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import ModelCall
from swarmrl.protocol.seeds import derive_seed

GENERATE_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
_SAMPLING = {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed"}
_NEUTRAL = {
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "routed_experts_prompt_start",
}
_BODY = {"model", "token_ids", "sampling_params", "cache_salt", "priority"}

# the generations of one engine call (with hidden states) -> one wire proof per generation
Prover = Callable[[list[Generation], SamplingParams], list[dict | str | None]]


class _Refused(Exception):
    """A request this endpoint does not answer; the message goes back to the client."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Server(ThreadingHTTPServer):
    # every episode in flight opens a connection per call: the default backlog of 5 refused
    # connections when a few dozen episodes asked at once
    request_queue_size = 256


@dataclass(eq=False)
class _Call:
    """One request waiting for the engine thread."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    done: threading.Event = field(default_factory=threading.Event)
    generation: Generation | None = None
    proof: dict | str | None = None
    refusal: str = ""
    status: int = 400


class TokenEndpoint:
    """Serves ``engine`` on ``127.0.0.1`` (an ephemeral port) until :meth:`close`."""

    def __init__(
        self,
        engine: Engine,
        defaults: SamplingParams,
        model: str = "policy",
        *,
        max_model_len: int = 4096,
        max_body_bytes: int = 4 << 20,
        request_timeout_s: float = 30.0,
        max_batch: int = 64,
        prove: Prover | None = None,
    ) -> None:
        self.engine, self.defaults, self.model = engine, defaults, model
        self.prove = prove
        self.max_model_len, self.max_body_bytes = max_model_len, max_body_bytes
        self.max_batch = max_batch
        self._lock = threading.Lock()  # guards _calls and _in_flight
        self._calls: dict[str, list[ModelCall]] = defaultdict(list)
        self._proofs: dict[str, list[dict | str | None]] = defaultdict(list)
        self._in_flight: set[str] = set()
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._engine_thread = threading.Thread(
            target=self._drive_engine, name="token-endpoint-engine", daemon=True
        )
        self._engine_thread.start()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # a client that stops sending is dropped

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.rstrip("/") != "/v1/models":
                    self._answer(404, _error(f"no route {self.path}"))
                    return
                card = {
                    "id": endpoint.model,
                    "object": "model",
                    "max_model_len": endpoint.max_model_len,
                }
                self._answer(200, {"object": "list", "data": [card]})

            def do_POST(self) -> None:  # noqa: N802
                try:
                    if self.path != GENERATE_PATH:
                        raise _Refused(f"no route {self.path}", 404)
                    body = self._body()
                    session = self.headers.get(SESSION_HEADER)
                    self._answer(200, endpoint._generate(body, session))
                except _Refused as exc:
                    self._answer(exc.status, _error(str(exc)))

            def _body(self) -> Any:
                try:
                    size = int(self.headers.get("Content-Length", ""))
                except ValueError as exc:
                    raise _Refused("a body with Content-Length is required", 411) from exc
                if size > endpoint.max_body_bytes:
                    self.close_connection = True
                    raise _Refused(f"body over {endpoint.max_body_bytes} bytes", 413)
                try:
                    return json.loads(self.rfile.read(size))
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                    raise _Refused("body is not JSON") from exc

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client went away (its rollout ended)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # refusals are answered to the client; the trace records them

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="token-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``, what an OpenAI-style client is given."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def calls(self, session: str) -> list[ModelCall]:
        """The calls answered for ``session`` so far, in order."""
        with self._lock:
            return list(self._calls.get(session, []))

    def proofs(self, session: str) -> list[dict | str | None]:
        """The proofs of ``session``'s calls, in order (None each without ``prove``)."""
        with self._lock:
            return list(self._proofs.get(session, []))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._queue.put(None)
        self._engine_thread.join(timeout=60)

    def _drive_engine(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # seen again by the outer loop
                    break
                batch.append(more)
            for params in dict.fromkeys(c.params for c in batch):
                self._sample([c for c in batch if c.params == params])

    def _sample(self, calls: list[_Call]) -> None:
        try:
            gens = self.engine.generate(
                [c.prompt for c in calls],
                calls[0].params,
                [c.seed for c in calls],
                return_hidden=self.prove is not None,
            )
            proofs = self.prove(gens, calls[0].params) if self.prove else [None] * len(gens)
        except ValueError as exc:  # a row with token ids outside the vocabulary
            if len(calls) > 1:
                for call in calls:
                    self._sample([call])
                return
            calls[0].refusal = str(exc).splitlines()[0]
            calls[0].done.set()
            return
        except Exception as exc:  # noqa: BLE001 - the engine failed: every waiter hears why
            for call in calls:
                call.refusal, call.status = f"engine failed: {type(exc).__name__}", 500
                call.done.set()
            return
        for call, gen, proof in zip(calls, gens, proofs, strict=True):
            call.generation = replace(gen, hidden_states=None)  # the proof holds what it needs
            call.proof = proof
            call.done.set()

    def _generate(self, body: Any, session: str | None) -> dict[str, Any]:
        if not isinstance(body, dict) or set(body) - _BODY:
            extra = sorted(set(body) - _BODY) if isinstance(body, dict) else "not an object"
            raise _Refused(f"unsupported request fields: {extra}")
        if not session:
            raise _Refused(f"header {SESSION_HEADER} is required (the episode's calls count)")
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
            raise _Refused("token_ids must be a non-empty list of token ids")
        if len(prompt) > self.max_model_len:
            raise _Refused(f"prompt of {len(prompt)} tokens over {self.max_model_len}")
        params, seed = self._params(body.get("sampling_params") or {})
        with self._lock:
            if session in self._in_flight:
                raise _Refused(f"a call of session {session!r} is already in flight")
            self._in_flight.add(session)
            k = len(self._calls[session])
        try:
            call = _Call(list(prompt), params, derive_seed("turn", seed, k))
            self._queue.put(call)
            call.done.wait()  # the engine thread answers every call it takes
            gen = call.generation
            if gen is None:
                raise _Refused(call.refusal, call.status)
            with self._lock:
                self._calls[session].append(
                    ModelCall(list(prompt), list(gen.output_tokens), list(gen.logprobs))
                )
                self._proofs[session].append(call.proof)
        finally:
            with self._lock:
                self._in_flight.discard(session)
        finish = "length" if gen.finish_reason == "length" else "stop"
        content = [
            {"token": f"token_id:{t}", "logprob": lp}
            for t, lp in zip(gen.output_tokens, gen.logprobs, strict=True)
        ]
        choice = {
            "index": 0,
            "token_ids": gen.output_tokens,
            "logprobs": {"content": content},
            "finish_reason": finish,
        }
        return {
            "request_id": uuid.uuid4().hex,
            "prompt_token_ids": list(prompt),
            "choices": [choice],
        }

    def _params(self, raw: Any) -> tuple[SamplingParams, int]:
        if not isinstance(raw, dict):
            raise _Refused("sampling_params must be an object")
        unknown = sorted(set(raw) - _SAMPLING - _NEUTRAL)
        if unknown:
            raise _Refused(f"unsupported sampling parameters: {unknown}")
        if raw.get("logprobs") not in (None, 0, 1):
            raise _Refused("logprobs > 1 is not supported (the sampled token's only)")
        seed = raw.get("seed")
        if type(seed) is not int or not 0 <= seed < 2**63:
            raise _Refused("sampling_params.seed (the episode seed, 0 ≤ seed < 2^63) is required")
        update = {
            "temperature": raw.get("temperature"),
            "top_p": raw.get("top_p"),
            "top_k": raw.get("top_k"),
            "max_new_tokens": raw.get("max_tokens"),
            "stop_token_ids": raw.get("stop_token_ids"),
        }
        merged = self.defaults.model_dump() | {k: v for k, v in update.items() if v is not None}
        try:
            params = SamplingParams.model_validate(merged)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise _Refused(f"sampling_params.{first['loc'][0]}: {first['msg']}") from exc
        if params.max_new_tokens > self.defaults.max_new_tokens:
            raise _Refused(f"max_tokens over this endpoint's {self.defaults.max_new_tokens}")
        return params, seed


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


@contextmanager
def serve_engine(
    engine: Engine, defaults: SamplingParams, model: str = "policy", **kwargs: Any
) -> Iterator[TokenEndpoint]:
    """A :class:`TokenEndpoint` for the duration of the ``with`` block."""
    endpoint = TokenEndpoint(engine, defaults, model, **kwargs)
    try:
        yield endpoint
    finally:
        endpoint.close()
