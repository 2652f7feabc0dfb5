"""The run's progress as the pool sees it: what the trainer said (steps, batch size, finished)
and the counts admission control needs (``swarmrl.pool.flow.admission``).

The trainer tells its plan with each version update (:class:`VersionUpdate`), and how far ahead
it holds its batches when that runs past the step it gathers for (:class:`TrainerProgress`);
the consumption per step is measured from the submissions the trainer took for its last
:data:`MEASURED_STEPS` steps. Functions run inside the caller's transaction. Knows nothing
about HTTP or the admission arithmetic itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.pool.flow.admission import Supply
from swarmrl.pool.state import db
from swarmrl.protocol.batches import VersionUpdate
from swarmrl.protocol.pool import PoolSpec

MEASURED_STEPS = 3  # trainer steps the consumption rate is averaged over


@dataclass(frozen=True)
class RunPlan:
    """What the trainer declared; None = not told."""

    steps: int | None = None
    tasks_per_step: int | None = None
    finished: bool = False
    batched_through: int | None = None  # the highest step whose whole batch the trainer holds


def record(conn: sa.Connection, pool_id: str, update: VersionUpdate, now: float) -> None:
    """Keep what ``update`` tells beyond the version (fields left None keep their value)."""
    told = {
        k: v
        for k, v in (("steps", update.steps), ("tasks_per_step", update.tasks_per_step))
        if v is not None
    }
    if update.finished:
        told["finished_at"] = now
    if told:
        _keep(conn, pool_id, told)


def _keep(conn: sa.Connection, pool_id: str, values: dict[str, object]) -> None:
    """Set ``values`` in the pool's progress row, creating it if needed."""
    table = db.run_progress
    exists = conn.execute(sa.select(table.c.pool_id).where(table.c.pool_id == pool_id)).first()
    if exists is None:
        conn.execute(table.insert(), {"pool_id": pool_id, **values})
    else:
        conn.execute(table.update().where(table.c.pool_id == pool_id).values(**values))


_PLAN = Fast(sa.select(db.run_progress).where(db.run_progress.c.pool_id == sa.bindparam("p")))


def plan(conn: sa.Connection, pool_id: str) -> RunPlan:
    row = _PLAN.run(conn, {"p": pool_id}).first()
    if row is None:
        return RunPlan()
    return RunPlan(row.steps, row.tasks_per_step, row.finished_at is not None, row.batched_through)


def record_batched(conn: sa.Connection, pool_id: str, step: int) -> None:
    """Keep ``step``, the highest step whose whole batch the trainer now says it holds: what it
    told last, not the most it ever told (a trainer started again may hold less)."""
    _keep(conn, pool_id, {"batched_through": step})


# samples by status of the fresh submissions not yet trained, and of those served for step v or
# later that the trainer already used up ("trained": F, fresh by construction)
_QUEUED = (
    sa.select(db.submissions.c.status, sa.func.coalesce(sa.func.sum(db.submissions.c.n_samples), 0))
    .where(
        db.submissions.c.pool_id == sa.bindparam("p"),
        db.submissions.c.status.in_(("pending", "accepted", "leased", "unchecked", "trained")),
        db.submissions.c.min_version >= sa.bindparam("oldest"),
        sa.or_(
            db.submissions.c.status != "trained",
            db.submissions.c.consumed_step >= sa.bindparam("v"),
        ),
    )
    .group_by(db.submissions.c.status)
)
# tasks in active leases: a sum over a column, not a parse of every lease's unit (a lease asks
# for it, and a pool of thousands of nodes has thousands of leases active)
_LEASED = sa.select(sa.func.coalesce(sa.func.sum(db.leases.c.n_tasks), 0)).where(
    db.leases.c.pool_id == sa.bindparam("p"), db.leases.c.state == "active"
)


def supply(conn: sa.Connection, spec: PoolSpec, version: int) -> Supply:
    """L, P, Q, U and F of ``swarmrl.pool.flow.admission`` in tasks, for a pool at ``version``
    (F: submissions served for step ``version`` or later and acknowledged as used up)."""
    g = spec.samples_per_task
    oldest = version - spec.async_level
    rows = conn.execute(_QUEUED, {"p": spec.pool_id, "oldest": oldest, "v": version}).all()
    samples = {status: int(n) for status, n in rows}
    leased = conn.execute(_LEASED, {"p": spec.pool_id}).scalar_one()
    return Supply(
        leased=int(leased),
        pending=samples.get("pending", 0) // g,
        trainable=(samples.get("accepted", 0) + samples.get("leased", 0)) // g,
        unchecked=samples.get("unchecked", 0) // g,
        used=samples.get("trained", 0) // g,
    )


def node_supply(conn: sa.Connection, spec: PoolSpec, version: int, node_id: str) -> Supply:
    """One node's fresh L, P and U in tasks (for ``swarmrl.pool.flow.admission.unblock``)."""
    subs, g = db.submissions, spec.samples_per_task
    rows = conn.execute(
        sa.select(subs.c.status, sa.func.coalesce(sa.func.sum(subs.c.n_samples), 0))
        .where(
            subs.c.pool_id == spec.pool_id,
            subs.c.status.in_(("pending", "unchecked")),
            subs.c.node_id == node_id,
            subs.c.min_version >= version - spec.async_level,
        )
        .group_by(subs.c.status)
    ).all()
    samples = {status: int(n) for status, n in rows}
    leased = conn.execute(
        sa.select(sa.func.count()).where(
            db.leases.c.pool_id == spec.pool_id,
            db.leases.c.node_id == node_id,
            db.leases.c.state == "active",
        )
    ).scalar_one()
    return Supply(
        leased=int(leased),  # leases, not tasks: only whether any is on its way matters
        pending=samples.get("pending", 0) // g,
        trainable=0,
        unchecked=samples.get("unchecked", 0) // g,
    )


def leases_overdue(conn: sa.Connection, pool_id: str, before: float) -> bool:
    """Whether no active lease of the pool was created at or after ``before`` (Unix s)."""
    recent = conn.execute(
        sa.select(sa.func.count()).where(
            db.leases.c.pool_id == pool_id,
            db.leases.c.state == "active",
            db.leases.c.created_at >= before,
        )
    ).scalar_one()
    return int(recent) == 0


def tasks_per_step(
    conn: sa.Connection, spec: PoolSpec, version: int, told: int | None
) -> float | None:
    """T: tasks per trainer step over its last :data:`MEASURED_STEPS` steps (those it took a
    batch for, trained or being trained); ``told`` until a step has been measured."""
    subs = db.submissions
    first = max(0, version - MEASURED_STEPS)
    if version <= first:
        return None if told is None else float(told)
    taken = conn.execute(
        sa.select(sa.func.coalesce(sa.func.sum(subs.c.n_samples), 0)).where(
            subs.c.pool_id == spec.pool_id,
            subs.c.status.in_(("trained", "leased")),
            subs.c.consumed_step >= first,
            subs.c.consumed_step < version,
        )
    ).scalar_one()
    if not taken:
        return None if told is None else float(told)
    return int(taken) / spec.samples_per_task / (version - first)
