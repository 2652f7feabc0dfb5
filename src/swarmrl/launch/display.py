"""The live terminal view of a local swarm, drawn from the roles' status files.

:func:`render` is a pure function of the status reports and the supervisor's process table,
so it can be tested by rendering to text. :class:`LiveDisplay` redraws it with ``rich.live``
(or, when stdout is not a terminal, prints one summary line per interval). :class:`StepRows`
follows the trainer's step rows the view shows.

Knows nothing about how the numbers are produced; each role decides what it reports.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from swarmrl.protocol.swarm import RoleStatus


def _fmt(value: float | int | None, spec: str = ".0f") -> str:
    return "—" if value is None else format(value, spec)


def _metric(status: RoleStatus | None, key: str) -> float | None:
    return None if status is None else status.metrics.get(key)


def node_verdicts(statuses: Mapping[str, RoleStatus], node_id: str | None) -> tuple[float, float]:
    """(checked, rejected) submissions of ``node_id``, summed over validators (the words of
    ``swarmrl.ledger.counts``)."""
    if node_id is None:
        return 0.0, 0.0
    validators = [s.metrics for s in statuses.values() if s.role == "validator"]
    return (
        sum(m.get(f"checked.{node_id}", 0.0) for m in validators),
        sum(m.get(f"rejected.{node_id}", 0.0) for m in validators),
    )


# the run's submission counts on the console, in the order and words of swarmrl.ledger.counts
COUNT_WORDS = ("taken_in", "checked", "accepted", "rejected", "invalidated", "trained")


def submission_counts(statuses: Mapping[str, RoleStatus]) -> str:
    """``submissions: 12 taken in, 5 checked, ... ; banned 1``: the orchestrator's counts (from
    its ledger), bans from the validators; "—" for a count no role reports (no orchestrator)."""
    pool = next((s for s in statuses.values() if s.role == "orchestrator"), None)
    banned = sum(s.metrics.get("banned", 0) for s in statuses.values() if s.role == "validator")
    counts = ", ".join(
        f"{_fmt(_metric(pool, word))} {word.replace('_', ' ')}" for word in COUNT_WORDS
    )
    return f"submissions: {counts}; {banned:.0f} nodes banned"


def summary_line(statuses: Mapping[str, RoleStatus], total_steps: int | None = None) -> str:
    """One line: steps done, version, reward, the last held-out accuracy, submissions, bans."""
    trainer = next((s for s in statuses.values() if s.role == "trainer"), None)
    done = _metric(trainer, "step")
    of = f"/{total_steps}" if total_steps is not None else ""
    return (
        f"steps done {_fmt(done)}{of}"
        f"  version {_fmt(trainer.policy_version if trainer else None, 'd')}"
        f"  reward {_fmt(_metric(trainer, 'reward_mean'), '.3f')}"
        f"  last held-out acc {_fmt(_metric(trainer, 'accuracy'), '.1%')}"
        f"  {submission_counts(statuses)}"
    )


def step_line(row: Mapping[str, Any], total_steps: int | None) -> str:
    """One finished step, numbered as the trainer's log and ``steps.jsonl`` number it (from 0):
    ``step 2 (3/6 done)  reward 0.700  rollout acc 70.0%  staleness 0.5``."""
    of = f"/{total_steps}" if total_steps is not None else ""
    staleness = row.get("staleness")
    return (
        f"step {row['step']} ({row['step'] + 1}{of} done)"
        f"  reward {_fmt(row.get('reward_mean'), '.3f')}"
        f"  rollout acc {_fmt(row.get('accuracy'), '.1%')}"
        + (f"  staleness {staleness:.1f}" if staleness is not None else "")
    )


def render(
    statuses: Mapping[str, RoleStatus],
    processes: Mapping[str, bool],
    total_steps: int | None = None,
    title: str = "swarmrl",
) -> Group:
    """The whole view: a summary line, a table of roles, and recent events.

    ``processes`` maps role name → whether its process is alive (empty when the roles run
    elsewhere).
    """
    now = time.time()
    table = Table(title=title, expand=False, show_lines=False)
    for column in (
        "role",
        "node",
        "state",
        "version",
        "work",
        "rate",
        "checked / rejected",
        "seen",
    ):
        table.add_column(column)
    names = sorted(set(statuses) | set(processes))
    for name in names:
        status = statuses.get(name)
        alive = processes.get(name)
        state = status.state if status else "starting"
        if alive is False:
            state = f"[red]exited[/red] ({state})"
        if status is None:
            table.add_row(name, "—", state, "—", "—", "—", "—", "—")
            continue
        m = status.metrics
        if status.role == "worker":
            work = f"{m.get('rollouts', 0):.0f} rollouts"
            rate = f"{m.get('tokens_per_s', 0):.0f} tok/s"
            checked, bad = node_verdicts(statuses, status.node_id)
            verdicts = f"{checked:.0f} / {bad:.0f}"
        elif status.role == "validator":
            work = f"{m.get('tokens_replayed', 0):.0f} tok replayed"
            rate = f"{m.get('banned', 0):.0f} banned"
            verdicts = f"{m.get('checked', 0):.0f} / {m.get('rejected', 0):.0f}"
        elif status.role == "trainer":
            work = f"step {m.get('step', 0):.0f}"
            rate = f"idle {m.get('idle_fraction', 0):.0%}"
            verdicts = "—"
        elif status.role == "orchestrator":
            work = f"{m.get('taken_in', 0):.0f} taken in"
            rate = f"{m.get('pending', 0):.0f} pending"
            verdicts = f"{m.get('checked', 0):.0f} / {m.get('rejected', 0):.0f}"
        elif status.role == "relay":
            work = "serving" if status.policy_version is not None else "—"
            rate = f"{m.get('replication_errors', 0):.0f} errors"
            verdicts = "—"
        else:
            work, rate, verdicts = "—", "—", "—"
        age = now - status.updated_at
        table.add_row(
            name,
            (status.node_id or "—")[:8],
            state,
            _fmt(status.policy_version, "d"),
            work,
            rate,
            verdicts,
            f"{age:.0f}s ago",
        )
    events = [
        f"{name}: {event}" for name, status in sorted(statuses.items()) for event in status.events
    ][-6:]
    parts: list[Text | Table] = [Text(summary_line(statuses, total_steps), style="bold"), table]
    if events:
        parts.append(Text("\n".join(events), style="dim"))
    return Group(*parts)


class Narrator:
    """The run told in plain lines, for output that is not a terminal (a pipe, a log file):
    one line per phase of the trainer, exactly one per RL step (from the trainer's step rows,
    so none is skipped however fast steps go), one per held-out evaluation, one per role event
    (a ban, a restart), and warm-start progress with an estimate of the time left. Nothing is
    printed twice.

    :meth:`lines` takes the latest status reports (and step rows) and returns the lines not yet
    told."""

    WARM_START_LINES = 10  # progress lines over a whole warm start

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, str] = {}
        self.step = 0.0  # steps done, as the trainer's status says (without step rows)
        self.rows_told = 0  # step rows told
        self.evals_told = 0.0
        self.events: set[tuple[str, str]] = set()
        self.sft: tuple[float, float] | None = None  # (clock, sft step) when it was first seen
        self.sft_told = 0.0

    def lines(
        self,
        statuses: Mapping[str, RoleStatus],
        total_steps: int | None,
        steps: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[str]:
        """``steps``: the trainer's rows so far (``trainer/steps.jsonl``), one per finished step;
        None when they cannot be read here (each step then told from the status, which can
        miss a step that ended between two looks)."""
        out: list[str] = []
        for name, status in sorted(statuses.items()):
            state = status.state
            if status.role == "trainer":
                out += self._trainer(status, total_steps, statuses, steps)
                if _in_step(state):
                    continue
            elif state.startswith(BUSY_STATES.get(status.role, ())):
                continue  # a role's busy loop, not news
            if self.states.get(name) != state:
                self.states[name] = state
                out.append(f"{name}: {state}")
        for name, status in sorted(statuses.items()):
            for event in status.events:
                if (name, event) not in self.events and ROUTINE_EVENT not in event:
                    self.events.add((name, event))
                    out.append(f"{name}: {event}")
        return out

    def _trainer(
        self,
        status: RoleStatus,
        total: int | None,
        statuses: Mapping[str, RoleStatus],
        steps: Sequence[Mapping[str, Any]] | None,
    ) -> list[str]:
        m, out = status.metrics, []
        done, sft_steps = m.get("sft_step"), m.get("sft_steps")
        if done is not None and sft_steps and status.state == "warm start":
            now = self.clock()
            if self.sft is None:
                self.sft = (now, done)
            due = done - self.sft_told >= sft_steps / self.WARM_START_LINES or done >= sft_steps
            if done > self.sft_told and due:
                self.sft_told = done
                began, first = self.sft
                rate = (done - first) / (now - began) if now > began else 0.0
                left = f", about {(sft_steps - done) / rate:.0f} s left" if rate > 0 else ""
                loss = m.get("sft_loss")
                out.append(
                    f"trainer: warm start step {done:.0f}/{sft_steps:.0f}"
                    + (f", loss {loss:.3f}" if loss is not None else "")
                    + left
                )
        if steps is not None:
            for row in steps[self.rows_told :]:
                out.append(f"trainer: {step_line(row, total)}  {submission_counts(statuses)}")
            self.rows_told = max(self.rows_told, len(steps))
        elif m.get("step", 0.0) > self.step:
            self.step = m["step"]
            out.append("trainer: " + summary_line(statuses, total))
        evals, accuracy = m.get("evals", 0.0), m.get("accuracy")
        if evals > self.evals_told and accuracy is not None:
            self.evals_told = evals
            told = self.rows_told if steps is not None else int(self.step)
            told = int(m.get("eval_after_steps", told))  # when it ran, where the trainer says
            when = f"after {told} RL steps" if told else "before RL"
            out.append(f"trainer: held-out accuracy {accuracy:.1%} ({when})")
        return out


# states a role passes through on every unit of work: the step lines tell that progress
BUSY_STATES: dict[str, tuple[str, ...]] = {
    "worker": ("generating", "submitting", "waiting for v", "paced", "idle"),
    "validator": ("replaying", "waiting for submissions"),
}
ROUTINE_EVENT = " downloaded v"  # every role fetches every version (time-stamped events)


def _in_step(state: str) -> bool:
    """The trainer's per-step states (told through the step lines instead)."""
    return state.startswith(("waiting for step", "training step"))


