"""Validation: validators claim pending submissions and post verdicts on them.

Validators see only the submissions the spot check selected (``swarmrl.pool.flow.spotcheck``, which
also holds the quorum rule for disputed ones). Every selected submission is judged, whether or
not the trainer can still use it: one that went stale while it waited is still claimed (after
the fresh ones), so a worker that cheats just before a version bump is judged and penalised
like any other; being stale, it is never served to the trainer (``swarmrl.pool.flow.batches``).
An accepting verdict carries the validator's measurements of the unit (``Verdict.evidence``);
they add to the node's record (``swarmrl.pool.trust.evidence``), and the unit that takes the
record past its limit is recorded as a hard rejection with the evidence as its reason, so its
node is banned as for any other; the validator's receipt gives that reason.
A validator names the engine it replays on when it claims, and is handed the units of nodes that
declared that engine, keeping another engine's units for that engine's validators
(:func:`engine_route`), so each unit is measured against its own engine's honest means.
Each function is one database transaction (see ``swarmrl.pool.trust.service``); a claim commits only
once its reply is built (``swarmrl.pool.state.replies``). Knows nothing about HTTP or what a proof
bundle holds.
"""

from __future__ import annotations

import json
import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from swarmrl.fastsql import Fast
from swarmrl.pool.flow import spotcheck, twins
from swarmrl.pool.flow.work import HELD_UNTIL, credit, on_probation
from swarmrl.pool.rejections import Conflict, Invalid, NotFound, Unauthorized
from swarmrl.pool.state import db
from swarmrl.pool.state.replies import json_object, serialise_rows
from swarmrl.pool.trust import evidence
from swarmrl.pool.trust.penalties import invalidate_in
from swarmrl.pool.trust.service import Context, current_version, node_row
from swarmrl.protocol.pool import PoolSpec, WorkUnit
from swarmrl.protocol.verdicts import PendingSubmission, Verdict, VerdictReceipt

_CREDITED = Fast(
    sa.select(db.credits.c.submission_id).where(db.credits.c.submission_id == sa.bindparam("s"))
)


def _require_validator(spec: PoolSpec, public_key_hex: str) -> None:
    if public_key_hex not in spec.validators:
        raise Unauthorized(
            f"key {public_key_hex[:16]}… is not a validator of pool {spec.pool_id!r}"
        )


def claim(
    ctx: Context, pool_id: str, validator_key: str, limit: int, engine: str | None = None
) -> bytes:
    """JSON of a :class:`ClaimReply` with up to ``limit`` pending submissions for a validator.

    Submissions the trainer can still use come first; among them, those of nodes that declared
    the validator's ``engine`` (see :func:`engine_route`); then those whose passed check
    releases unchecked work of their node submitted before them (``spotcheck.passed``), since
    that work is older and nearer to going stale; then oldest first. Claims expire after
    ``claim_timeout_s``, and a validator re-claiming its own unexpired ones gets them again.
    """
    now = ctx.clock()
    with ctx.engine.begin() as conn:
        spec = ctx.spec(conn, pool_id)
        _require_validator(spec, validator_key)
        engine = _own_engine(spec, validator_key, engine)
        if engine is not None:
            _seen(conn, pool_id, validator_key, engine, now)
        oldest = current_version(conn, pool_id) - spec.async_level
        stale_last = sa.case((db.submissions.c.min_version >= oldest, 0), else_=1)
        # (with no engine named, none first: ``== None`` would put nodes of no known engine first)
        own_engine_first = (
            [] if engine is None else [sa.case((db.nodes.c.engine == engine, 0), else_=1)]
        )
        releasing_first = sa.case(
            (spotcheck.releases_unchecked(spec.release_after_checks), 0), else_=1
        )
        rows = conn.execute(
            sa.select(db.submissions, db.leases.c.work, db.nodes.c.engine.label("node_engine"))
            .join(db.leases, db.leases.c.lease_id == db.submissions.c.lease_id)
            .outerjoin(
                db.nodes,
                sa.and_(
                    db.nodes.c.pool_id == db.submissions.c.pool_id,
                    db.nodes.c.node_id == db.submissions.c.node_id,
                ),
            )
            .where(
                db.submissions.c.pool_id == pool_id,
                spotcheck.claimable(validator_key),
                sa.or_(
                    db.submissions.c.claimed_by.is_(None),
                    db.submissions.c.claim_expires_at < now,
                    db.submissions.c.claimed_by == validator_key,
                ),
                engine_route(ctx, pool_id, validator_key, engine, now),
            )
            .order_by(stale_last, *own_engine_first, releasing_first, db.submissions.c.received_at)
            .limit(limit)
            # two validators claiming at two server processes get different submissions
            .with_for_update(skip_locked=True, of=db.submissions)
        ).all()
        served, parts = serialise_rows(
            conn, rows, lambda r: _pending(ctx, r), lambda r: r.submission_id
        )
        if served:
            conn.execute(
                db.submissions.update()
                .where(db.submissions.c.submission_id.in_([r.submission_id for r in served]))
                .values(claimed_by=validator_key, claim_expires_at=now + ctx.config.claim_timeout_s)
            )
        return json_object({}, "submissions", parts)


