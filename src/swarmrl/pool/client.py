"""Clients of the orchestrator API for nodes, validators and the trainer.

``PoolClient(url, keypair)`` is synchronous and thread-safe; many clients (identities) may share
one connection pool, and asyncio code runs its calls in threads (``asyncio.to_thread``, as
``bench/pool.py`` does). Every request is signed (``swarmrl.identity.requests``) and bounded by
``timeout_s``. A refusal (4xx) raises the error type its code names (``swarmrl.pool.rejections``:
``NodeBanned``, ``NotFound``…, all :class:`swarmrl.errors.PeerError`), its message the call and
the server's reason; no answer in time or a 5xx raises :class:`swarmrl.errors.PeerUnavailable`
naming the call.

Clock skew: the orchestrator accepts a signed request dated at most ``request_window_s`` behind
and ``request_future_skew_s`` ahead of its own clock (60 s and 5 s by default), and a
volunteer's clock can be further off than that. The client learns the server's clock from the
``Date`` header of every answer (1 s resolution) and, where it differs from its own by more
than :data:`SKEW_TOLERANCE_S`, signs with its own clock shifted by the difference. A request
refused for its timestamp (the first one, before any answer was seen) is signed again, once,
with the offset that refusal taught. Replay stays closed: the server's window and nonces are
unchanged, and a shifted timestamp is still the server's "now".
Knows the wire types, nothing about how the orchestrator decides.
"""

from __future__ import annotations

