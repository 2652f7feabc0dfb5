"""A server process's full garbage collections run on a schedule of its own
(swarmrl.serving.FullCollections), not whenever the interpreter decides."""

import gc
import time
import weakref

import pytest

from swarmrl.config.pool import PoolConfig
from swarmrl.serving import FullCollections


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _old_cycle() -> weakref.ref:
    """A reference cycle that reached the oldest generation, then became garbage."""
    cycle = _Cycle()
    gc.collect(1)  # survivors of generations 0 and 1 move to the oldest
    ref = weakref.ref(cycle)
    del cycle
    return ref


def test_the_oldest_generation_is_collected_on_schedule_and_only_then():
    before = gc.get_threshold()
    pacing = FullCollections(every_s=0.5).start()
    try:
        assert gc.get_threshold() == (before[0], before[1], FullCollections.NEVER)
        ref = _old_cycle()
        junk = [[i] for i in range(200_000)]  # many young collections meanwhile
        del junk
        gc.collect(1)
        assert ref() is not None or pacing.runs > 0  # only a scheduled run frees it
        deadline = time.monotonic() + 10
        while (ref() is not None or pacing.runs == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ref() is None and pacing.runs >= 1
    finally:
        pacing.stop()
    assert gc.get_threshold() == before


def test_a_period_must_be_positive_and_the_orchestrator_paces_hourly_by_default():
    with pytest.raises(ValueError, match="period"):
        FullCollections(every_s=0)
    assert PoolConfig().full_gc_every_s == 3600.0