def _own_engine(spec: PoolSpec, validator_key: str, named: str | None) -> str | None:
    """The engine a claim routes by: the one the pool spec gives the validator
    (``PoolSpec.validator_engines``; a claim naming another is refused), else the one it named."""
    given = spec.validator_engines.get(validator_key)
    if given is not None and named is not None and named != given:
        raise Invalid(
            f"validator {validator_key[:16]}… replays on {named!r}, but pool {spec.pool_id!r} "
            f"has it on {given!r} (validator_engines): start it with inference.backend = "
            f"{given!r}, or change the spec"
        )
    return given if given is not None else named


def engine_route(
    ctx: Context, pool_id: str, validator_key: str, engine: str | None, now: float
) -> sa.ColumnElement[bool]:
    """Which units a validator replaying on ``engine`` may claim: those of nodes that declared
    that engine, or no engine the pool knows; those of an engine no other validator of the pool
    has claimed with within ``claim_timeout_s``; and any unit that has waited
    ``cross_engine_after_s`` since it arrived. A validator that names no engine may claim any.

    The honest means a validator measures a unit against are those of its pairing (the node's
    declared engine, the validator's own; ``swarmrl.toploc.evidence.units``): a validator of the
    node's own engine judges by the tight ones, another engine's by the loose cross-engine ones.
    A cheat that declared an engine is judged by that engine's validators wherever the pool has
    one that keeps up, whatever it chose to declare.
    """
    if engine is None:
        return sa.true()
    subs, nodes, seen = db.submissions, db.nodes, db.validator_engines
    covered = sa.select(seen.c.engine).where(
        seen.c.pool_id == pool_id,
        seen.c.validator != validator_key,
        seen.c.seen_at >= now - ctx.config.claim_timeout_s,
    )
    return sa.or_(
        nodes.c.engine.is_(None),
        nodes.c.engine == engine,
        nodes.c.engine.not_in(covered),
        subs.c.received_at <= now - ctx.config.cross_engine_after_s,
    )


def _seen(conn: sa.Connection, pool_id: str, validator_key: str, engine: str, now: float) -> None:
    """Record that a validator claimed, replaying on ``engine``, at ``now``."""
    seen = db.validator_engines
    insert = (postgresql if conn.dialect.name == "postgresql" else sqlite).insert
    conn.execute(
        insert(seen)
        .values(pool_id=pool_id, validator=validator_key, engine=engine, seen_at=now)
        .on_conflict_do_update(
            index_elements=[seen.c.pool_id, seen.c.validator], set_=dict(engine=engine, seen_at=now)
        )
    )


