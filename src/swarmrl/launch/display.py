"""The live terminal view of a local swarm, drawn from the roles' status files.

:func:`render` is a pure function of the status reports and the supervisor's process table,
so it can be tested by rendering to text. :class:`LiveDisplay` redraws it with ``rich.live``
(or, when stdout is not a terminal, prints one summary line per interval).

Knows nothing about how the numbers are produced; each role decides what it reports.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
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
            verdicts = f"{m.get('accepted', 0):.0f} / {m.get('rejected', 0):.0f}"
        elif status.role == "validator":
            work = f"{m.get('tokens_replayed', 0):.0f} tok replayed"
            rate = f"{m.get('banned', 0):.0f} banned"
            verdicts = f"{m.get('accepted', 0):.0f} / {m.get('rejected', 0):.0f}"
        elif status.role == "trainer":
            work = f"step {m.get('step', 0):.0f}"
            rate = f"idle {m.get('idle_fraction', 0):.0%}"
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


class LiveDisplay:
    """Redraws :func:`render` in place on a terminal; prints a line per update otherwise."""

    def __init__(self, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console()
        self.enabled = enabled
        self._live: Live | None = None
        self._last_line = ""

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
        line = summary_line(statuses, total_steps)
        if line != self._last_line:
            self.console.print(line, highlight=False)
            self._last_line = line

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None
