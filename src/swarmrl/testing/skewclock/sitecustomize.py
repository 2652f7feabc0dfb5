"""A wall clock that is off, for a whole process: put this folder first on ``PYTHONPATH`` and set
``SWARMRL_CLOCK_SKEW_S`` (seconds, may be negative); Python's ``site`` imports this module before
the program's first line, and every ``time.time()`` and ``time.time_ns()`` of the process (and of
the Python processes it starts, which inherit both) reads that many seconds off, as on a machine
whose clock is. The monotonic clocks are left alone, as an unsynchronised wall clock leaves them.

Used by the multi-host test bed (``swarmrl.testing.deploy``, ``skew``) to run a role as a
volunteer with a bad clock would. Not a package: nothing imports it by name.
"""

import os
import time

_SKEW_S = float(os.environ.get("SWARMRL_CLOCK_SKEW_S") or 0.0)

if _SKEW_S:
    _real_time, _real_time_ns = time.time, time.time_ns
    _skew_ns = round(_SKEW_S * 1e9)

    def _time() -> float:
        return _real_time() + _SKEW_S

    def _time_ns() -> int:
        return _real_time_ns() + _skew_ns

    time.time, time.time_ns = _time, _time_ns