def _pairing(conn: sa.Connection, pool_id: str, node: Any, validator_key: str) -> dict[str, str]:
    """``{"pairing": "declared->own"}``: the engine the node declared when it last joined and
    the one the validator named at its last claim, whose honest means measured the unit's
    evidence; empty where either is unknown."""
    seen = db.validator_engines
    own = conn.execute(
        sa.select(seen.c.engine).where(seen.c.pool_id == pool_id, seen.c.validator == validator_key)
    ).scalar_one_or_none()
    if node.engine is None or own is None:
        return {}
    return {"pairing": f"{node.engine}->{own}"}


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
        engine=r.node_engine,
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
        # locked: two verdicts on one submission at two server processes would both find it
        # pending; the second now waits and finds it judged (409)
        row = conn.execute(
            sa.select(db.submissions)
            .where(
                db.submissions.c.submission_id == verdict.submission_id,
                db.submissions.c.pool_id == pool_id,
            )
            .with_for_update()
        ).first()
        if row is None:
            raise NotFound(f"unknown submission {verdict.submission_id} in pool {pool_id!r}")
        # the node's row before the ledger's append lock (the order ``swarmrl.pool.flow.work``
        # keeps)
        node = node_row(conn, pool_id, row.node_id, lock=True)
        if row.status not in ("pending", "disputed"):
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
        elif verdict.evidence is not None:
            raise Invalid("evidence is measured on accepted units only; a rejection gives reasons")
        if not spotcheck.vote(ctx, conn, spec, row, validator_key, verdict):
            return VerdictReceipt(
                submission_id=row.submission_id, status="disputed", credited_tokens=0
            )
        if verdict.accept and verdict.evidence:
            flagged = evidence.add(conn, spec, row.node_id, verdict.evidence)
            if flagged is not None:  # this unit takes the node's record past its limit
                verdict = verdict.model_copy(
                    update=dict(accept=False, severity="hard", reasons=[flagged], measured_tokens=0)
                )
        record = verdict.model_dump(mode="json", exclude={"behaviour_logprobs"}, exclude_none=True)
        status = "accepted" if verdict.accept else "rejected"
        if verdict.accept and twins.repeats_served(ctx, conn, row.lease_id, samples):
            status = "matched"  # a rechecked copy of samples that trained already
        body = {
            **record,
            "validator": validator_key,
            **_pairing(conn, pool_id, node, validator_key),
        }
        conn.execute(
            db.submissions.update()
            .where(db.submissions.c.submission_id == row.submission_id)
            .values(status=status, validated=True, verdict=json.dumps(body))
        )
        ctx.ledger.append(conn, "verdict", body, pool_id=pool_id, node_id=row.node_id, ts=now)
        node_where = sa.and_(db.nodes.c.pool_id == pool_id, db.nodes.c.node_id == row.node_id)
        if verdict.accept:
            accepted = node_row(conn, pool_id, row.node_id).accepted + 1
            conn.execute(db.nodes.update().where(node_where).values(accepted=accepted))
            held = on_probation(ctx, spec, accepted)
            # a unit sent to a check at its release was credited when it arrived unchecked
            credited = _CREDITED.run(conn, {"s": row.submission_id}).first() is not None
            if not credited:
                credit(
                    ctx,
                    conn,
                    spec,
                    row.submission_id,
                    row.node_id,
                    verdict.measured_tokens,
                    "validator",
                    held,
                )
            if not held:  # probation passed (or none): credits held so far start their lock
                conn.execute(
                    db.credits.update()
                    .where(
                        db.credits.c.pool_id == pool_id,
                        db.credits.c.node_id == row.node_id,
                        db.credits.c.unlock_at >= HELD_UNTIL,
                    )
                    .values(unlock_at=now + spec.credit_lock_s)
                )
            assert verdict.behaviour_logprobs is not None
            ctx.store.put_behaviour(row.rollout_key, verdict.behaviour_logprobs)
            spotcheck.passed(ctx, conn, spec, row, accepted)
        else:
            if verdict.severity == "hard":  # a soft drop blames nobody: the record stands
                spotcheck.failed(conn, pool_id, row.node_id)
            reason = "; ".join(verdict.reasons) or "rejected by validator"
            state = node_row(conn, pool_id, row.node_id).state
            if state != "banned":
                invalidate_in(
                    ctx, conn, pool_id, row.node_id, verdict.severity, reason, row.submission_id
                )
    if verdict.accept:
        return VerdictReceipt(
            submission_id=row.submission_id,
            status="accepted",
            credited_tokens=verdict.measured_tokens,
        )
    # an accepting verdict the node's evidence overruled says why
    overruled = verdict.reasons if verdict.evidence else []
    return VerdictReceipt(
        submission_id=row.submission_id, status="rejected", credited_tokens=0, reasons=overruled
    )
