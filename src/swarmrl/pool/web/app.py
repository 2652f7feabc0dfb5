"""The orchestrator's HTTP API (FastAPI): routes, request authentication, error mapping.

Every state-changing route needs a signed request (``swarmrl.identity.requests``); the signer's
key decides the role: any key may act as a node, the pool's validator keys post verdicts, and the
orchestrator key or the pool owner key is admin (pool creation needs the orchestrator key). All
database work runs on the event loop's thread, one operation at a time in arrival order, so no
two operations of one process race and SQLite never sees concurrent writers; several processes
sharing PostgreSQL (``swarmrl orchestrator --workers N``) are kept apart by the locks that
``swarmrl.pool.trust.service`` lists. (Each operation takes about a
millisecond; a separate database thread was measured to be slower, because the two threads
convoy on the GIL: each SQLite call releases it and then waits for the busy loop thread.) Bodies
over the size cap are refused before they are parsed. The three routes nodes call all the time
(heartbeat, lease, submission) are answered by ``swarmrl.pool.web.hotroutes`` with the same checks
in the same order, without FastAPI's per-request machinery; their FastAPI routes document them
and serve what falls through (all of them with ``pool.hot_routes = false``).

Knows nothing about how the pool rules are implemented (``swarmrl.pool.trust.service`` /
``flow.work``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

import sqlalchemy as sa
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from swarmrl import __version__
from swarmrl.errors import InfraError, Malformed, PeerError
from swarmrl.identity.requests import RequestVerifier, SignedRequest
from swarmrl.ledger.chain import GENESIS_HASH, attest
from swarmrl.ledger.export import read_entries, read_entries_from
from swarmrl.pool.flow import batches, judging, work
from swarmrl.pool.rejections import Unauthorized
from swarmrl.pool.state import nonces
from swarmrl.pool.state.db import WalCheckpointer, is_retryable
from swarmrl.pool.state.nonces import DatabaseNonceStore
from swarmrl.pool.trust import joins, penalties, service, views
from swarmrl.pool.trust.service import Context
from swarmrl.pool.web.answers import (
    BodyLimit,
    error_response,
    json_reply,
    refusal_body,
    unavailable,
)
from swarmrl.pool.web.bridge import Bridge
from swarmrl.pool.web.hotroutes import HotLane, HotRoute, HotRoutes, error_summary
from swarmrl.pool.web.metrics import OrchestratorMetrics, RequestTimer
from swarmrl.pool.web.waits import PoolChanges, held
from swarmrl.protocol.batches import (
    BatchAck,
    BatchAckReceipt,
    BatchReply,
    BatchRequest,
    TrainerProgress,
    VersionUpdate,
)
from swarmrl.protocol.pool import (
    NODE_ID,
    POOL_ID_PATTERN,
    PROTOCOL_VERSION,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    InvalidateRequest,
    JoinRequest,
    LeaseReply,
    NodeLogs,
    NodeView,
    PoolInfo,
    PoolMetrics,
    PoolSpec,
    RejoinRequest,
    Submission,
    SubmissionReceipt,
)
from swarmrl.protocol.verdicts import ClaimReply, ClaimRequest, Verdict, VerdictReceipt

# Path ids are checked against their patterns before any handler (or database) sees them: a NUL
# or a stray character is a 422, never a query PostgreSQL refuses.
PoolId = Annotated[str, Path(pattern=POOL_ID_PATTERN)]
NodeId = Annotated[str, Path(pattern=NODE_ID)]

log = logging.getLogger("swarmrl.pool")
T = TypeVar("T")
MAX_LEDGER_SEQ = 2**62  # larger `start` values are refused (422) before they reach SQL
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorReply} for code in (400, 401, 403, 404, 409, 410, 413, 422, 429)
}


def _hot_nonces(ctx: Context) -> nonces.HotNonces | None:
    """Heartbeat and lease nonces in this process's memory, with the restart rules of
    ``swarmrl.pool.state.nonces``; None where beats are written at once (``heartbeat_flush_s``
    0)."""
    if ctx.config.heartbeat_flush_s <= 0:
        return None
    return nonces.HotNonces.at_start(ctx.engine, ctx.clock(), ctx.config.request_future_skew_s)


RACE_RETRIES = 3  # runs of one operation that PostgreSQL may abort as a deadlock's victim


def run_transaction(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run again when PostgreSQL aborted its transaction to break a deadlock
    between server processes (``swarmrl.pool.state.db.is_retryable``): an operation is one
    transaction, so an aborted run left nothing behind. The lock order of ``swarmrl.pool.flow.work``
    makes this rare; it is the backstop, not the plan."""
    for attempt in range(RACE_RETRIES):
        try:
            return fn(*args)
        except sa.exc.DBAPIError as exc:
            if attempt == RACE_RETRIES - 1 or not is_retryable(exc):
                raise
    raise AssertionError("unreachable")


