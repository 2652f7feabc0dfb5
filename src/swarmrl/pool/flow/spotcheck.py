"""Spot checks: which submissions validators check, and when unchecked work may train.

Selection (the arithmetic lives in ``swarmrl.ledger.spotchecks``): a submission is checked when
its draw ``u = HMAC(epoch secret, submission id)`` is below its node's check rate
``p = max(validated_fraction, check_rate_decay ** clean)``, ``clean`` being the node's checks
passed since its last failed one (a hard rejection; a soft one drops the unit without blame and
leaves the record as it was). The decision is taken when the submission is stored, from a
secret the node does not hold, and is not told to the node (its receipt says ``pending``
either way); the submission's ledger entry records ``{"epoch", "rate", "checked"}``, so once
the epoch's secret is revealed anyone holding the ledger can recompute it.

Trainability: a checked submission trains once its check passes (with the validator's
behaviour log-probs). An unchecked one is stored as ``unchecked`` and becomes trainable (with
the worker's declared log-probs) only once checks of ``release_after_checks`` (k) *later*
submissions of the same node have passed, and the node has passed ``release_young_checks`` (n)
checks in all (a young node's unchecked work waits until then); that release is a ``release``
ledger entry naming what it freed (each unit counts its checks in ``passes_after``). Of the units a passed check would release, a share ``release_replay_fraction``
(q), drawn under the epoch secret like the spot check (``is_replayed``), is sent to the
validators instead (status ``pending``, named under ``replay`` in the entry): each trains only
once its own check passes, and a failed one bans the node like any failed check. A failed hard
check bans the node and drops all its untrained work, unchecked included, and takes back its
credits still locked (``swarmrl.pool.trust.penalties``). So no unchecked unit trains unless k
checks the node could not foresee passed after it was submitted; what can slip through is a
falsified unit followed by k honest checked ones and not drawn for a replay (docs/toploc.md,
"The spot-check residual", measures it). With ``twin_fraction`` > 0 a drawn share of the
unchecked units is generated again by another node (``swarmrl.pool.flow.twins``): such a unit
is not released by later checks while its twin is out; an equal answer leaves it to the usual
release, a different one sends both to the validators. A unit drawn for a twin while no other
node of the pool is healthy gets none (its entry records ``"alone": true``): nobody could answer
it, and the unit would wait for its lapse (a swarm of one worker would wait on every unit).

Quorum: with ``quorum`` k > 1 a rejection is one vote (``vote`` ledger entry) and the
submission waits as ``disputed`` for other validators; it is rejected once more than half of k
validators reject, accepted once that can no longer happen. An acceptance of an undisputed
submission is final at once. Runs inside the caller's transaction; knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.ledger.spotchecks import check_rate, is_checked, is_replayed, is_twinned
from swarmrl.pool.flow import twins
from swarmrl.pool.rejections import Conflict
from swarmrl.pool.state import db
from swarmrl.pool.trust import assignments
from swarmrl.pool.trust.service import Context
from swarmrl.protocol.pool import PoolSpec
from swarmrl.protocol.verdicts import Verdict


@dataclass(frozen=True)
class Check:
    """The spot-check decision on one submission, as its ledger entry records it."""

    epoch: int
    rate: float
    checked: bool
    has_validators: bool = True
    twin: bool | None = None  # drawn for a twin (swarmrl.pool.flow.twins); None: no twins here
    by_twin: bool = False  # a twin's answer judged by its comparison, drawn for nothing
    alone: bool = False  # drawn for a twin, but no other healthy node could answer it
    taker: str | None = None  # the node a drawn twin is offered to first (not in the record)

    @property
    def status(self) -> str:
        """Status of the stored submission: ``pending`` (to be checked), ``unchecked`` (waits
        for a later passed check), or ``accepted`` in a pool without validators (trusted)."""
        if self.checked:
            return "pending"
        return "unchecked" if self.has_validators else "accepted"

    def record(self) -> dict[str, Any]:
        record = {"epoch": self.epoch, "rate": self.rate, "checked": self.checked}
        if self.twin is not None:
            record["twin"] = self.twin
        if self.by_twin:
            record["by_twin"] = True
        if self.alone:
            record["alone"] = True
        return record


_CLEAN = Fast(
    sa.select(db.spot_rates.c.clean).where(
        db.spot_rates.c.pool_id == sa.bindparam("p"),
        db.spot_rates.c.node_id == sa.bindparam("n"),
    )
)  # built once: read on every submission


def _clean(conn: sa.Connection, pool_id: str, node_id: str) -> int:
    row = _CLEAN.run(conn, {"p": pool_id, "n": node_id}).first()
    return 0 if row is None else int(row.clean)


def _set_clean(conn: sa.Connection, pool_id: str, node_id: str, clean: int) -> None:
    t = db.spot_rates
    where = sa.and_(t.c.pool_id == pool_id, t.c.node_id == node_id)
    if conn.execute(t.update().where(where).values(clean=clean)).rowcount == 0:
        conn.execute(t.insert(), dict(pool_id=pool_id, node_id=node_id, clean=clean))


def node_rate(conn: sa.Connection, spec: PoolSpec, node_id: str) -> float:
    """The node's current check rate (0 in a pool without validators)."""
    if not spec.validators:
        return 0.0
    return check_rate(
        _clean(conn, spec.pool_id, node_id), spec.validated_fraction, spec.check_rate_decay
    )


