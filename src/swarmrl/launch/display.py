"""The live terminal view of a local swarm, drawn from the roles' status files.

:func:`render` is a pure function of the status reports and the supervisor's process table,
so it can be tested by rendering to text. :class:`LiveDisplay` redraws it with ``rich.live``
(or, when stdout is not a terminal, prints one summary line per interval).

Knows nothing about how the numbers are produced; each role decides what it reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType

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
    """(accepted, rejected) verdicts on ``node_id``'s submissions, summed over validators."""
    if node_id is None:
        return 0.0, 0.0
    validators = [s.metrics for s in statuses.values() if s.role == "validator"]
    return (
        sum(m.get(f"accepted.{node_id}", 0.0) for m in validators),
        sum(m.get(f"rejected.{node_id}", 0.0) for m in validators),
    )


def summary_line(statuses: Mapping[str, RoleStatus], total_steps: int | None = None) -> str:
    """One line: step, version, reward, accuracy, submissions and bans."""
    trainer = next((s for s in statuses.values() if s.role == "trainer"), None)
    validators = [s for s in statuses.values() if s.role == "validator"]
    accepted = sum(s.metrics.get("accepted", 0) for s in validators)
    rejected = sum(s.metrics.get("rejected", 0) for s in validators)
    banned = sum(s.metrics.get("banned", 0) for s in validators)
    step = _metric(trainer, "step")
    of = f"/{total_steps}" if total_steps is not None else ""
    return (
        f"step {_fmt(step)}{of}  version {_fmt(trainer.policy_version if trainer else None, 'd')}"
        f"  reward {_fmt(_metric(trainer, 'reward_mean'), '.3f')}"
        f"  held-out acc {_fmt(_metric(trainer, 'accuracy'), '.1%')}"
        f"  submissions accepted {accepted:.0f} rejected {rejected:.0f}  banned {banned:.0f}"
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
    for column in ("role", "node", "state", "version", "work", "rate", "ok / bad", "seen"):
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
            ok, bad = node_verdicts(statuses, status.node_id)
            verdicts = f"{ok:.0f} / {bad:.0f}"
        elif status.role == "validator":
            work = f"{m.get('tokens_replayed', 0):.0f} tok replayed"
            rate = f"{m.get('banned', 0):.0f} banned"
            verdicts = f"{m.get('accepted', 0):.0f} / {m.get('rejected', 0):.0f}"
        elif status.role == "trainer":
            work = f"step {m.get('step', 0):.0f}"
            rate = f"idle {m.get('idle_fraction', 0):.0%}"
            verdicts = "—"
        elif status.role == "orchestrator":
            work = f"{m.get('submissions', 0):.0f} submissions"
            rate = f"{m.get('pending', 0):.0f} pending"
            ok = sum(m.get(k, 0) for k in ("accepted", "leased", "trained"))
            verdicts = f"{ok:.0f} / {m.get('rejected', 0):.0f}"
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
    one line per phase of the trainer, per RL step, per role event (a ban, a download), and
    warm-start progress with an estimate of the time left. Nothing is printed twice.

    :meth:`lines` takes the latest status reports and returns the lines not yet told."""

    WARM_START_LINES = 10  # progress lines over a whole warm start

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, str] = {}
        self.step = 0.0
        self.events: set[tuple[str, str]] = set()
        self.sft: tuple[float, float] | None = None  # (clock, sft step) when it was first seen
        self.sft_told = 0.0

    def lines(self, statuses: Mapping[str, RoleStatus], total_steps: int | None) -> list[str]:
        out: list[str] = []
        for name, status in sorted(statuses.items()):
            state = status.state
            if status.role == "trainer":
                out += self._trainer(status, total_steps, statuses)
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
        self, status: RoleStatus, total: int | None, statuses: Mapping[str, RoleStatus]
    ) -> list[str]:
        m, out = status.metrics, []
        done, steps = m.get("sft_step"), m.get("sft_steps")
        if done is not None and steps and status.state == "warm start":
            now = self.clock()
            if self.sft is None:
                self.sft = (now, done)
            if done - self.sft_told >= steps / self.WARM_START_LINES or done >= steps:
                self.sft_told = done
                began, first = self.sft
                rate = (done - first) / (now - began) if now > began else 0.0
                left = f", about {(steps - done) / rate:.0f} s left" if rate > 0 else ""
                loss = m.get("sft_loss")
                out.append(
                    f"trainer: warm start step {done:.0f}/{steps:.0f}"
                    + (f", loss {loss:.3f}" if loss is not None else "")
                    + left
                )
        step = m.get("step", 0.0)
        if step > self.step:
            self.step = step
            out.append("trainer: " + summary_line(statuses, total))
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
    ) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(render(statuses, processes, total_steps, title))
            return
        for line in self._narrator.lines(statuses, total_steps):
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
