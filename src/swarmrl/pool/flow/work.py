"""Pool work: leasing units to nodes, checking and storing their submissions.

Each function is one database transaction (see ``swarmrl.pool.trust.service``). Across server
processes sharing PostgreSQL, a lease holds its node's row locked (its in-flight count and
lease counter are read, then written) and takes an orphaned lease only if no other transaction
holds it; a submission holds its node's row, then its lease's row, so a second answer to one
lease waits for the first and is then a 409 (the unique ``lease_id`` of a submission is the
backstop, also a 409). Row locks are always taken node first, then lease, then the ledger's
append lock, so two transactions never wait on each other in a cycle (a submission's nonce,
claimed first, is a new row: only a replay of the same request waits for it). A submission's
signed body, which holds its rollouts (``swarmrl.pool.state.store``), is written before its row; if
the row cannot be committed the file is removed, so a rejected request leaves nothing behind.
Verdicts live in ``swarmrl.pool.flow.judging``, trainer batches in
``swarmrl.pool.flow.batches``. Knows nothing about HTTP or what a proof bundle holds.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import sqlalchemy as sa

from swarmrl.errors import PeerError, ReplayedRequest
from swarmrl.fastsql import Fast
from swarmrl.identity.requests import SignedRequest
from swarmrl.ledger.chain import Entry
from swarmrl.pool.flow import admission, progress, spotcheck, twins
from swarmrl.pool.flow.samples import check_samples
from swarmrl.pool.flow.scheduling import draw_tasks, lease_size, unit_seed, update_throughput
from swarmrl.pool.rejections import (
    Conflict,
    Expired,
    NotFound,
    Unauthorized,
)
from swarmrl.pool.state import db
from swarmrl.pool.trust import assignments
from swarmrl.pool.trust.service import (
    Context,
    current_version,
    leases_in_flight,
    node_row,
    require_member,
)
from swarmrl.protocol.pool import (
    LeaseReply,
    PoolSpec,
    Submission,
    SubmissionReceipt,
    WorkUnit,
)


def _new_id() -> str:
    return uuid.uuid4().hex


# built once: a lease and a submission run them on every call (building a statement costs as
# much as running it)
_L = db.leases
_N = db.nodes
_ORPHAN = Fast(
    sa.select(_L.c.lease_id, _L.c.work, _L.c.twin_of, _L.c.twin_node)
    .where(
        _L.c.pool_id == sa.bindparam("p"),
        _L.c.state.in_(("expired", "twin")),  # a twin waits for a node other than its own
        _L.c.reassigned_to.is_(None),
        _L.c.node_id != sa.bindparam("n"),
        sa.func.coalesce(_L.c.twin_node, "") != sa.bindparam("n"),
        # a twin is offered to its drawn taker first (swarmrl.pool.flow.twins)
        sa.or_(
            _L.c.twin_taker.is_(None),
            _L.c.twin_taker == sa.bindparam("n"),
            _L.c.created_at < sa.bindparam("open_before"),
            ~sa.exists().where(
                _N.c.pool_id == _L.c.pool_id,
                _N.c.node_id == _L.c.twin_taker,
                _N.c.state == "healthy",
            ),
        ),
    )
    .order_by(_L.c.deadline)
    .limit(1)
    .with_for_update(skip_locked=True)  # another process may be handing it out now
)
_REASSIGN = Fast(
    _L.update()
    .where(_L.c.lease_id == sa.bindparam("old"))
    .values(state="reassigned", reassigned_to=sa.bindparam("new"))
)
_NEXT_COUNTER = Fast(
    db.nodes.update()
    .where(db.nodes.c.pool_id == sa.bindparam("p"), db.nodes.c.node_id == sa.bindparam("n"))
    .values(lease_counter=sa.bindparam("c"))
)
_INSERT_LEASE = Fast(_L.insert())
_LEASE_SUBMITTED = Fast(
    _L.update().where(_L.c.lease_id == sa.bindparam("lease")).values(state="submitted")
)
_INSERT_SUBMISSION = Fast(db.submissions.insert())


# --- leasing ---------------------------------------------------------------------------------


def lease(ctx: Context, pool_id: str, node_id: str) -> LeaseReply:
    """Hand the node a work unit: a reassigned expired one first, else a fresh draw."""
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        row = node_row(conn, pool_id, node_id, lock=True)
        require_member(row)
        retry = ctx.config.heartbeat_interval_s
        run = progress.plan(conn, pool_id)
        if run.finished:
            return LeaseReply(
                outcome="finished", work=None, retry_after_s=0.0, reason="the run is finished"
            )
        if row.state != "healthy":
            return _wait(retry, f"node is {row.state}")
        in_flight = leases_in_flight(conn, pool_id, node_id)
        if in_flight >= spec.max_leases_in_flight:
            return _wait(retry, f"{in_flight} leases in flight (cap {spec.max_leases_in_flight})")
        version = current_version(conn, pool_id)
        waiting_for = starved_step(ctx, pool_id, now)  # the step the trainer waits for, if any
        blocked = waiting_for is not None and waiting_for <= version  # not a prefetch: a step
        useful = admission.lowest_useful_version(
            version, spec.async_level, blocked, spec.lease_version_lag
        )
        if ctx.config.admission and run.batched_through is not None and waiting_for is None:
            if admission.last_batch_held(run.batched_through, run.steps):
                return _wait(
                    ctx.config.admission_retry_s,
                    f"admission: the trainer holds the batch of the run's last step "
                    f"({run.batched_through}); no work leased now can train",
                )
            ahead = admission.trainable_from(run.batched_through, spec.async_level)
            if ahead > version:
                return _wait(
                    ctx.config.admission_retry_s,
                    f"admission: the trainer holds the batches of steps up to "
                    f"{run.batched_through}; only work of version ≥ {ahead} can still train",
                )
            useful = max(useful, ahead)
        within = _asking_within_s(ctx)
        queue = ctx.lease_asks.setdefault(pool_id, admission.Askers())
        queue.ask(node_id, 0, now, within)  # ordinary grants: first come, first served
        if waiting_for is not None:  # a grant the starving trainer forces goes by turns
            asks = ctx.starving_asks.setdefault(pool_id, admission.Askers())
            record = min(row.accepted, max(1, ctx.config.probation_submissions))
            asks.ask(node_id, record, now, within)
        admitted = _admission(ctx, conn, spec, run, version, row.measured_tps, now, waiting_for)
        not_its_turn = False
        if admitted.starving:
            asks = ctx.starving_asks[pool_id]
            if asks.starving_turn() == node_id:
                asks.granted(node_id, now)
            else:  # the forced grant is another node's; the ordinary rules still hold for it
                not_its_turn = True
                admitted = _admission(ctx, conn, spec, run, version, row.measured_tps, now, None)
        if admitted.covered:  # its own unchecked work may need this node's next submission
            own = progress.node_supply(conn, spec, version, node_id)
            rate = spotcheck.node_rate(conn, spec, node_id)
            admitted = admission.unblock(admitted, own, spec.min_tasks_per_lease, rate)
        ahead = queue.ahead_of(node_id)
        admitted = admission.fair_share(admitted, ahead, spec.min_tasks_per_lease)
        if not admitted.tasks and not_its_turn:
            return _wait(
                ctx.config.admission_retry_s,
                "admission: the starving trainer's next unit goes to another waiting node "
                "first (accepted work first, then the least recently served)",
            )
        if not admitted.tasks:
            return _wait(ctx.config.admission_retry_s, f"admission: {admitted.reason}")
        queue.granted(node_id, now)
        lease_id = _new_id()
        open_before = now - spec.lease_target_s  # a drawn taker's turn at a twin has passed
        orphan = _ORPHAN.run(conn, {"p": pool_id, "n": node_id, "open_before": open_before}).first()
        twin_of = twin_node = None
        if orphan is not None:
            twin_of, twin_node = orphan.twin_of, orphan.twin_node
            old = WorkUnit.model_validate_json(orphan.work)
            origin, counter, tasks = old.origin_node_id, old.origin_counter, old.task_indices
            seed, epoch = old.seed, old.assignment_epoch
            _REASSIGN.run(conn, {"old": orphan.lease_id, "new": lease_id})
        else:
            origin, counter = node_id, row.lease_counter
            n = admitted.tasks
            epoch, secret = assignments.current(ctx, conn, pool_id)
            tasks = draw_tasks(spec.seed, secret, node_id, counter, n, spec.task_count)
            seed = unit_seed(spec.seed, secret, node_id, counter)
            _NEXT_COUNTER.run(conn, {"p": pool_id, "n": node_id, "c": counter + 1})
        work = WorkUnit(
            lease_id=lease_id,
            pool_id=pool_id,
            node_id=node_id,
            task_indices=tasks,
            samples_per_task=spec.samples_per_task,
            sampling=spec.sampling,
            seed=seed,
            min_version=useful,
            deadline=now + spec.lease_timeout_s,
            origin_node_id=origin,
            origin_counter=counter,
            assignment_epoch=epoch,
        )
        _INSERT_LEASE.run(
            conn,
            dict(
                lease_id=lease_id,
                pool_id=pool_id,
                node_id=node_id,
                state="active",
                work=work.model_dump_json(),
                n_tasks=len(tasks),
                created_at=now,
                deadline=work.deadline,
                twin_of=twin_of,
                twin_node=twin_node,
            ),
        )
    return LeaseReply(outcome="work", work=work, retry_after_s=0.0)


def _asking_within_s(ctx: Context) -> float:
    """How recent a node's last ask must be for it to still wait for a starving grant."""
    return max(
        admission.STARVING_WITHIN_S, admission.ASKING_WITHIN_RETRIES * ctx.config.admission_retry_s
    )


