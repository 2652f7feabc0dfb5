"""Roles retry lost peers with bounded, logged waits and report status to files."""

import logging
import random
import threading
import time

import httpx
import pytest

from swarmrl.errors import PeerUnavailable, WaitTimeout
from swarmrl.protocol.swarm import RoleStatus
from swarmrl.rolekit.ticks import FixedRate
from swarmrl.rolekit.toolkit import StatusReporter, retry, wait_for

LOG = logging.getLogger("test")


def test_retry_recovers_after_transient_failures(caplog):
    attempts = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise httpx.ConnectError("connection refused")
        return "ok"

    with caplog.at_level(logging.INFO):
        assert retry(flaky, "lease work", LOG, give_up_s=10, pause_s=0.01) == "ok"
    assert len(attempts) == 3
    assert caplog.text.count("lease work failed") == 1  # once per failure streak
    assert "succeeded again after 2 failed attempts" in caplog.text


def test_a_peer_away_for_less_than_quiet_s_is_not_told_as_a_fault(caplog):
    attempts = []

    def back_soon() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise httpx.ConnectError("connection refused")
        return "ok"

    with caplog.at_level(logging.DEBUG):
        assert retry(back_soon, "fetch v", LOG, give_up_s=10, pause_s=0.01, quiet_s=5) == "ok"
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == []  # neither the streak nor its recovery
    assert "fetch v failed (ConnectError: connection refused)" in caplog.text  # at debug


def test_a_streak_longer_than_quiet_s_warns_once_when_it_has_lasted_that_long(caplog):
    started = time.monotonic()

    def gone() -> None:
        raise httpx.ConnectError("connection refused")

    with caplog.at_level(logging.INFO), pytest.raises(WaitTimeout):
        retry(gone, "fetch v", LOG, give_up_s=0.6, pause_s=0.05, quiet_s=0.3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].created - started >= 0.3 - 0.01
    assert "fetch v failed (ConnectError" in warnings[0].getMessage()


def test_a_call_failing_after_its_role_was_told_to_stop_is_not_a_warning(caplog):
    stop = threading.Event()

    def gone_as_the_run_ends() -> None:
        stop.set()  # the role is stopped while this call is on its way
        time.sleep(0.1)  # past quiet_s
        raise httpx.ConnectError("connection refused")

    with caplog.at_level(logging.INFO), pytest.raises(WaitTimeout, match="stopped"):
        retry(
            gone_as_the_run_ends, "fetch v", LOG, give_up_s=5, pause_s=0.01, stop=stop, quiet_s=0.05
        )
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_retry_and_wait_end_when_the_role_stops():
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()

    def gone() -> None:
        raise httpx.ConnectError("connection refused")

    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="submit unit: stopped while retrying"):
        retry(gone, "submit unit", LOG, give_up_s=600, pause_s=120, stop=stop)
    with pytest.raises(WaitTimeout, match="stopped while waiting for v2"):
        wait_for(lambda: None, "v2", LOG, timeout_s=600, pause_s=120, stop=stop)
    assert time.monotonic() - started < 60  # one pause not cut short would take 120 s


def test_retry_gives_up_naming_what_it_tried():
    def gone() -> None:
        raise PeerUnavailable("orchestrator did not answer")

    with pytest.raises(WaitTimeout, match="post verdict: peer unreachable"):
        retry(gone, "post verdict", LOG, give_up_s=0.1, pause_s=0.02)


def test_retry_lets_other_errors_through_at_once():
    calls = []

    def bug() -> None:
        calls.append(1)
        raise ValueError("not transient")

    with pytest.raises(ValueError):
        retry(bug, "x", LOG, give_up_s=10, pause_s=0.01)
    assert len(calls) == 1


def test_wait_for_times_out_with_what():
    with pytest.raises(WaitTimeout, match="version 3 on the relay"):
        wait_for(lambda: None, "version 3 on the relay", LOG, timeout_s=0.1, pause_s=0.02)


def test_wait_for_returns_the_first_value_and_passes_errors_through():
    values = iter([None, None, 7])
    assert wait_for(lambda: next(values), "seven", LOG, timeout_s=5, pause_s=0.01) == 7
    with pytest.raises(KeyError):
        wait_for(lambda: {}["x"], "x", LOG, timeout_s=5, pause_s=0.01)