def build_app(ctx: Context, *, shared: bool = False, bridge: str | None = None) -> FastAPI:
    """The orchestrator app over ``ctx``; its lifespan runs the health/lease sweeper.
    ``shared``: other server processes serve the same database (each claims every nonce in
    it); otherwise this process claims heartbeat and lease nonces in memory
    (``swarmrl.pool.state.nonces``). ``bridge``: a Unix socket path where the lifespan also serves
    the orchestrator's front processes (``swarmrl.pool.web.bridge``)."""
    # nonces live in the database, so a request captured before a restart is refused after it
    nonce_store = DatabaseNonceStore(ctx.engine, ctx.clock)
    hot_nonces = None if shared else _hot_nonces(ctx)
    verifier = RequestVerifier(
        nonce_store,
        window_s=ctx.config.request_window_s,
        max_future_s=ctx.config.request_future_skew_s,
        max_body_bytes=ctx.config.max_body_bytes,
    )

    async def on_db(fn: Callable[..., T], *args: Any) -> T:
        return run_transaction(fn, *args)

    changes = PoolChanges()  # wakes the listings held for work (swarmrl.pool.web.waits)

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(ctx.config.sweep_interval_s)
            try:
                await on_db(service.sweep, ctx)
            except Exception:  # the sweeper must outlive one bad pass; the error is logged
                log.exception("pool sweep failed; retrying next period")

    async def beat_flusher() -> None:
        period_s = ctx.config.heartbeat_flush_s
        while period_s > 0:
            await asyncio.sleep(period_s)
            try:
                await on_db(service.flush_beats, ctx)
            except Exception:  # the beats stay buffered for the next period; the error is logged
                log.exception("writing buffered heartbeats failed; retrying next period")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checkpointer = WalCheckpointer(ctx.engine)
        checkpointer.start()
        tasks = [asyncio.create_task(sweeper()), asyncio.create_task(beat_flusher())]
        fronts = None
        if bridge is not None:
            fronts = Bridge(app, app.state.bridge_lane, bridge)
            await fronts.start()
        try:
            yield
        finally:
            if fronts is not None:
                await fronts.stop()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            try:  # a clean stop loses no beat and no nonce
                service.flush_beats(ctx)
                if hot_nonces is not None:
                    nonces.record_clean_stop(ctx.engine, ctx.clock())
            finally:
                checkpointer.stop()

    app = FastAPI(
        title="swarmrl orchestrator",
        version=__version__,
        lifespan=lifespan,
        description=(
            "Compute pool protocol. Signed routes need the headers X-Swarm-Key, "
            "X-Swarm-Timestamp, X-Swarm-Nonce and X-Swarm-Signature (swarmrl.identity.requests)."
        ),
    )

    def claimed_in_memory(who: SignedRequest) -> bool:
        """Claim a beat's or a lease's nonce in this process's memory, to be written with the
        buffered beats; False where nonces are claimed in the database instead. Claimed in
        memory also when FastAPI's route had the verifier claim it in the table, so that its
        replay through the hot lane is refused too."""
        if hot_nonces is None:
            return False
        hot_nonces.claim(who)
        if not who.nonce_claimed:
            ctx.beats.add_nonce(nonces.HotNonces.row(who))
        return True

    prometheus = OrchestratorMetrics(ctx)

    def beat_op(pool_id: str, who: SignedRequest, beat: Heartbeat) -> HeartbeatReply:
        # in memory, or else in the beat's own transaction (one, not two)
        claim = None
        if not claimed_in_memory(who) and not who.nonce_claimed:
            claim = functools.partial(nonces.claim_in, nonce_store, who)
        return run_transaction(service.heartbeat, ctx, pool_id, who.node_id, beat, claim)

    def lease_op(pool_id: str, who: SignedRequest, _: None) -> LeaseReply:
        claimed_in_memory(who)  # where nonces are not kept in memory, the verifier claimed it
        reply = run_transaction(work.lease, ctx, pool_id, who.node_id)
        prometheus.lease_answered(pool_id, reply)
        return reply

    def submit_op(pool_id: str, who: SignedRequest, sub: Submission) -> SubmissionReceipt:
        # as a beat's: the hot lane claims a submission's nonce in the submission's transaction
        claim = None if who.nonce_claimed else functools.partial(nonces.claim_in, nonce_store, who)
        receipt = run_transaction(work.submit, ctx, pool_id, who, sub, claim)
        changes.notify(pool_id)  # a validator or the trainer may be waiting for it
        return receipt

    hot = {
        "heartbeat": HotRoute("/pools/{pool_id}/heartbeat", Heartbeat, beat_op, claims_nonce=True),
        "lease": HotRoute(
            "/pools/{pool_id}/lease", None, lease_op, claims_nonce=hot_nonces is not None
        ),
        "submissions": HotRoute(
            "/pools/{pool_id}/submissions", Submission, submit_op, claims_nonce=True
        ),
    }
    lane = HotLane(
        hot,
        verify=verifier.verify,
        on_peer_error=error_response,
        on_infra_error=unavailable,
        max_body_bytes=ctx.config.max_body_bytes,
        observe=lambda route, status, s: prometheus.latency.labels(
            "POST", route, str(status)
        ).observe(s),
    )
    # the server answers these from its parser (swarmrl.pool.server); None: through the app
    hot_routes = ctx.config.hot_routes
    app.state.hot_lane = lane if hot_routes and ctx.config.direct_lane else None
    # requests whose signature a front checked (swarmrl.pool.web.bridge): all else checked here
    app.state.bridge_lane = lane.with_verify(
        functools.partial(verifier.verify, signature_checked=True)
    )
    app.state.hot_nonces = hot_nonces  # None: every nonce claimed in the database
    # innermost first: the body limit and the request timer wrap the hot routes too
    if hot_routes:  # else their FastAPI routes answer them
        app.add_middleware(HotRoutes, lane=lane)
    app.add_middleware(BodyLimit, limit=ctx.config.max_body_bytes)
    app.add_middleware(RequestTimer, metrics=prometheus)

    @app.exception_handler(PeerError)
    async def _peer_error(_: Request, exc: PeerError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InfraError)
    async def _infra_error(_: Request, exc: InfraError) -> JSONResponse:
        return unavailable(exc)

    @app.exception_handler(HTTPException)
    async def _refused(_: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's own refusals in the pool's error form, not FastAPI's {"detail"}: its only
        # 400 is a body it could not parse (nested too deep), malformed as any unparsable body
        if exc.status_code == 400:
            return error_response(Malformed(str(exc.detail)))
        body = refusal_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # the offending input is left out: it may not even be JSON-serialisable (NaN)
        return error_response(Malformed(error_summary(exc.errors())))

    async def signed(request: Request) -> SignedRequest:
        raw = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string", b"")
        path = (raw + (b"?" + query if query else b"")).decode("latin-1")
        body = await request.body()
        return verifier.verify(request.method, path, body, request.headers)

    async def admin(pool_id: str, who: SignedRequest) -> None:
        def check() -> None:
            with ctx.engine.connect() as conn:
                if not ctx.is_admin(conn, pool_id, who.public_key.hex):
                    raise Unauthorized("admin route: sign with the orchestrator or pool owner key")

        await on_db(check)

    # --- public ---------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness, the orchestrator's public key (which signs the ledger), the protocol version
        it speaks (``PROTOCOL_VERSION``) and the ``[pool]`` settings it applies (storage
        locations left out: they may carry credentials)."""
        return {
            "ok": True,
            "orchestrator_key": ctx.key.public_key_hex,
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "config": ctx.config.model_dump(mode="json", exclude={"db_url", "store_url"}),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text (``swarmrl.pool.web.metrics``); public, like ``/health``."""
        body, content_type = await on_db(prometheus.render)
        return Response(body, media_type=content_type)

    @app.get("/pools", response_model=list[PoolInfo])
    async def pools() -> list[PoolInfo]:
        return await on_db(service.list_pools, ctx)

    @app.get("/pools/{pool_id}", response_model=PoolInfo, responses=ERRORS)
    async def pool(pool_id: PoolId) -> PoolInfo:
        return await on_db(service.get_pool, ctx, pool_id)

    # --- orchestrator admin ----------------------------------------------------------------

    @app.post("/pools", response_model=PoolInfo, responses=ERRORS)
    async def create_pool(spec: PoolSpec, who: SignedRequest = Depends(signed)) -> PoolInfo:
        if who.public_key.hex != ctx.key.public_key_hex:
            raise Unauthorized("creating a pool needs the orchestrator key")
        return await on_db(service.create_pool, ctx, spec)

    # --- nodes -----------------------------------------------------------------------------

    @app.post("/pools/{pool_id}/join", response_model=NodeView, responses=ERRORS)
    async def join(
        pool_id: PoolId, req: JoinRequest, who: SignedRequest = Depends(signed)
    ) -> NodeView:
        return await on_db(joins.join_or_rejoin, ctx, pool_id, who.public_key.hex, who.node_id, req)

    @app.post("/pools/{pool_id}/rejoin", response_model=NodeView, responses=ERRORS)
    async def rejoin_pool(
        pool_id: PoolId, req: RejoinRequest, who: SignedRequest = Depends(signed)
    ) -> NodeView:
        return await on_db(joins.rejoin, ctx, pool_id, who.public_key.hex, who.node_id, req)

    @app.post("/pools/{pool_id}/heartbeat", response_model=HeartbeatReply, responses=ERRORS)
    async def heartbeat(
        pool_id: PoolId, beat: Heartbeat, who: SignedRequest = Depends(signed)
    ) -> Response:
        return json_reply(beat_op(pool_id, who, beat))

    @app.post("/pools/{pool_id}/lease", response_model=LeaseReply, responses=ERRORS)
    async def lease(pool_id: PoolId, who: SignedRequest = Depends(signed)) -> Response:
        return json_reply(lease_op(pool_id, who, None))

    @app.post("/pools/{pool_id}/submissions", response_model=SubmissionReceipt, responses=ERRORS)
    async def submit(
        pool_id: PoolId, sub: Submission, who: SignedRequest = Depends(signed)
    ) -> Response:
        return json_reply(submit_op(pool_id, who, sub))

    # --- validators ------------------------------------------------------------------------

    @app.post("/pools/{pool_id}/validation/claim", response_model=ClaimReply, responses=ERRORS)
    async def claim(
        pool_id: PoolId, req: ClaimRequest, who: SignedRequest = Depends(signed)
    ) -> Response:
        key = who.public_key.hex
        body = await held(
            lambda: on_db(judging.claim, ctx, pool_id, key, req.limit, req.engine),
            changes,
            pool_id,
            req.wait_s,
        )
        return Response(body, media_type="application/json")

    @app.post("/pools/{pool_id}/verdicts", response_model=VerdictReceipt, responses=ERRORS)
    async def verdict(
        pool_id: PoolId, v: Verdict, who: SignedRequest = Depends(signed)
    ) -> VerdictReceipt:
        receipt = await on_db(judging.record_verdict, ctx, pool_id, who.public_key.hex, v)
        changes.notify(pool_id)  # it may have made work trainable (its own, or released)
        return receipt

    # --- trainer and pool admin ------------------------------------------------------------

    @app.post("/pools/{pool_id}/version", response_model=VersionUpdate, responses=ERRORS)
    async def set_version(
        pool_id: PoolId, update: VersionUpdate, who: SignedRequest = Depends(signed)
    ) -> VersionUpdate:
        await admin(pool_id, who)
        version = await on_db(batches.set_version, ctx, pool_id, update.version, update)
        return update.model_copy(update={"version": version})

    @app.post("/pools/{pool_id}/progress", response_model=TrainerProgress, responses=ERRORS)
    async def set_progress(
        pool_id: PoolId, update: TrainerProgress, who: SignedRequest = Depends(signed)
    ) -> TrainerProgress:
        """How far ahead the trainer holds its batches: admission leases no work that only
        steps up to ``batched_through`` could train."""
        await admin(pool_id, who)
        step = await on_db(batches.set_progress, ctx, pool_id, update.batched_through)
        return TrainerProgress(batched_through=step)

    @app.post("/pools/{pool_id}/batches", response_model=BatchReply, responses=ERRORS)
    async def batch(
        pool_id: PoolId, req: BatchRequest, who: SignedRequest = Depends(signed)
    ) -> Response:
        await admin(pool_id, who)
        body = await held(
            lambda: on_db(
                batches.take_batch, ctx, pool_id, req.step, req.limit, req.holder, req.max_tasks
            ),
            changes,
            pool_id,
            req.wait_s,
        )
        return Response(body, media_type="application/json")

    @app.post("/pools/{pool_id}/batches/ack", response_model=BatchAckReceipt, responses=ERRORS)
    async def ack_batch(
        pool_id: PoolId, req: BatchAck, who: SignedRequest = Depends(signed)
    ) -> BatchAckReceipt:
        """Acknowledge leased submissions once the trainer step that used them committed."""
        await admin(pool_id, who)
        return await on_db(batches.acknowledge, ctx, pool_id, req.submission_ids)

    @app.get("/pools/{pool_id}/nodes", response_model=list[NodeView], responses=ERRORS)
    async def nodes(pool_id: PoolId, who: SignedRequest = Depends(signed)) -> list[NodeView]:
        await admin(pool_id, who)
        return await on_db(views.list_nodes, ctx, pool_id)

    @app.get("/pools/{pool_id}/nodes/{node_id}/logs", response_model=NodeLogs, responses=ERRORS)
    async def logs(
        pool_id: PoolId, node_id: NodeId, who: SignedRequest = Depends(signed)
    ) -> NodeLogs:
        await admin(pool_id, who)
        return await on_db(views.node_logs, ctx, pool_id, node_id)

    @app.post(
        "/pools/{pool_id}/nodes/{node_id}/invalidate", response_model=NodeView, responses=ERRORS
    )
    async def invalidate(
        pool_id: PoolId,
        node_id: NodeId,
        req: InvalidateRequest,
        who: SignedRequest = Depends(signed),
    ) -> NodeView:
        await admin(pool_id, who)
        return await on_db(
            penalties.invalidate, ctx, pool_id, node_id, req.severity, req.reason, req.submission_id
        )

    @app.get("/pools/{pool_id}/metrics", response_model=PoolMetrics, responses=ERRORS)
    async def pool_metrics(pool_id: PoolId, who: SignedRequest = Depends(signed)) -> PoolMetrics:
        await admin(pool_id, who)
        return await on_db(views.metrics, ctx, pool_id)

    @app.get("/ledger/head")
    async def ledger_head(limit: int = Query(20, ge=1, le=1000)) -> list[dict[str, Any]]:
        """The latest ledger entries (public: the ledger is meant to be auditable)."""

        return await on_db(read_entries, ctx.engine, limit)

    @app.get("/ledger/attestation")
    async def ledger_attestation() -> dict[str, Any]:
        """The orchestrator's signed statement of the ledger's head (entry count, last hash,
        time), which an export's header carries so a file cut short cannot pass (public)."""
        last = await on_db(read_entries, ctx.engine, 1)
        count, head = (last[0]["seq"] + 1, last[0]["entry_hash"]) if last else (0, GENESIS_HASH)
        return attest(ctx.key, count, head)

    @app.get("/ledger/entries")
    async def ledger_entries(
        start: int = Query(0, ge=0, le=MAX_LEDGER_SEQ),
        limit: int = Query(500, ge=1, le=1000),
    ) -> list[dict[str, Any]]:
        """At most ``limit`` entries with ``seq ≥ start`` in sequence order (public; page
        through the whole ledger by asking again from the last ``seq`` + 1)."""

        return await on_db(read_entries_from, ctx.engine, start, limit)

    return app