def _wait(retry_after_s: float, reason: str) -> LeaseReply:
    return LeaseReply(outcome="wait", work=None, retry_after_s=retry_after_s, reason=reason)


def _admission(
    ctx: Context,
    conn: sa.Connection,
    spec: PoolSpec,
    run: progress.RunPlan,
    version: int,
    measured_tps: float | None,
    now: float,
    waiting_for: int | None,
) -> admission.Admission:
    """How many tasks a fresh lease may hold now (``swarmrl.pool.flow.admission``); ``waiting_for``:
    the step an empty batch request was for lately (:func:`starved_step`), None if none."""
    wanted = lease_size(
        measured_tps,
        spec.lease_target_s,
        spec.samples_per_task,
        spec.sampling.max_new_tokens,
        spec.min_tasks_per_lease,
        spec.max_tasks_per_lease,
    )
    cfg = ctx.config
    if not cfg.admission:
        return admission.Admission(wanted)
    per_step = progress.tasks_per_step(conn, spec, version, run.tasks_per_step)
    early = admission.without_supply(version, run.steps, spec.async_level, per_step, wanted)
    if early is not None:  # decided without counting the backlog (a scan of the pool's work)
        return early
    starving = waiting_for is not None
    return admission.admit(
        progress.supply(conn, spec, version),
        version,
        run.steps,
        spec.async_level,
        per_step,
        cfg.admission_validation_backlog_steps,
        cfg.admission_trainable_backlog_steps,
        wanted,
        spec.min_tasks_per_lease,
        starving,
        leases_overdue=starving
        and progress.leases_overdue(
            conn, spec.pool_id, now - admission.OVERDUE_LEASE_TARGETS * spec.lease_target_s
        ),
    )