def decide(
    ctx: Context,
    conn: sa.Connection,
    spec: PoolSpec,
    node_id: str,
    sid: str,
    judged_by_twin: bool = False,
) -> Check:
    """Draw whether submission ``sid`` of ``node_id`` is checked (module docstring) and, when
    it is not and the pool has twins, whether its unit is leased again to another node. A
    twin's answer that its comparison judges (``judged_by_twin``) is drawn for neither."""
    epoch, secret = assignments.current(ctx, conn, spec.pool_id)
    if judged_by_twin:
        return Check(epoch, 0.0, False, bool(spec.validators), None, by_twin=True)
    rate = node_rate(conn, spec, node_id)
    checked = is_checked(secret, spec.pool_id, sid, rate)
    twin, alone, taker = None, False, None
    if spec.twin_fraction > 0 and spec.validators and not checked:
        twin = is_twinned(secret, spec.pool_id, sid, spec.twin_fraction)
        if twin:
            taker = twins.draw_taker(conn, spec.pool_id, node_id)
            alone = taker is None  # nobody could answer it: the unit would only wait
            twin = not alone
    return Check(epoch, rate, checked, bool(spec.validators), twin, alone=alone, taker=taker)


def passed(ctx: Context, conn: sa.Connection, spec: PoolSpec, row: Any, accepted: int) -> list[str]:
    """A check of submission ``row`` passed (the node's ``accepted`` checks now): the node's
    record grows, each of its unchecked submissions received before ``row`` counts one more
    passed check after it, and those with k are released once ``accepted`` ≥ n, a drawn share
    q of them to a check instead (module docstring); returns the submission ids made
    trainable."""
    pool_id = spec.pool_id
    _set_clean(conn, pool_id, row.node_id, _clean(conn, pool_id, row.node_id) + 1)
    subs = db.submissions
    earlier = sa.and_(
        subs.c.pool_id == pool_id,
        subs.c.node_id == row.node_id,
        subs.c.status == "unchecked",
        subs.c.received_at < row.received_at,
    )
    conn.execute(subs.update().where(earlier).values(passes_after=subs.c.passes_after + 1))
    if accepted < spec.release_young_checks:
        return []
    due = sa.and_(earlier, subs.c.passes_after >= spec.release_after_checks)
    if spec.twin_fraction > 0:  # a unit whose twin is still out waits for the twin's answer
        due = sa.and_(due, ~twin_outstanding())
    ids = sorted(conn.execute(sa.select(subs.c.submission_id).where(due)).scalars())
    if not ids:
        return []
    body: dict[str, Any] = {"by": row.submission_id}
    replay: list[str] = []
    if spec.release_replay_fraction > 0:
        epoch, secret = assignments.current(ctx, conn, pool_id)
        replay = [s for s in ids if is_replayed(secret, pool_id, s, spec.release_replay_fraction)]
        body["epoch"] = epoch
    released = [s for s in ids if s not in set(replay)]
    body["submission_ids"] = released
    if replay:
        body["replay"] = replay
        conn.execute(subs.update().where(subs.c.submission_id.in_(replay)).values(status="pending"))
    if released:
        conn.execute(
            subs.update().where(subs.c.submission_id.in_(released)).values(status="accepted")
        )
    ctx.ledger.append(conn, "release", body, pool_id=pool_id, node_id=row.node_id, ts=ctx.clock())
    return released