class LiveDisplay:
    """Redraws :func:`render` in place on a terminal; prints plain lines otherwise
    (:class:`Narrator`)."""

    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console()
        self.enabled = enabled
        self._live: Live | None = None
        self._narrator = Narrator()

    def __enter__(self) -> LiveDisplay:
        if self.enabled and self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def update(
        self,
        statuses: Mapping[str, RoleStatus],
        processes: Mapping[str, bool],
        total_steps: int | None = None,
        title: str = "swarmrl",
        steps: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Redraw, or print what is new; ``steps``: the trainer's step rows so far (see
        :meth:`Narrator.lines`)."""
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(render(statuses, processes, total_steps, title))
            return
        for line in self._narrator.lines(statuses, total_steps, steps):
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None


class StepRows:
    """The trainer's step rows (``trainer/steps.jsonl``, one JSON line per finished step), read
    as they are appended: a line still being written waits for the next read; a file replaced
    (a restarted trainer puts its history in place as a new file) or cut shorter is read again
    from its start, and so is one whose text at the offset is not a whole row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._identity: tuple[int, int] | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._identity or st.st_size < self._offset:
                    self.rows, self._offset = [], 0
                    self._identity = (st.st_dev, st.st_ino)
                while True:
                    f.seek(self._offset)
                    data = f.read()
                    complete = data[: data.rfind(b"\n") + 1]
                    try:
                        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
                    except ValueError:  # rewritten in place under the offset, or not rows
                        if self._offset:
                            self.rows, self._offset = [], 0
                            continue  # read again from the start
                        return []  # not rows (yet): none rather than a crashed display
                    self.rows += rows
                    self._offset += len(complete)
                    return self.rows
        except FileNotFoundError:
            return self.rows