def starved_step(ctx: Context, pool_id: str, now: float) -> int | None:
    """The step the trainer's last request for rollouts was for, when that request came back
    empty within ``admission.STARVING_WITHIN_S`` (the trainer waits for work), else None."""
    last = ctx.starved_at.get(pool_id)
    if last is None or now - last[0] >= admission.STARVING_WITHIN_S:
        return None
    return last[1]


_SET_THROUGHPUT = Fast(
    db.nodes.update()
    .where(db.nodes.c.pool_id == sa.bindparam("p"), db.nodes.c.node_id == sa.bindparam("n"))
    .values(measured_tps=sa.bindparam("tps"))
)


# --- submissions -----------------------------------------------------------------------------


HELD_UNTIL = 1e18  # unlock_at of a credit held while its node is on probation


def on_probation(ctx: Context, spec: PoolSpec, accepted: int) -> bool:
    """A node with fewer than ``probation_submissions`` accepted verdicts is on probation: its
    credits are held (``HELD_UNTIL``) until it passes (its check rate is
    ``swarmrl.pool.flow.spotcheck``'s)."""
    return bool(spec.validators) and accepted < ctx.config.probation_submissions


def credit(
    ctx: Context,
    conn: sa.Connection,
    spec: PoolSpec,
    sid: str,
    node_id: str,
    tokens: int,
    by: str,
    held: bool = False,
) -> None:
    ctx.ledger.append_many(conn, [credit_entry(ctx, conn, spec, sid, node_id, tokens, by, held)])


_INSERT_CREDIT = Fast(db.credits.insert())


def credit_entry(
    ctx: Context,
    conn: sa.Connection,
    spec: PoolSpec,
    sid: str,
    node_id: str,
    tokens: int,
    by: str,
    held: bool = False,
) -> Entry:
    """Record a credit's row; its ledger entry, for the caller to append."""
    now = ctx.clock()
    unlock_at = HELD_UNTIL if held else now + spec.credit_lock_s
    _INSERT_CREDIT.run(
        conn,
        dict(
            submission_id=sid,
            pool_id=spec.pool_id,
            node_id=node_id,
            tokens=tokens,
            created_at=now,
            unlock_at=unlock_at,
            dropped=False,
        ),
    )
    body = {
        "submission_id": sid,
        "tokens": tokens,
        "unlock_at": unlock_at,
        "measured_by": by,
        "held": held,
    }
    return Entry("credit", body, spec.pool_id, node_id, now)


_LEASE_LOCKED = Fast(
    sa.select(db.leases)
    .where(db.leases.c.lease_id == sa.bindparam("lease"), db.leases.c.pool_id == sa.bindparam("p"))
    .with_for_update()
)


