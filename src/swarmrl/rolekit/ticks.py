"""Periodic actions on a fixed grid of times, each node at its own random phase.

An action repeated "every P seconds" by sleeping P after each answer drifts by the answer's
latency: the nodes a busy server answered late in the same moment come back together one
period later, are answered late together again, and so on, so a pool of thousands of nodes turns
one busy moment into a wave that returns every period (in the pool's load bench, ~810 requests
a second, 500 of them beats, arrived as seconds of 270 to 1,600). A :class:`FixedRate`
keeps its ticks at ``first + k·period`` whatever the answers took: a late answer does not move
the next tick, and ticks missed while an action ran long are skipped, not made up in a burst.
Nodes that start at random phases then stay spread over the period.

Knows nothing about what the action is or which clock is used (callers pass ``now_s``).
"""

from __future__ import annotations

import math
import random


class FixedRate:
    """Ticks every ``period_s`` seconds from ``first_s`` (same clock as every ``now_s``)."""

    def __init__(self, period_s: float, first_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"a period must be > 0 seconds, got {period_s!r}")
        self.period_s = period_s
        self.next_s = first_s

    @classmethod
    def random_phase(
        cls, period_s: float, now_s: float, rng: random.Random | None = None
    ) -> FixedRate:
        """Ticks every ``period_s``, the first at a uniformly random moment of the coming
        period (so that nodes started together do not tick together)."""
        draw = (rng or random).random()
        return cls(period_s, now_s + draw * period_s)

    def wait_s(self, now_s: float) -> float:
        """Seconds from ``now_s`` to the next tick (0 when it is due or past)."""
        return max(0.0, self.next_s - now_s)

    def advance(self, now_s: float) -> int:
        """Move to the first tick of the grid after ``now_s`` (call once the action is done);
        returns how many ticks were skipped because the action ran past them."""
        if self.next_s > now_s:  # not due yet: the next tick stays
            return 0
        behind = math.floor((now_s - self.next_s) / self.period_s) + 1
        self.next_s += behind * self.period_s
        return behind - 1