import logging
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from swarmrl import __version__
from swarmrl.errors import PeerUnavailable, ProtocolMismatch, Rejected, ReplayedRequest, SwarmError
from swarmrl.identity.keys import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.rejections import refusal
from swarmrl.protocol.batches import (
    BatchAck,
    BatchAckReceipt,
    BatchReply,
    BatchRequest,
    TrainerProgress,
    VersionUpdate,
)
from swarmrl.protocol.pool import (
    PROTOCOL_VERSION,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    InvalidateRequest,
    Invite,
    JoinRequest,
    LeaseReply,
    NodeLogs,
    NodeMetadata,
    NodeView,
    PoolInfo,
    PoolMetrics,
    PoolSpec,
    RejoinRequest,
    Submission,
    SubmissionReceipt,
)
from swarmrl.protocol.verdicts import (
    ClaimReply,
    ClaimRequest,
    PendingSubmission,
    Verdict,
    VerdictReceipt,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
# A ``Date`` header says the server's second; a difference within this is not acted on.
SKEW_TOLERANCE_S = 2.0
_NODES = TypeAdapter(list[NodeView])
_POOLS = TypeAdapter(list[PoolInfo])


class _Base:
    def __init__(
        self,
        url: str,
        keypair: KeyPair,
        timeout_s: float = 30.0,
        clock: Any = time.time,
    ) -> None:
        """``clock``: this machine's wall clock (Unix seconds), which may be off."""
        self.url = url.rstrip("/")
        self.keypair = keypair
        self.timeout_s = timeout_s
        self.clock = clock
        self.clock_offset_s = 0.0  # the server's clock minus ours, once learnt
        self._clock_lock = threading.Lock()

    def _learn_clock(self, response: httpx.Response, sent_at: float, received_at: float) -> None:
        """Take the server's clock from ``response``'s ``Date`` header (module docstring)."""
        date = response.headers.get("date")
        if not date:
            return
        try:
            server_s = parsedate_to_datetime(date).timestamp() + 0.5  # within its second
        except (TypeError, ValueError):
            return
        offset = server_s - (sent_at + received_at) / 2
        with self._clock_lock:
            if abs(offset - self.clock_offset_s) <= SKEW_TOLERANCE_S:
                return
            self.clock_offset_s = offset if abs(offset) > SKEW_TOLERANCE_S else 0.0
        if self.clock_offset_s:
            log.info(
                "this machine's clock is %.0f s %s the orchestrator's at %s; requests are signed "
                "in the orchestrator's time",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
                self.url,
            )
        else:
            log.info("this machine's clock agrees with the orchestrator's at %s again", self.url)

    def server_time(self) -> float:
        """The orchestrator's clock as this client knows it (Unix seconds): this machine's
        clock shifted by the offset learnt from the orchestrator's answers. Deadlines the
        orchestrator sets (a lease's) are in its time."""
        return self.clock() + self.clock_offset_s

    def _prepare(
        self, method: str, path: str, payload: BaseModel | None
    ) -> tuple[str, bytes, dict[str, str]]:
        body = b"" if payload is None else payload.model_dump_json().encode()
        headers = sign_request(self.keypair, method, path, body, now_s=self.server_time())
        if payload is not None:
            headers["Content-Type"] = "application/json"
        return self.url + path, body, headers

    def _parse(self, call: str, response: httpx.Response, adapter: Any) -> Any:
        if response.status_code >= 500:
            raise PeerUnavailable(f"orchestrator {self.url} failed {call}: {response.status_code}")
        if response.status_code >= 400:
            try:
                error = ErrorReply.model_validate_json(response.content).error
                code, message = error.code, error.message
            except ValidationError:  # not the pool's answer (a proxy, a truncated body)
                code, message = Rejected.code, f"HTTP {response.status_code}: {response.text[:500]}"
            raise refusal(code, f"{call}: {message}")
        if adapter is None:
            return response.json()
        try:
            if isinstance(adapter, TypeAdapter):
                return adapter.validate_json(response.content)
            return adapter.model_validate_json(response.content)
        except ValidationError as exc:
            raise self._unreadable(call, exc) from exc

    def _unreadable(self, call: str, exc: ValidationError) -> SwarmError:
        """The error for an answer this client cannot read: an upgrade, where the orchestrator
        speaks a newer protocol (``PROTOCOL_VERSION``), else an unavailable peer."""
        first = str(exc).splitlines()
        what = f"{first[0]}: {first[1]}" if len(first) > 1 else str(exc)
        try:
            theirs = int(self._send("GET", "/health", None, None, 0.0).get("protocol", 0))
        except (SwarmError, TypeError, ValueError, AttributeError):
            theirs = 0
        if theirs > PROTOCOL_VERSION:
            return ProtocolMismatch(
                f"{call}: the orchestrator at {self.url} speaks pool protocol {theirs}, this "
                f"swarmrl {__version__} speaks {PROTOCOL_VERSION}: upgrade swarmrl"
            )
        return PeerUnavailable(f"orchestrator {self.url} answered {call} unreadably: {what}")


class PoolClient(_Base):
    """Synchronous client; see the module docstring."""

    def __init__(
        self,
        url: str,
        keypair: KeyPair,
        timeout_s: float = 30.0,
        http: httpx.Client | None = None,
        clock: Any = time.time,
    ) -> None:
        """Pass ``http`` to share one connection pool between many clients (and threads: an
        ``httpx.Client`` is thread-safe); it is then not closed by :meth:`close`."""
        super().__init__(url, keypair, timeout_s, clock)
        self._owns_http = http is None
        self._http = http or httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        payload: BaseModel | None,
        adapter: Any,
        held_s: float = 0.0,
    ) -> Any:
        """``held_s``: how long the server may hold the answer (``wait_s``), on top of the
        client's timeout. A refusal for the request's timestamp is signed again once, with the
        clock offset the refusal taught (module docstring)."""
        offset_before = self.clock_offset_s
        try:
            return self._send(method, path, payload, adapter, held_s)
        except ReplayedRequest as exc:
            if "from server time" not in str(exc) or self.clock_offset_s == offset_before:
                raise
            return self._send(method, path, payload, adapter, held_s)

    def _send(
        self, method: str, path: str, payload: BaseModel | None, adapter: Any, held_s: float
    ) -> Any:
        url, body, headers = self._prepare(method, path, payload)
        call = f"{method} {path}"
        timeout_s = self.timeout_s + held_s
        sent_at = self.clock()
        try:
            response = self._http.request(
                method, url, content=body, headers=headers, timeout=timeout_s
            )
        except httpx.TimeoutException as exc:
            raise PeerUnavailable(f"{call}: no answer from {self.url} in {timeout_s} s") from exc
        except httpx.TransportError as exc:
            raise PeerUnavailable(f"{call}: cannot reach {self.url}: {exc}") from exc
        self._learn_clock(response, sent_at, self.clock())
        return self._parse(call, response, adapter)

    # public
    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health", None, None)

    def pools(self) -> list[PoolInfo]:
        return self._call("GET", "/pools", None, _POOLS)

    def pool(self, pool_id: str) -> PoolInfo:
        return self._call("GET", f"/pools/{pool_id}", None, PoolInfo)

    def ledger_head(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._call("GET", f"/ledger/head?limit={limit}", None, None)

    def ledger_entries(self, start: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        """At most ``limit`` ledger entries with ``seq ≥ start``, in sequence order."""
        return self._call("GET", f"/ledger/entries?start={start}&limit={limit}", None, None)

    def attested_ledger(self, page: int = 500) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The orchestrator's signed head, then exactly the entries it vouches for."""
        attestation = self._call("GET", "/ledger/attestation", None, None)
        entries: list[dict[str, Any]] = []
        while len(entries) < attestation["entries"]:
            entries += self.ledger_entries(len(entries), page)
        return entries[: attestation["entries"]], attestation

    def ledger(self, page: int = 500) -> list[dict[str, Any]]:
        """The whole ledger in sequence order, fetched ``page`` entries per request."""
        entries: list[dict[str, Any]] = []
        while True:
            batch = self.ledger_entries(entries[-1]["seq"] + 1 if entries else 0, page)
            entries += batch
            if len(batch) < page:
                return entries

    # orchestrator admin
    def create_pool(self, spec: PoolSpec) -> PoolInfo:
        return self._call("POST", "/pools", spec, PoolInfo)

    # node
    def join(self, pool_id: str, metadata: NodeMetadata, invite: Invite | None = None) -> NodeView:
        req = JoinRequest(metadata=metadata, invite=invite)
        return self._call("POST", f"/pools/{pool_id}/join", req, NodeView)

    def rejoin(self, pool_id: str, metadata: NodeMetadata) -> NodeView:
        """Come back after an ejection for silence, with this key and no invite
        (``swarmrl.pool.trust.joins``); a member gets its view, a banned node ``NodeBanned``."""
        req = RejoinRequest(metadata=metadata)
        return self._call("POST", f"/pools/{pool_id}/rejoin", req, NodeView)

    def heartbeat(self, pool_id: str, beat: Heartbeat) -> HeartbeatReply:
        return self._call("POST", f"/pools/{pool_id}/heartbeat", beat, HeartbeatReply)

    def lease(self, pool_id: str) -> LeaseReply:
        return self._call("POST", f"/pools/{pool_id}/lease", None, LeaseReply)

    def submit(self, pool_id: str, submission: Submission) -> SubmissionReceipt:
        return self._call("POST", f"/pools/{pool_id}/submissions", submission, SubmissionReceipt)

    # validator
    def claim(
        self, pool_id: str, limit: int = 8, wait_s: float = 0.0, engine: str | None = None
    ) -> list[PendingSubmission]:
        """Submissions to check; ``wait_s``: the orchestrator may hold an empty answer this
        long until some arrive (``swarmrl.pool.web.waits``); ``engine``: the one this validator
        replays on, whose nodes' units it is handed first (``ClaimRequest.engine``)."""
        req = ClaimRequest(limit=limit, wait_s=wait_s, engine=engine)
        path = f"/pools/{pool_id}/validation/claim"
        return self._call("POST", path, req, ClaimReply, held_s=wait_s).submissions

    def verdict(self, pool_id: str, verdict: Verdict) -> VerdictReceipt:
        return self._call("POST", f"/pools/{pool_id}/verdicts", verdict, VerdictReceipt)

    # trainer and pool admin
    def set_version(
        self,
        pool_id: str,
        version: int,
        *,
        steps: int | None = None,
        tasks_per_step: int | None = None,
        finished: bool = False,
    ) -> int:
        """Announce ``version``; optionally the run's length and batch size, or its end."""
        req = VersionUpdate(
            version=version, steps=steps, tasks_per_step=tasks_per_step, finished=finished
        )
        return self._call("POST", f"/pools/{pool_id}/version", req, VersionUpdate).version

    def batch(
        self,
        pool_id: str,
        step: int,
        limit: int = 64,
        holder: str = "trainer",
        wait_s: float = 0.0,
        max_tasks: int | None = None,
    ) -> BatchReply:
        """Lease accepted submissions for ``step``; acknowledge them with :meth:`ack_batch`.
        ``wait_s``: as :meth:`claim`'s; ``max_tasks``: stop once the tasks served reach it."""
        req = BatchRequest(
            step=step, limit=limit, max_tasks=max_tasks, holder=holder, wait_s=wait_s
        )
        return self._call("POST", f"/pools/{pool_id}/batches", req, BatchReply, held_s=wait_s)

    def set_progress(self, pool_id: str, batched_through: int) -> int:
        """Tell the pool the trainer holds the whole batch of every step up to
        ``batched_through``."""
        req = TrainerProgress(batched_through=batched_through)
        return self._call(
            "POST", f"/pools/{pool_id}/progress", req, TrainerProgress
        ).batched_through

    def ack_batch(self, pool_id: str, submission_ids: list[str]) -> BatchAckReceipt:
        """Mark leased submissions trained, after the step that used them committed."""
        req = BatchAck(submission_ids=submission_ids)
        return self._call("POST", f"/pools/{pool_id}/batches/ack", req, BatchAckReceipt)

    def nodes(self, pool_id: str) -> list[NodeView]:
        return self._call("GET", f"/pools/{pool_id}/nodes", None, _NODES)

    def node_logs(self, pool_id: str, node_id: str) -> NodeLogs:
        return self._call("GET", f"/pools/{pool_id}/nodes/{node_id}/logs", None, NodeLogs)

    def invalidate(self, pool_id: str, node_id: str, req: InvalidateRequest) -> NodeView:
        path = f"/pools/{pool_id}/nodes/{node_id}/invalidate"
        return self._call("POST", path, req, NodeView)

    def metrics(self, pool_id: str) -> PoolMetrics:
        return self._call("GET", f"/pools/{pool_id}/metrics", None, PoolMetrics)