def submit(
    ctx: Context,
    pool_id: str,
    signed: SignedRequest,
    sub: Submission,
    claim: Callable[[sa.Connection], None] | None = None,
) -> SubmissionReceipt:
    """Store a node's answer to its lease. A second answer to one lease is a 409, also when
    the two arrive at two server processes at once (see the module docstring).

    ``claim(conn)``: claims the request's nonce first, in the submission's transaction (raising
    :class:`~swarmrl.errors.ReplayedRequest` if it was used); a refused submission's claim is
    then committed on its own, so it stands as a claim made before the operation would."""
    try:
        try:
            return _submit(ctx, pool_id, signed, sub, claim)
        except sa.exc.IntegrityError as exc:  # the unique lease_id of a submission: twice
            raise Conflict(f"lease {sub.lease_id} was already answered") from exc
    except ReplayedRequest:
        raise
    except PeerError:
        if claim is not None:
            with ctx.engine.begin() as conn:
                claim(conn)
        raise


def _submit(
    ctx: Context,
    pool_id: str,
    signed: SignedRequest,
    sub: Submission,
    claim: Callable[[sa.Connection], None] | None,
) -> SubmissionReceipt:
    now = ctx.clock()
    node_id = signed.node_id
    sid = _new_id()
    key = f"{pool_id}/{sid}.parquet"
    with ctx.engine.begin() as conn:
        if claim is not None:
            claim(conn)
        spec = ctx.spec(conn, pool_id)
        member = node_row(conn, pool_id, node_id, lock=True)
        require_member(member)
        row = _LEASE_LOCKED.run(conn, {"lease": sub.lease_id, "p": pool_id}).first()
        if row is None:
            raise NotFound(f"unknown lease {sub.lease_id} in pool {pool_id!r}")
        if row.node_id != node_id:
            raise Unauthorized(f"lease {sub.lease_id} belongs to another node")
        if row.state == "submitted":
            raise Conflict(f"lease {sub.lease_id} was already answered")
        if row.state != "active" or row.deadline < now:
            raise Expired(
                f"lease {sub.lease_id} expired at {row.deadline:.0f}; its tasks go to another node"
            )
        work = WorkUnit.model_validate_json(row.work)
        version = current_version(conn, pool_id)
        tokens = check_samples(spec, work, sub.samples, version, ctx.config.max_proof_bytes)
        compared = None  # a twin's answer: compared with the unit it repeats first
        if row.twin_of is not None:
            compared = twins.compare_with(ctx, conn, row.twin_of, sub.samples)
        judged = compared is not None and compared.judged
        check = spotcheck.decide(ctx, conn, spec, node_id, sid, judged)
        auth = {
            "node_key": signed.public_key.hex,
            "signature": signed.signature,
            "body_digest": signed.body_digest,
            "timestamp_ms": signed.timestamp_ms,
            "nonce": signed.nonce,
        }
        # what the node signed: the rollouts, and for third parties its signature's subject
        ref = ctx.store.put_request(key, signed.body)
        try:
            _INSERT_SUBMISSION.run(
                conn,
                dict(
                    submission_id=sid,
                    pool_id=pool_id,
                    lease_id=sub.lease_id,
                    node_id=node_id,
                    received_at=now,
                    rollout_key=ref,
                    n_samples=len(sub.samples),
                    tokens=tokens,
                    min_version=min((s.policy_version for s in sub.samples), default=version),
                    auth=json.dumps(auth),
                    status=check.status,
                    validated=False,
                ),
            )
            _LEASE_SUBMITTED.run(conn, {"lease": sub.lease_id})
            # ``member`` was read in this transaction, and nothing since changed its throughput
            throughput = update_throughput(member.measured_tps, tokens, now - row.created_at)
            _SET_THROUGHPUT.run(conn, {"p": pool_id, "n": node_id, "tps": throughput})
            body = {
                "submission_id": sid,
                "lease_id": sub.lease_id,
                "n_samples": len(sub.samples),
                "tokens": tokens,
                **auth,
                "check": check.record(),
            }
            if spec.twin_fraction > 0:  # what a twin's answer is compared by
                body["digest"] = twins.digest(sub.samples)
            if row.twin_of is not None:
                body["twin_of"] = row.twin_of
            entries = [Entry("submission", body, pool_id, node_id, now)]
            if not check.checked:
                held = on_probation(ctx, spec, member.accepted)
                entries.append(
                    credit_entry(ctx, conn, spec, sid, node_id, tokens, "orchestrator", held)
                )
            if check.twin:
                twins.lease_twin(conn, spec, sid, node_id, row, now, check.taker)
            if compared is not None:
                entries.append(twins.settle(ctx, conn, spec, sid, compared))
            ctx.ledger.append_many(conn, entries)  # one head read, one insert
        except BaseException:
            ctx.store.delete(ref)
            raise
    return SubmissionReceipt(submission_id=sid, status="pending", tokens=tokens)