def twin_outstanding() -> sa.ColumnElement[bool]:
    """Whether a submission's twin lease is still out: waiting for a node, or leased and not
    yet answered (``swarmrl.pool.flow.twins``)."""
    leases = db.leases
    return sa.exists().where(
        leases.c.twin_of == db.submissions.c.submission_id,
        leases.c.state.in_(("twin", "active")),
    )


def failed(conn: sa.Connection, pool_id: str, node_id: str) -> None:
    """A check of the node failed (a hard rejection): its rate goes back to 1. A soft one (the
    unit could not be judged, e.g. its version is gone) is no failure and leaves the record."""
    _set_clean(conn, pool_id, node_id, 0)


def releases_unchecked(release_after_checks: int) -> sa.ColumnElement[bool]:
    """Whether a submission's passed check would release unchecked work (``passed``): its
    node has unchecked submissions received before it that wait for one more passed check."""
    subs = db.submissions
    earlier = subs.alias("earlier")
    return sa.exists().where(
        earlier.c.pool_id == subs.c.pool_id,
        earlier.c.node_id == subs.c.node_id,
        earlier.c.status == "unchecked",
        earlier.c.received_at < subs.c.received_at,
        earlier.c.passes_after >= release_after_checks - 1,
    )


def claimable(validator_key: str) -> sa.ColumnElement[bool]:
    """Submissions a validator may claim: pending ones, and disputed ones it has not voted on."""
    subs, votes = db.submissions, db.spot_votes
    voted = sa.exists().where(
        votes.c.submission_id == subs.c.submission_id, votes.c.validator == validator_key
    )
    return sa.or_(subs.c.status == "pending", sa.and_(subs.c.status == "disputed", ~voted))


def vote(
    ctx: Context, conn: sa.Connection, spec: PoolSpec, row: Any, validator: str, verdict: Verdict
) -> bool:
    """Count ``verdict`` toward the quorum of submission ``row``; True when it settles it (the
    caller then records it as the verdict), False while the submission stays ``disputed``."""
    if spec.quorum <= 1 or (row.status == "pending" and verdict.accept):
        return True
    votes = db.spot_votes
    if conn.execute(
        sa.select(votes.c.validator).where(
            votes.c.submission_id == row.submission_id, votes.c.validator == validator
        )
    ).first():
        raise Conflict(f"validator {validator[:16]}… already voted on {row.submission_id}")
    conn.execute(
        votes.insert(),
        dict(submission_id=row.submission_id, validator=validator, accept=verdict.accept),
    )
    tally = conn.execute(
        sa.select(votes.c.accept, sa.func.count())
        .where(votes.c.submission_id == row.submission_id)
        .group_by(votes.c.accept)
    ).all()
    counts = {bool(a): int(n) for a, n in tally}
    rejects, accepts = counts.get(False, 0), counts.get(True, 0)
    majority = spec.quorum // 2 + 1
    settled = rejects >= majority or accepts > spec.quorum - majority
    record = verdict.model_dump(mode="json", exclude={"behaviour_logprobs"}, exclude_none=True)
    body = {**record, "validator": validator, "rejects": rejects, "accepts": accepts}
    ctx.ledger.append(conn, "vote", body, pool_id=spec.pool_id, node_id=row.node_id, ts=ctx.clock())
    if not settled:
        conn.execute(
            db.submissions.update()
            .where(db.submissions.c.submission_id == row.submission_id)
            .values(status="disputed", claimed_by=None, claim_expires_at=None)
        )
    return settled
