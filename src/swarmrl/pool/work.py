"""Pool work: leasing units, checking and storing submissions, verdicts, trainer batches.

Each function is one database transaction (see ``swarmrl.pool.service``). A submission's
rollout file is written before its row; if the row cannot be committed the file is removed, so a
rejected request leaves nothing behind. Knows nothing about HTTP or what a proof bundle holds.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa

from swarmrl.identity.keys import canonical_json, digest_hex
from swarmrl.identity.requests import SignedRequest
from swarmrl.pool import db
from swarmrl.pool.penalties import invalidate_in
from swarmrl.pool.rejections import Conflict, Expired, Invalid, NotFound, Unauthorized
from swarmrl.pool.scheduling import draw_tasks, lease_size, unit_seed, update_throughput
from swarmrl.pool.service import (
    Context,
    current_version,
    leases_in_flight,
    node_row,
    require_member,
)
from swarmrl.protocol.pool import (
    BatchReply,
    LeaseReply,
    PendingSubmission,
    PoolSpec,
    Sample,
    Submission,
    SubmissionReceipt,
    TrainableSubmission,
    Verdict,
    VerdictReceipt,
    WorkUnit,
)

MAX_TOKEN_ID = 2**31 - 1
MAX_PROMPT_TOKENS = 1 << 17


def _new_id() -> str:
    return uuid.uuid4().hex


# --- leasing ---------------------------------------------------------------------------------


def lease(ctx: Context, pool_id: str, node_id: str) -> LeaseReply:
    """Hand the node a work unit: a reassigned expired one first, else a fresh draw."""
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        row = node_row(conn, pool_id, node_id)
        require_member(row)
        retry = ctx.config.heartbeat_interval_s
        if row.state != "healthy":
            return LeaseReply(work=None, retry_after_s=retry, reason=f"node is {row.state}")
        in_flight = leases_in_flight(conn, pool_id, node_id)
        if in_flight >= spec.max_leases_in_flight:
            return LeaseReply(
                work=None,
                retry_after_s=retry,
                reason=f"{in_flight} leases in flight (cap {spec.max_leases_in_flight})",
            )
        version = current_version(conn, pool_id)
        lease_id = _new_id()
        orphan = conn.execute(
            sa.select(db.leases.c.lease_id, db.leases.c.work)
            .where(
                db.leases.c.pool_id == pool_id,
                db.leases.c.state == "expired",
                db.leases.c.reassigned_to.is_(None),
                db.leases.c.node_id != node_id,
            )
            .order_by(db.leases.c.deadline)
            .limit(1)
        ).first()
        if orphan is not None:
            old = WorkUnit.model_validate_json(orphan.work)
            origin, counter, tasks = old.origin_node_id, old.origin_counter, old.task_indices
            seed = old.seed
            conn.execute(
                db.leases.update()
                .where(db.leases.c.lease_id == orphan.lease_id)
                .values(state="reassigned", reassigned_to=lease_id)
            )
        else:
            origin, counter = node_id, row.lease_counter
            n = lease_size(
                row.measured_tps,
                spec.lease_target_s,
                spec.samples_per_task,
                spec.sampling.max_new_tokens,
                spec.min_tasks_per_lease,
                spec.max_tasks_per_lease,
            )
            tasks = draw_tasks(spec.seed, node_id, counter, n, spec.task_count)
            seed = unit_seed(spec.seed, node_id, counter)
            conn.execute(
                db.nodes.update()
                .where(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id)
                .values(lease_counter=counter + 1)
            )
        work = WorkUnit(
            lease_id=lease_id,
            pool_id=pool_id,
            node_id=node_id,
            task_indices=tasks,
            samples_per_task=spec.samples_per_task,
            sampling=spec.sampling,
            seed=seed,
            min_version=max(0, version - spec.async_level),
            deadline=now + spec.lease_timeout_s,
            origin_node_id=origin,
            origin_counter=counter,
        )
        conn.execute(
            db.leases.insert(),
            dict(
                lease_id=lease_id,
                pool_id=pool_id,
                node_id=node_id,
                state="active",
                work=work.model_dump_json(),
                created_at=now,
                deadline=work.deadline,
            ),
        )
    return LeaseReply(work=work, retry_after_s=0.0)


# --- submissions -----------------------------------------------------------------------------


def check_samples(
    spec: PoolSpec, work: WorkUnit, samples: list[Sample], version: int, max_proof_bytes: int
) -> int:
    """Refuse samples that do not answer ``work`` within limits; returns output tokens."""
    expected = Counter(
        {t: c * work.samples_per_task for t, c in Counter(work.task_indices).items()}
    )
    got = Counter(s.task_index for s in samples)
    if got != expected:
        missing = sorted((expected - got).elements())[:5]
        extra = sorted((got - expected).elements())[:5]
        raise Invalid(
            f"samples do not match the lease: want {work.samples_per_task} per leased task; "
            f"missing {missing}, unexpected {extra}"
        )
    oldest = version - spec.async_level
    tokens = 0
    for i, s in enumerate(samples):
        where = f"sample {i} (task {s.task_index})"
        if len(s.output_tokens) != len(s.logprobs):
            raise Invalid(f"{where}: {len(s.output_tokens)} tokens but {len(s.logprobs)} logprobs")
        if len(s.output_tokens) > spec.sampling.max_new_tokens:
            raise Invalid(f"{where}: {len(s.output_tokens)} tokens > max_new_tokens")
        if len(s.prompt_tokens) > MAX_PROMPT_TOKENS:
            raise Invalid(f"{where}: prompt longer than {MAX_PROMPT_TOKENS} tokens")
        if any(t < 0 or t > MAX_TOKEN_ID for t in s.prompt_tokens + s.output_tokens):
            raise Invalid(f"{where}: token ids must lie in [0, 2^31)")
        if not all(math.isfinite(x) and x <= 0 for x in s.logprobs):
            raise Invalid(f"{where}: logprobs must be finite and ≤ 0")
        if s.policy_version > version:
            raise Conflict(f"{where}: policy version {s.policy_version} > current {version}")
        if s.policy_version < max(oldest, work.min_version):
            raise Conflict(
                f"{where}: policy version {s.policy_version} is stale (need ≥ "
                f"{max(oldest, work.min_version)}: current {version} − async_level {spec.async_level})"
            )
        if isinstance(s.proof, str):
            if len(s.proof) % 2 or any(c not in "0123456789abcdefABCDEF" for c in s.proof):
                raise Invalid(f"{where}: proof string must be hex bytes")
        proof_bytes = (
            0
            if s.proof is None
            else len(s.proof if isinstance(s.proof, str) else canonical_json(s.proof))
        )
        if proof_bytes > max_proof_bytes:
            raise Invalid(f"{where}: proof of {proof_bytes} bytes > {max_proof_bytes}")
        tokens += len(s.output_tokens)
    return tokens


def _selected(submission_id: str, fraction: float) -> bool:
    """Deterministic Bernoulli(fraction) draw for validation, from the submission id."""
    return int(digest_hex(submission_id.encode())[:13], 16) / 16**13 < fraction


def _credit(
    ctx: Context, conn: sa.Connection, spec: PoolSpec, sid: str, node_id: str, tokens: int, by: str
) -> None:
    now = ctx.clock()
    unlock_at = now + spec.credit_lock_s
    conn.execute(
        db.credits.insert(),
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
    body = {"submission_id": sid, "tokens": tokens, "unlock_at": unlock_at, "measured_by": by}
    ctx.ledger.append(conn, "credit", body, pool_id=spec.pool_id, node_id=node_id, ts=now)


def submit(ctx: Context, pool_id: str, signed: SignedRequest, sub: Submission) -> SubmissionReceipt:
    now = ctx.clock()
    node_id = signed.node_id
    sid = _new_id()
    key = f"{pool_id}/{sid}.parquet"
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        require_member(node_row(conn, pool_id, node_id))
        row = conn.execute(
            sa.select(db.leases).where(
                db.leases.c.lease_id == sub.lease_id, db.leases.c.pool_id == pool_id
            )
        ).first()
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
        selected = _selected(sid, spec.validated_fraction)
        auth = {
            "node_key": signed.public_key.hex,
            "signature": signed.signature,
            "body_digest": signed.body_digest,
            "timestamp_ms": signed.timestamp_ms,
            "nonce": signed.nonce,
        }
        ctx.store.put_samples(key, sub.samples)
        try:
            conn.execute(
                db.submissions.insert(),
                dict(
                    submission_id=sid,
                    pool_id=pool_id,
                    lease_id=sub.lease_id,
                    node_id=node_id,
                    received_at=now,
                    rollout_key=key,
                    n_samples=len(sub.samples),
                    tokens=tokens,
                    min_version=min((s.policy_version for s in sub.samples), default=version),
                    auth=json.dumps(auth),
                    status="pending" if selected else "accepted",
                    validated=False,
                ),
            )
            conn.execute(
                db.leases.update()
                .where(db.leases.c.lease_id == sub.lease_id)
                .values(state="submitted")
            )
            node = node_row(conn, pool_id, node_id)
            conn.execute(
                db.nodes.update()
                .where(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == node_id)
                .values(
                    measured_tps=update_throughput(node.measured_tps, tokens, now - row.created_at)
                )
            )
            body = {
                "submission_id": sid,
                "lease_id": sub.lease_id,
                "n_samples": len(sub.samples),
                "tokens": tokens,
                **auth,
            }
            ctx.ledger.append(conn, "submission", body, pool_id=pool_id, node_id=node_id, ts=now)
            if not selected:
                _credit(ctx, conn, spec, sid, node_id, tokens, "orchestrator")
        except BaseException:
            ctx.store.delete(key)
            raise
    return SubmissionReceipt(
        submission_id=sid, status="pending" if selected else "accepted", tokens=tokens
    )


# --- validation ------------------------------------------------------------------------------


def _require_validator(spec: PoolSpec, public_key_hex: str) -> None:
    if public_key_hex not in spec.validators:
        raise Unauthorized(
            f"key {public_key_hex[:16]}… is not a validator of pool {spec.pool_id!r}"
        )


def claim(ctx: Context, pool_id: str, validator_key: str, limit: int) -> list[PendingSubmission]:
    """Hand a validator up to ``limit`` pending submissions it may judge (claims expire)."""
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        _require_validator(spec, validator_key)
        # a submission older than the trainer can still use is not worth a replay
        oldest = current_version(conn, pool_id) - spec.async_level
        rows = conn.execute(
            sa.select(db.submissions, db.leases.c.work)
            .join(db.leases, db.leases.c.lease_id == db.submissions.c.lease_id)
            .where(
                db.submissions.c.pool_id == pool_id,
                db.submissions.c.status == "pending",
                db.submissions.c.min_version >= oldest,
                sa.or_(
                    db.submissions.c.claimed_by.is_(None),
                    db.submissions.c.claim_expires_at < now,
                    db.submissions.c.claimed_by == validator_key,
                ),
            )
            .order_by(db.submissions.c.received_at)
            .limit(limit)
        ).all()
        if rows:
            conn.execute(
                db.submissions.update()
                .where(db.submissions.c.submission_id.in_([r.submission_id for r in rows]))
                .values(claimed_by=validator_key, claim_expires_at=now + ctx.config.claim_timeout_s)
            )
        return [_pending(ctx, r) for r in rows]


def _pending(ctx: Context, r: Any) -> PendingSubmission:
    auth = json.loads(r.auth)
    return PendingSubmission(
        submission_id=r.submission_id,
        node_id=r.node_id,
        node_key=auth["node_key"],
        request_signature=auth["signature"],
        body_digest=auth["body_digest"],
        request_timestamp_ms=auth["timestamp_ms"],
        request_nonce=auth["nonce"],
        work=WorkUnit.model_validate_json(r.work),
        samples=ctx.store.get_samples(r.rollout_key),
    )


def record_verdict(
    ctx: Context, pool_id: str, validator_key: str, verdict: Verdict
) -> VerdictReceipt:
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        _require_validator(spec, validator_key)
        row = conn.execute(
            sa.select(db.submissions).where(
                db.submissions.c.submission_id == verdict.submission_id,
                db.submissions.c.pool_id == pool_id,
            )
        ).first()
        if row is None:
            raise NotFound(f"unknown submission {verdict.submission_id} in pool {pool_id!r}")
        if row.status != "pending":
            raise Conflict(f"submission {verdict.submission_id} is {row.status}, not pending")
        samples = ctx.store.get_samples(row.rollout_key) if verdict.accept else []
        if verdict.accept:
            lp = verdict.behaviour_logprobs
            if lp is None or len(lp) != len(samples):
                raise Invalid(f"accepting needs behaviour_logprobs for all {len(samples)} samples")
            for i, (s, b) in enumerate(zip(samples, lp, strict=True)):
                if len(b) != len(s.output_tokens) or not all(math.isfinite(x) for x in b):
                    raise Invalid(
                        f"behaviour_logprobs[{i}]: want {len(s.output_tokens)} finite values"
                    )
            if verdict.measured_tokens > row.tokens:
                raise Invalid(f"measured_tokens {verdict.measured_tokens} > {row.tokens} submitted")
        record = verdict.model_dump(mode="json", exclude={"behaviour_logprobs"})
        conn.execute(
            db.submissions.update()
            .where(db.submissions.c.submission_id == row.submission_id)
            .values(
                status="accepted" if verdict.accept else "rejected",
                validated=True,
                verdict=json.dumps({**record, "validator": validator_key}),
            )
        )
        body = {**record, "validator": validator_key}
        ctx.ledger.append(conn, "verdict", body, pool_id=pool_id, node_id=row.node_id, ts=now)
        node_where = sa.and_(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == row.node_id)
        if verdict.accept:
            conn.execute(
                db.nodes.update().where(node_where).values(accepted=db.nodes.c.accepted + 1)
            )
            _credit(
                ctx,
                conn,
                spec,
                row.submission_id,
                row.node_id,
                verdict.measured_tokens,
                "validator",
            )
            assert verdict.behaviour_logprobs is not None
            ctx.store.put_behaviour(row.rollout_key, verdict.behaviour_logprobs)
        else:
            reason = "; ".join(verdict.reasons) or "rejected by validator"
            state = node_row(conn, pool_id, row.node_id).state
            if state != "banned":
                invalidate_in(
                    ctx, conn, pool_id, row.node_id, verdict.severity, reason, row.submission_id
                )
    credited = verdict.measured_tokens if verdict.accept else 0
    status = "accepted" if verdict.accept else "rejected"
    return VerdictReceipt(submission_id=row.submission_id, status=status, credited_tokens=credited)


# --- trainer ---------------------------------------------------------------------------------


def set_version(ctx: Context, pool_id: str, version: int) -> int:
    with ctx.engine.begin() as conn:
        ctx.spec(conn, pool_id)
        current = current_version(conn, pool_id)
        if version < current:
            raise Conflict(f"version {version} is older than the current {current}")
        conn.execute(
            db.pools.update().where(db.pools.c.pool_id == pool_id).values(current_version=version)
        )
    return version


def take_batch(ctx: Context, pool_id: str, step: int, limit: int) -> BatchReply:
    """Accepted, unconsumed submissions with versions ≥ step − async_level, each served once."""
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        rows = conn.execute(
            sa.select(
                db.submissions.c.submission_id,
                db.submissions.c.node_id,
                db.submissions.c.rollout_key,
                db.leases.c.work,
            )
            .join(db.leases, db.leases.c.lease_id == db.submissions.c.lease_id)
            .where(
                db.submissions.c.pool_id == pool_id,
                db.submissions.c.status == "accepted",
                db.submissions.c.consumed_step.is_(None),
                db.submissions.c.min_version >= step - spec.async_level,
            )
            .order_by(db.submissions.c.received_at)
            .limit(limit)
        ).all()
        if rows:
            conn.execute(
                db.submissions.update()
                .where(db.submissions.c.submission_id.in_([r.submission_id for r in rows]))
                .values(status="trained", consumed_step=step)
            )
        # read before commit: a store failure then leaves the rollouts unconsumed
        out = [
            TrainableSubmission(
                submission_id=r.submission_id,
                node_id=r.node_id,
                task_indices=WorkUnit.model_validate_json(r.work).task_indices,
                samples=ctx.store.get_samples(r.rollout_key),
                behaviour_logprobs=ctx.store.get_behaviour(r.rollout_key),
            )
            for r in rows
        ]
    return BatchReply(step=step, submissions=out)