def test_status_reporter_writes_counters(tmp_path):
    with StatusReporter("worker", "worker-1", tmp_path, interval_s=0.05) as status:
        status.set(state="generating", version=2, tokens_per_s=100)
        status.add(rollouts=8)
        status.add(rollouts=8)
        status.event("joined pool")
    read = RoleStatus.read_dir(tmp_path)["worker-1"]
    assert read.state == "generating" and read.policy_version == 2
    assert read.metrics["rollouts"] == 16 and read.events[-1].endswith("joined pool")


def test_a_slow_status_refresh_runs_less_often(tmp_path):
    """A refresh that takes t seconds (the orchestrator counting a growing table) runs again
    no sooner than t / REFRESH_SHARE later; the status file is still written every interval."""
    calls = []

    def slow(reporter):
        calls.append(time.monotonic())
        time.sleep(0.05)  # at a 1 % share: once every 5 s
        reporter.set(version=len(calls))

    with StatusReporter("orchestrator", "o", tmp_path, interval_s=0.02, refresh=slow):
        time.sleep(1.0)
    assert len(calls) == 1  # unbounded, it would have run ~14 times
    assert RoleStatus.model_validate_json((tmp_path / "o.json").read_text()).policy_version == 1
    quick = []
    with StatusReporter("orchestrator", "q", tmp_path, interval_s=0.05, refresh=quick.append):
        time.sleep(0.6)
    assert len(quick) >= 5  # a cheap refresh still runs every interval


# -- fixed-rate ticks (the worker's heartbeat schedule) ------------------------------------------
def test_fixed_rate_ticks_stay_on_their_grid_whatever_the_answers_take() -> None:
    ticks = FixedRate(10.0, first_s=103.0)
    assert ticks.wait_s(100.0) == 3.0
    assert ticks.advance(101.0) == 0 and ticks.next_s == 103.0  # not due yet: unchanged
    assert ticks.advance(103.4) == 0 and ticks.next_s == 113.0  # a slow answer: same grid
    assert ticks.wait_s(113.5) == 0.0
    assert ticks.advance(131.0) == 1 and ticks.next_s == 133.0  # 123 passed during the action
    with pytest.raises(ValueError, match="period"):
        FixedRate(0.0, first_s=0.0)
    phases = [FixedRate.random_phase(10.0, 50.0, random.Random(i)).next_s for i in range(200)]
    assert all(50.0 <= p < 60.0 for p in phases) and max(phases) - min(phases) > 9.0


def _busiest_second(reschedule: str) -> int:
    """1,000 nodes beating every 10 s at random phases against a server that answers the beats
    arriving in [5 s, 6 s) 2 s late (a busy moment) and every other one at once; the most beats
    arriving in one second of [30 s, 60 s)."""
    rng = random.Random(7)
    arrivals: list[float] = []
    for _ in range(1000):
        ticks = FixedRate.random_phase(10.0, 0.0, rng)
        at = ticks.next_s
        while at < 60.0:
            arrivals.append(at)
            answered = at + (2.0 if 5.0 <= at < 6.0 else 0.0)
            if reschedule == "after the answer":
                at = answered + 10.0
            else:
                ticks.advance(answered)
                at = ticks.next_s
    per_second = [0] * 60
    for at in arrivals:
        per_second[int(at)] += 1
    return max(per_second[30:])


def test_a_busy_moment_does_not_bunch_beats_on_a_fixed_rate() -> None:
    # sleeping a period after each answer moves every delayed node by the same 2 s: they arrive
    # together in every later period (the bunching the fixed grid avoids)
    bunched, spread = _busiest_second("after the answer"), _busiest_second("fixed rate")
    assert bunched >= 160  # ~100 a second, plus the ~100 delayed ones
    assert spread <= 140


def test_a_finished_role_ends_at_once_with_its_code_and_its_logs_written(tmp_path):
    """end_process: a thread still running (here one that never ends and is not a daemon,
    which would hold a normal exit forever) does not keep the role's process alive or change
    its exit code, and what was logged and printed before reaches its files."""
    import subprocess
    import sys

    script = (
        "import logging, sys, threading, time\n"
        "from swarmrl.rolekit.toolkit import end_process\n"
        f"logging.basicConfig(filename={str(tmp_path / 'role.log')!r}, level=logging.INFO)\n"
        "threading.Thread(target=lambda: time.sleep(3600), daemon=False).start()\n"
        "logging.getLogger('role').info('the run is finished; stopping')\n"
        "print('last words', end='')\n"
        "end_process(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last words"
    assert "the run is finished; stopping" in (tmp_path / "role.log").read_text()
