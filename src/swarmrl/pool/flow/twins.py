"""Twins: an unchecked unit generated again by another node, compared instead of replayed.

Sampling is seeded by the unit (``WorkUnit.seed``), so two honest nodes given the same unit on
the same policy version produce the same tokens. A share ``twin_fraction`` of the unchecked
submissions (drawn under the epoch secret like the spot check, ``"twin/<pool>/<submission>"``;
recorded as ``check.twin`` in the submission's ledger entry) has its unit leased once more to
another node (a lease row in state ``twin``, handed out before fresh work, never to the node
that submitted it, lapsed when nobody took it within ``lease_timeout_s`` or once no other node
of the pool is healthy; none is leased while no other node is healthy). It is offered first
to one node drawn at random among the healthy others (``twin_taker``), and to any other node
only once it waited ``lease_target_s`` (one lease's time for the drawn node to ask) or the
drawn node is no longer healthy: a party holding a second identity beside many honest nodes
wins the twin of its own unit by chance, not by asking first. While its twin is
out, the unit is not released by later passed checks (``spotcheck.passed``). When the twin's
answer arrives (:func:`compare_with`, before its spot-check draw; :func:`settle`):

- **equal** (the same tokens, turns and finish reasons on the same versions, and every declared
  log-prob within :data:`LOGPROB_TOLERANCE` of the other's): the twin's submission is
  ``matched``: credited, never trained (its samples are the original's), never judged. The
  original is not released by the match: it waits for the usual release (``release_after_checks``
  later passed checks of its node), because a party holding two identities can ask for the
  twin of its own falsified unit with the second one (the twin's holder sees whose unit it
  repeats) and answer it alike; a match must not be a faster way to training than honest work
  has. Twins add a chance to catch a falsified unit before its release, never a release;
- **different**: whatever of the two is still unchecked goes to validators (status
  ``pending``): the replay decides which node lied, and the liar is banned like any failed
  check. An honest pair that differs (a near-tie resolved differently on two engines) costs
  two replays, no blame;
- **apart** (the two were generated on different policy versions): no comparison. The
  original, if still unchecked, goes to validators all the same, so a node cannot dodge its
  twin by declaring another version than the one the twin's node will hold; the twin's
  submission is drawn for a spot check like any other (its node could otherwise choose
  "apart" to go unchecked). An original that is gone (rejected, dropped) is not compared.

A release entry (``"twin": true``) records each comparison, and both submission entries carry
``digest`` (SHA-256 of the canonical samples without proofs and log-probs), so ``ledger
verify`` re-derives that a match released only equal digests. A compared twin's submission
is drawn for no spot check (its rate is 0): its match judges it.

What a twin does not catch: a party holding both identities of a pair (it can answer its twin
with the same falsified output; the original then still waits for the usual release, and the
copied answer keeps its credit unchecked until the original's node is banned, which sends the
copy to validators: ``swarmrl.pool.trust.penalties``), and the declared log-probs within the
tolerance. A
node cannot tell that its own unit was twinned; the twin's holder can tell it holds someone's unit again
(``origin_node_id``), not whose output it will be compared with. Runs inside the caller's
transaction; knows nothing about HTTP.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from swarmrl.fastsql import Fast
from swarmrl.identity.keys import canonical_json, digest_hex
from swarmrl.ledger.chain import Entry
from swarmrl.pool.state import db
from swarmrl.pool.trust.service import Context
from swarmrl.protocol.pool import PoolSpec, Sample

# nats: declared log-probs of a matched pair may differ by this much per token (two engines'
# honest log-probs of the same tokens); more sends both to a replay
LOGPROB_TOLERANCE = 0.05
GONE = ("rejected", "dropped", "quarantined")  # an original in these is not compared
Outcome = Literal["equal", "different", "apart"]


def _alike(s: Sample) -> list[Any]:
    """What two honest twins produce alike in one sample: task, version, tokens, finish reason
    and turn structure (not the proof, not the log-probs)."""
    episode = None if s.episode is None else s.episode.model_dump(mode="json")
    return [s.task_index, s.policy_version, s.prompt_tokens, s.output_tokens, s.finish_reason,
            episode]  # fmt: skip


def digest(samples: list[Sample]) -> str:
    """SHA-256 of what two honest twins produce alike (:func:`_alike`), for the ledger."""
    return digest_hex(canonical_json([_alike(s) for s in samples]))


def compare(ours: list[Sample], theirs: list[Sample]) -> Outcome:
    """Whether two answers to one unit are equal, different, or not comparable (other
    tasks or policy versions)."""
    if [(s.task_index, s.policy_version) for s in ours] != [
        (s.task_index, s.policy_version) for s in theirs
    ]:
        return "apart"
    if [_alike(s) for s in ours] != [_alike(s) for s in theirs]:
        return "different"
    for a, b in zip(ours, theirs, strict=True):
        if len(a.logprobs) != len(b.logprobs):
            return "different"
        pairs = zip(a.logprobs, b.logprobs, strict=True)
        if not all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in pairs):
            return "different"  # NaN and infinities compare false: different
    return "equal"


# built once (a submission runs it): one healthy node other than the unit's, at random
_TAKER = Fast(
    sa.select(db.nodes.c.node_id)
    .where(
        db.nodes.c.pool_id == sa.bindparam("p"),
        db.nodes.c.node_id != sa.bindparam("n"),
        db.nodes.c.state == "healthy",
    )
    .order_by(sa.func.random())
    .limit(1)
)


def draw_taker(conn: sa.Connection, pool_id: str, node_id: str) -> str | None:
    """A node drawn at random among the pool's healthy ones other than ``node_id``, to offer
    the twin of its unit to first; None when there is none (module docstring)."""
    return _TAKER.run(conn, {"p": pool_id, "n": node_id}).scalar()


def lease_twin(
    conn: sa.Connection,
    spec: PoolSpec,
    sid: str,
    node_id: str,
    lease: Any,
    now: float,
    taker: str | None,
) -> None:
    """Put submission ``sid``'s unit (its lease row ``lease``) out again for another node,
    offered first to ``taker`` (:func:`draw_taker`)."""
    conn.execute(
        db.leases.insert(),
        dict(
            lease_id=uuid.uuid4().hex,
            pool_id=spec.pool_id,
            node_id=node_id,
            state="twin",
            work=lease.work,
            n_tasks=lease.n_tasks,
            created_at=now,
            deadline=now + spec.lease_timeout_s,
            twin_of=sid,
            twin_node=node_id,
            twin_taker=taker,
        ),
    )


@dataclass(frozen=True)
class Comparison:
    """A twin's answer against the unit it repeats: the outcome, and the original's node and
    status when compared."""

    original: str
    node_id: str
    status: str
    outcome: Outcome

    @property
    def judged(self) -> bool:
        """Whether the match judges the twin's submission (equal or different): it is then
        drawn for no spot check."""
        return self.outcome != "apart"


def compare_with(
    ctx: Context, conn: sa.Connection, original: str, samples: list[Sample]
) -> Comparison | None:
    """Compare a twin's ``samples`` with submission ``original``'s (None when it is gone:
    rejected, dropped or quarantined, and so no longer compared)."""
    subs = db.submissions
    row = conn.execute(
        sa.select(subs.c.node_id, subs.c.status, subs.c.rollout_key).where(
            subs.c.submission_id == original
        )
    ).first()
    if row is None or row.status in GONE:
        return None
    outcome = compare(samples, ctx.store.get_samples(row.rollout_key))
    return Comparison(original, row.node_id, row.status, outcome)


def settle(ctx: Context, conn: sa.Connection, spec: PoolSpec, sid: str, c: Comparison) -> Entry:
    """Submission ``sid`` answered the twin of ``c.original``: set both statuses by the
    outcome (module docstring) and return the ``release`` entry to append."""
    unchecked = [c.original] if c.status == "unchecked" else []
    body: dict[str, Any] = {"by": sid, "twin": True, "matched": c.outcome == "equal"}
    if c.outcome == "equal":  # the original waits for the usual release (module docstring)
        body["submission_ids"] = []
        _set(conn, [sid], "matched")
    else:
        body["submission_ids"] = []
        body["replay"] = unchecked + ([sid] if c.outcome == "different" else [])
        if c.outcome == "apart":
            body["apart"] = True
        _set(conn, body["replay"], "pending")
    return Entry("release", body, spec.pool_id, c.node_id, ctx.clock())


# built once (an accepting verdict runs it): the original a trainer was served already whose
# twin lease "l" answered
_SERVED_ORIGINAL = Fast(
    sa.select(db.submissions.c.rollout_key)
    .join(db.leases, db.leases.c.twin_of == db.submissions.c.submission_id)
    .where(
        db.leases.c.lease_id == sa.bindparam("l"),
        sa.or_(
            db.submissions.c.status.in_(("leased", "trained")),
            db.submissions.c.consumed_step.is_not(None),
        ),
    )
)


def repeats_served(ctx: Context, conn: sa.Connection, lease_id: str, samples: list[Sample]) -> bool:
    """Whether ``samples``, the answer of twin lease ``lease_id``, equal its original's and a
    trainer was served the original already: such an answer (a copy a ban sent to a check)
    stays ``matched`` when accepted, credited and never trained, since its samples trained
    once (``swarmrl.pool.trust.penalties``). An answer that differs (on another version, or a
    near-tie resolved otherwise) is a sample of its own and trains when accepted."""
    row = _SERVED_ORIGINAL.run(conn, {"l": lease_id}).first()
    return row is not None and compare(samples, ctx.store.get_samples(row.rollout_key)) == "equal"


def _set(conn: sa.Connection, ids: list[str], status: str) -> None:
    if ids:
        subs = db.submissions
        conn.execute(subs.update().where(subs.c.submission_id.in_(ids)).values(status=status))
