"""Admission control: how many tasks the orchestrator may still lease without wasting work.

A rollout is worth generating only if the trainer will train on it while it is fresh: trainer
step n takes versions ≥ n − a (a = ``async_level``), so work leased now, at policy version V,
can be trained by at most the next ``a + 1`` steps, and by none after the run's last step.
Everything already leased, submitted or accepted but not yet trained competes for those steps.
With, in tasks (one task = one group of G completions)::

    T = tasks one trainer step consumes (measured over its last steps, filtered-out groups
        included; before the first measurement, what the trainer declared; unknown → no limit)
    W = min(a + 1, S − V)   steps that can still train work leased now (S = the run's steps;
                            unknown → a + 1)
    D = ⌈W · T⌉             demand: tasks the trainer can still consume while they are fresh
    L = tasks in active leases (being generated)
    P = fresh tasks submitted and awaiting a validator          (the validation backlog)
    Q = fresh tasks accepted or in a trainer's batch, untrained (the trainable backlog)
    U = fresh tasks not selected for a spot check, waiting for a later passed check of their
        node (``swarmrl.pool.flow.spotcheck``)
    F = tasks served to the trainer for step V or later and already used up: groups the online
        filter dropped, acknowledged at once; T counts them, so the supply must too, else
        every step whose batch is taken looks short by its filtered groups and the
        difference is leased again (work that arrives after the steps it could train have
        their batches); S = L + P + Q + U + F

a lease is granted iff ``W > 0``, ``S < D``, ``P < b_v · T`` and ``Q < b_t · T``
(``b_v``, ``b_t``: ``pool.admission_validation_backlog_steps`` and
``pool.admission_trainable_backlog_steps``), and it holds at most ``D − S`` tasks
(at least the pool's smallest unit). "Fresh" means every sample's version ≥ V − a: stale
submissions can never train and do not count as supply. Once the last step has its batch,
``W · T`` is covered by what the trainer already holds and nothing more is leased.

Unchecked work is supply the trainer cannot take yet: it waits for passed checks of later
submissions of its node (``release_after_checks`` of them, ``swarmrl.pool.flow.spotcheck``), and
a node refused work submits nothing that could be checked. So a node that holds fresh
unchecked work with nothing leased or awaiting a validator (``L_node + P_node = 0``) is
granted the pool's smallest unit m even when the supply already covers the demand
(:func:`unblock`): its next submission, checked with the node's rate p, is what releases that
work before it goes stale (or, with k > 1, one of the k checks it waits for). It is worth it when the units expected until a check cost no more
than what they release, ``m / p ≤ U_node`` (never at p = 0). Only one such unit is on its way
per node at a time, and never against the validation or trainable backlog or after the last
step.

Batches held ahead. The trainer keeps the informative groups a step did not need for the next
steps, so after a batch whose groups the filter spared it may hold the batches of steps beyond
the one it gathers for; it tells the pool the highest step B whose batch it holds whole (with
every earlier one's). No step up to B takes more work, so only versions ≥ B + 1 − a can still
train (:func:`trainable_from`): a lease at V asks for at least that version, and when it is
newer than V nothing is leased until it is published (a node waits ``admission_retry_s``).
The trainer also tells B when it holds the batch of the run's last step (B = S − 1, whether or
not beyond the step it gathers for): then no work leased from now on can ever train, and
nothing is leased, not even the unit :func:`unblock` grants a node to release its unchecked
work (:func:`last_batch_held`). The demand D is not changed by it. Ignored while the trainer
is starving (below): a trainer started again holds less than the one before it told, until it
says so itself.

T and Q are estimates (a step may filter out more groups than measured so far; part of a
submission the trainer holds may already be trained), so a trainer that is *starving* — its
last request for rollouts, within :data:`STARVING_WITHIN_S`, came back empty — while nothing
is on its way to it (``L + P = 0``, or ``P = 0`` and every active lease is overdue: older
than :data:`OVERDUE_LEASE_TARGETS` × the pool's ``lease_target_s``, the time a unit is sized
to take, so a node holding a lease it does not work on cannot hold the run until the lease
times out) overrides ``S < D`` and the trainable bound (U is released only by the node's next
checked submission, so it never counts as on its way): it
gets what a node asks for, so an estimate can never stall the run. While work is leased or
awaits a validator, that work is the answer to a starving trainer; leasing more would only
make it stale.

Fair grants under starvation. The override above hands out one unit, then the lease it made
holds the gate shut until it is overdue; whoever asks first when it opens would take the next
unit, so a pack of fresh identities polling faster than an honest node could take every grant
and starve it. So a grant the override makes goes by a turn no identity wins by asking first
or by being new (:meth:`Askers.starving_turn`): among the nodes that asked while the trainer starved
and asked again within :data:`ASKING_WITHIN_RETRIES` admission retries (so still wait), first
the best record, ``min(accepted verdicts, probation length)`` (a node past probation outranks
every fresh identity, and nodes past it are equals), then round-robin among equals (least
recently granted such a unit first, never granted first), then the longest waiting. The
override only adds to the ordinary rules: a node whose turn it is not gets what they give it
(room the demand leaves, the lift of :func:`unblock`) as if the trainer were fed, and is told to
wait only where they give nothing (else, across a slow link, each node would wait a retry and a
round trip at every other unit for the other's turn). A winner that stops asking drops out
after that window, so a gone node delays the grant by that much at most. The askers are kept per server process,
as the starvation signal is: with several processes a node competes where its requests land.

Fair grants otherwise. Room for more work opens when the trainer takes a step, and whoever asks
first would fill it: a node that asks the moment it submits (it has a free slot at once) would
take every opening from a node that asks on the retry it was told, and a node that submits
often could hold the others out of a run. So the ordinary grants are first come, first served
among the nodes still asking (:meth:`Askers.ahead_of`): a node's place is when its current run
of asks began, a grant sends it to the back, and a grant to a node leaves the smallest unit m
for each node waiting longer, ``room − ahead · m ≥ m``, or it is told to wait. A new identity
joins at the back, so asking first or being new wins nothing here either. Nodes that stop
asking drop out after the same window as above. The lift :func:`unblock` makes for a node's own
unchecked work is not queued: it is that node's work the unit releases.

Pure arithmetic; the counts come from ``swarmrl.pool.flow.progress``. Knows nothing about the
database or HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STARVING_WITHIN_S = 2.0  # an empty batch reply this recent means the trainer waits for work
OVERDUE_LEASE_TARGETS = 2.0  # a lease older than this many lease_target_s is overdue
# a node that asked within this many admission retries still waits for a starving grant
ASKING_WITHIN_RETRIES = 4


@dataclass(frozen=True)
class Supply:
    """Work already on its way to the trainer, in tasks (module docstring: L, P, Q, U, F)."""

    leased: int  # L: in active leases
    pending: int  # P: fresh, awaiting a validator
    trainable: int  # Q: fresh, accepted or in a trainer's batch, not yet trained
    unchecked: int = 0  # U: fresh, not spot-checked, trainable once a later check passes
    used: int = 0  # F: served for the current step or later, already used up (filtered out)

    @property
    def total(self) -> int:
        return self.leased + self.pending + self.trainable + self.unchecked + self.used


@dataclass(frozen=True)
class Admission:
    """A lease decision: ``tasks`` > 0 grants at most that many tasks; 0 says wait (``reason``).
    ``covered``: refused only because the supply covers the demand (no backlog bound, not the
    run's end), the one refusal :func:`unblock` may lift. ``starving``: granted only because
    the trainer starves (the override), so it goes by :meth:`Askers.starving_turn`. ``room``:
    the tasks the demand leaves for all askers, shared first come, first served
    (:meth:`Askers.ahead_of`)."""

    tasks: int
    reason: str = ""
    covered: bool = False
    starving: bool = False
    room: int | None = None  # D − S where the supply bounds the grant; None: no bound


def steps_left(version: int, steps: int | None, async_level: int) -> int:
    """W: steps that can still train work leased at ``version`` (module docstring)."""
    window = async_level + 1
    return window if steps is None else max(0, min(window, steps - version))


def lowest_useful_version(
    version: int, async_level: int, blocked: bool = False, lag: int = 0
) -> int:
    """The oldest policy a fresh lease's work may be generated with (its ``min_version``).

    Step n trains versions ≥ n − a, and the trainer gathers step n + 1's batch while step n
    trains (``swarmrl.roles.trainer.source``): at version V step V has its batch and step
    V + 1's is being gathered from what is accepted now, oldest first. Work leased now
    arrives after a generation and a check, so only steps from V + 2 on still take it: a
    worker still holding version V − 1 when a = 2 would generate work that only steps V and
    V + 1 could train, wasted behind the older work that fills them. So the lease asks for a
    version ≥ V + 2 − a (never above V: with a ≤ 2 the current one, and the worker waits for
    its download, a fraction of a step). ``lag`` (the pool's ``lease_version_lag``) lowers
    that by as many versions, never below V − a: where the download is no fraction of a step
    (the trainer's host far from the workers) a worker generates on the version it holds
    meanwhile (docs/pool.md, "Admission control", measured there). ``blocked``: the trainer's
    step V itself still waits for its batch (its last request, for step V, came back empty;
    an empty prefetch for V + 1 does not count), so any version step V can train (≥ V − a) is
    taken at once."""
    if blocked:
        return max(0, version - async_level)
    return max(0, version - async_level, min(version, version + 2 - async_level) - lag)


def trainable_from(batched_through: int, async_level: int) -> int:
    """The oldest version whose work a step still short of its batch can train, when the
    trainer holds the whole batch of every step up to ``batched_through`` (B): step B + 1 takes
    versions ≥ B + 1 − a (module docstring, "Batches held ahead")."""
    return batched_through + 1 - async_level


def last_batch_held(batched_through: int, steps: int | None) -> bool:
    """Whether the trainer holds the batch of the run's last step (``steps`` − 1): no work
    leased from then on can train (module docstring, "Batches held ahead")."""
    return steps is not None and batched_through >= steps - 1


def demand(version: int, steps: int | None, async_level: int, tasks_per_step: float) -> int:
    """D = ⌈W · T⌉ tasks."""
    return math.ceil(steps_left(version, steps, async_level) * tasks_per_step - 1e-9)


def admit(
    supply: Supply,
    version: int,
    steps: int | None,
    async_level: int,
    tasks_per_step: float | None,
    validation_backlog_steps: float,
    trainable_backlog_steps: float,
    wanted: int,
    smallest: int,
    starving: bool = False,
    leases_overdue: bool = False,
) -> Admission:
    """Grant up to ``wanted`` tasks (never fewer than ``smallest``) or say why not (module
    docstring). ``tasks_per_step`` None: the trainer's pace is unknown, so ``wanted`` is
    granted as long as the run has steps left. ``starving``: the trainer waits for work now
    (it overrides the demand only while nothing awaits a validator and nothing is leased or
    every active lease is overdue: ``leases_overdue``)."""
    early = without_supply(version, steps, async_level, tasks_per_step, wanted)
    if early is not None:
        return early
    assert tasks_per_step is not None  # without_supply decides every case without it
    need = demand(version, steps, async_level, tasks_per_step)
    if starving and supply.pending == 0 and (supply.leased == 0 or leases_overdue):
        return Admission(max(smallest, wanted), starving=True)
    if supply.pending >= validation_backlog_steps * tasks_per_step:
        return Admission(
            0,
            f"validation backlog: {supply.pending} tasks await a validator "
            f"(bound {validation_backlog_steps:g} steps × {tasks_per_step:.0f} tasks)",
        )
    if supply.trainable >= trainable_backlog_steps * tasks_per_step:
        return Admission(
            0,
            f"trainable backlog: {supply.trainable} tasks wait for the trainer "
            f"(bound {trainable_backlog_steps:g} steps × {tasks_per_step:.0f} tasks)",
        )
    room = need - supply.total
    if room <= 0:
        return Admission(
            0,
            f"the trainer has enough: {supply.total} tasks leased, submitted or queued ≥ "
            f"{need} it can train while fresh",
            covered=True,
        )
    return Admission(max(smallest, min(wanted, room)), room=room)


def without_supply(
    version: int, steps: int | None, async_level: int, tasks_per_step: float | None, wanted: int
) -> Admission | None:
    """:func:`admit`'s decision where the supply plays no part (the run's last step has its
    rollouts; the trainer's pace is unknown), else None: counting the supply reads the pool's
    whole fresh backlog, so a caller asks this first."""
    if steps_left(version, steps, async_level) == 0:
        return Admission(0, f"the run's last step ({steps}) has its rollouts")
    if tasks_per_step is None:
        return Admission(wanted)
    return None


def unblock(decision: Admission, node: Supply, smallest: int, check_rate: float) -> Admission:
    """``decision`` for one node, lifted to the smallest unit m when the node holds fresh
    unchecked work U with ``m ≤ p · U`` (p = ``check_rate``, the node's chance that a
    submission is checked) and nothing of it is leased or awaits a validator (module
    docstring); ``node``: that node's own L, P and U."""
    idle = node.leased + node.pending == 0
    worth = check_rate > 0 and smallest <= check_rate * node.unchecked + 1e-9
    if decision.covered and idle and worth:
        return Admission(smallest)
    return decision


@dataclass
class Asker:
    """A node waiting for a grant (module docstring, "Fair grants")."""

    record: int  # its accepted verdicts, capped at the probation length
    first_asked: float  # s: when its current run of asks began
    last_asked: float  # s


@dataclass
class Askers:
    """One pool's nodes waiting for a grant, and when each last had one: one set for the grants
    a starving trainer forces, one for the ordinary grants (module docstring, "Fair grants")."""

    askers: dict[str, Asker] = field(default_factory=dict)
    granted_at: dict[str, float] = field(default_factory=dict)

    def ask(self, node_id: str, record: int, now: float, within_s: float) -> None:
        """Note that ``node_id`` (with ``record``) asks at ``now``; forget askers silent for
        ``within_s`` or longer (they no longer wait)."""
        gone = [n for n, a in self.askers.items() if now - a.last_asked >= within_s]
        for n in gone:
            del self.askers[n]
        asker = self.askers.get(node_id)
        if asker is None:
            self.askers[node_id] = Asker(record, now, now)
        else:
            asker.record, asker.last_asked = record, now

    def starving_turn(self) -> str | None:
        """The node whose turn the next starving grant is: best record, then least recently
        granted one, then longest waiting (module docstring); None when nobody waits."""
        if not self.askers:
            return None

        def rank(node_id: str) -> tuple[int, float, float, str]:
            asker = self.askers[node_id]
            last = self.granted_at.get(node_id, -math.inf)
            return (-asker.record, last, asker.first_asked, node_id)

        return min(self.askers, key=rank)

    def ahead_of(self, node_id: str) -> int:
        """How many waiting nodes an ordinary grant serves before ``node_id``: those whose run
        of asks began earlier (first come, first served; module docstring)."""
        me = self.askers[node_id]
        return sum(
            1
            for other, asker in self.askers.items()
            if (asker.first_asked, other) < (me.first_asked, node_id)
        )

    def granted(self, node_id: str, now: float) -> None:
        """``node_id`` took a grant at ``now``: it waits no more, and goes to the back."""
        self.askers.pop(node_id, None)
        self.granted_at[node_id] = now


def fair_share(decision: Admission, ahead: int, smallest: int) -> Admission:
    """``decision`` for a node with ``ahead`` nodes waiting longer: each of them keeps the
    smallest unit of the room, and the node gets what is left, or waits (module docstring,
    "Fair grants otherwise"). Grants without a room bound pass unchanged."""
    if not decision.tasks or decision.room is None or ahead == 0:
        return decision
    left = decision.room - ahead * smallest
    if left < smallest:
        return Admission(
            0,
            f"{ahead} node(s) waiting longer are served first (room for {decision.room} tasks)",
        )
    return Admission(max(smallest, min(decision.tasks, left)), room=left)
