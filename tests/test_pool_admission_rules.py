"""Admission control's rules on plain numbers (``swarmrl.pool.flow.admission``): the window of
fresh steps, what a lease may still hold and which bound stops it, the policy version a lease
asks for, the unit that releases a node's unchecked work, and the overrides of a starving
trainer. ``test_pool_admission`` holds the same rules as a pool on loopback serves them."""

import pytest

from swarmrl.pool.flow.admission import (
    Admission,
    Askers,
    Supply,
    admit,
    demand,
    fair_share,
    lowest_useful_version,
    steps_left,
    unblock,
)
from swarmrl.protocol.pool import LeaseReply


def test_the_window_is_the_fresh_steps_left_in_the_run():
    assert steps_left(version=0, steps=None, async_level=2) == 3
    assert steps_left(version=0, steps=20, async_level=2) == 3
    assert steps_left(version=18, steps=20, async_level=2) == 2
    assert steps_left(version=20, steps=20, async_level=2) == 0
    assert demand(version=19, steps=20, async_level=2, tasks_per_step=32) == 32
    assert demand(version=0, steps=20, async_level=0, tasks_per_step=4.5) == 5


def test_admit_grants_only_the_room_left_and_names_the_bound_it_hit():
    args = dict(version=0, steps=10, async_level=1, validation_backlog_steps=2.0,
                trainable_backlog_steps=2.0, smallest=1)  # fmt: skip
    # demand 2 steps × 4 tasks = 8; 2 leased + 1 pending + 2 queued = 5; room 3
    assert admit(Supply(2, 1, 2), tasks_per_step=4, wanted=8, **args).tasks == 3
    assert admit(Supply(2, 1, 2), tasks_per_step=4, wanted=2, **args).tasks == 2
    full = admit(Supply(5, 1, 2), tasks_per_step=4, wanted=8, **args)
    assert full.tasks == 0 and "8" in full.reason
    assert "validation backlog" in admit(Supply(0, 8, 0), tasks_per_step=4, wanted=8, **args).reason
    assert "trainable backlog" in admit(Supply(0, 0, 8), tasks_per_step=4, wanted=8, **args).reason
    # a starving trainer (its last batch came back empty) overrides the estimate when nothing
    # is on its way to it, not while work is leased or awaits a validator
    assert admit(Supply(0, 0, 9), tasks_per_step=4, wanted=8, starving=True, **args).tasks == 8
    assert admit(Supply(5, 1, 2), tasks_per_step=4, wanted=8, starving=True, **args).tasks == 0
    # unchecked work is supply, but only the node's next checked unit releases it
    assert admit(Supply(0, 0, 0, 8), tasks_per_step=4, wanted=8, **args).tasks == 0
    assert admit(Supply(0, 0, 0, 8), tasks_per_step=4, wanted=8, starving=True, **args).tasks == 8
    # an unknown pace leases freely, until the run has no step left
    assert admit(Supply(50, 0, 0), tasks_per_step=None, wanted=8, **args).tasks == 8
    done = admit(Supply(0, 0, 0), tasks_per_step=4, wanted=8, **args | {"version": 10})
    assert done.tasks == 0 and "last step" in done.reason


def test_a_lease_reply_says_work_exactly_when_it_holds_a_unit():
    with pytest.raises(ValueError, match="outcome"):
        LeaseReply.model_validate({"outcome": "work", "work": None, "retry_after_s": 1.0})


def test_a_fresh_lease_asks_for_a_policy_a_step_without_a_batch_can_train():
    # at version V step V has its batch and step V + 1's is being gathered, so with a = 2 work
    # generated on V − 1 could only join batches already filled with older work
    assert lowest_useful_version(5, async_level=2) == 5
    assert lowest_useful_version(5, async_level=3) == 4
    assert lowest_useful_version(5, async_level=0) == lowest_useful_version(5, 1) == 5
    assert lowest_useful_version(1, async_level=4) == 0
    # a trainer whose current step waits for its batch takes any version that step can train
    assert lowest_useful_version(5, async_level=2, blocked=True) == 3


def test_a_lease_version_lag_lowers_the_policy_asked_for_never_below_what_trains():
    assert lowest_useful_version(5, async_level=2, lag=1) == 4
    assert lowest_useful_version(5, async_level=2, lag=2) == 3
    assert lowest_useful_version(5, async_level=2, lag=9) == 3  # never older than V − a
    assert lowest_useful_version(5, async_level=3, lag=1) == 3
    assert lowest_useful_version(0, async_level=2, lag=1) == 0
    assert lowest_useful_version(5, async_level=0, lag=1) == 5  # a = 0: only the current one


def test_only_a_covered_demand_is_lifted_for_a_node_whose_unchecked_work_waits():
    covered = admit(Supply(0, 0, 0, 4), 0, 10, 1, 2.0, 2.0, 2.0, wanted=8, smallest=1)
    assert covered.tasks == 0 and covered.covered
    assert unblock(covered, Supply(0, 0, 0, 2), smallest=1, check_rate=0.5).tasks == 1
    assert unblock(covered, Supply(0, 0, 0, 1), 1, 0.5).tasks == 0  # 2 units to release 1 task
    assert unblock(covered, Supply(0, 0, 0, 50), 1, 0.0).tasks == 0  # never checked: no use
    assert unblock(covered, Supply(0, 1, 0, 2), 1, 0.5).tasks == 0  # its check is queued
    assert unblock(covered, Supply(1, 0, 0, 2), 1, 0.5).tasks == 0  # a unit is on its way
    backlog = admit(Supply(0, 8, 0), 0, 10, 1, 2.0, 2.0, 2.0, wanted=8, smallest=1)
    assert not backlog.covered and unblock(backlog, Supply(0, 0, 0, 2), 1, 0.5).tasks == 0
    assert unblock(Admission(0, "run over"), Supply(0, 0, 0, 2), 1, 0.5).tasks == 0


def test_a_starving_trainer_looks_past_leases_once_every_one_is_overdue():
    args = dict(version=0, steps=10, async_level=1, validation_backlog_steps=2.0,
                trainable_backlog_steps=2.0, smallest=1, tasks_per_step=4, wanted=8)  # fmt: skip
    held = Supply(8, 0, 0)  # leases nobody submits cover the demand
    assert admit(held, starving=True, leases_overdue=False, **args).tasks == 0
    assert admit(held, starving=True, leases_overdue=True, **args).tasks == 8
    assert admit(held, starving=False, leases_overdue=True, **args).tasks == 0
    checking = Supply(7, 1, 0)  # work awaiting a validator is still the answer
    assert admit(checking, starving=True, leases_overdue=True, **args).tasks == 0


def test_starving_grants_go_to_the_best_record_then_round_robin_among_equals():
    asks = Askers()
    for t, (node, record) in enumerate([("fresh1", 0), ("old1", 3), ("old2", 3), ("fresh2", 0)]):
        asks.ask(node, record, now=float(t), within_s=10.0)
    assert asks.starving_turn() == "old1"  # a record beats asking first; then the longest wait
    asks.granted("old1", now=4.0)
    asks.ask("old1", 3, now=5.0, within_s=10.0)
    assert asks.starving_turn() == "old2"  # old1 was served last: its equal goes first
    asks.granted("old2", now=6.0)
    assert asks.starving_turn() == "old1"  # round-robin among equals; fresh identities last
    asks.granted("old1", now=7.0)
    assert asks.starving_turn() == "fresh1"
    asks.ask("fresh2", 0, now=11.5, within_s=10.0)  # fresh1 (asked at 0) no longer waits
    assert asks.starving_turn() == "fresh2"


def test_ordinary_grants_are_first_come_first_served_and_leave_a_unit_for_each_earlier_asker():
    queue = Askers()
    for t, node in enumerate(["a", "b", "c"]):
        queue.ask(node, 0, now=float(t), within_s=10.0)
    assert [queue.ahead_of(n) for n in ("a", "b", "c")] == [0, 1, 2]
    room3 = Admission(3, room=3)
    assert fair_share(room3, queue.ahead_of("a"), smallest=1).tasks == 3  # first: all it asked
    assert fair_share(room3, queue.ahead_of("c"), smallest=1).tasks == 1  # one unit each ahead
    late = fair_share(Admission(2, room=2), queue.ahead_of("c"), smallest=1)
    assert late.tasks == 0 and "2 node(s) waiting longer" in late.reason
    assert fair_share(Admission(4, room=5), 1, smallest=2).tasks == 3  # 5 − 2 left, ≥ m = 2
    assert fair_share(Admission(2, room=3), 1, smallest=2).tasks == 0  # 3 − 2 < m
    queue.granted("a", now=3.0)
    queue.ask("a", 0, now=3.5, within_s=10.0)  # asks again at once: behind b and c
    assert [queue.ahead_of(n) for n in ("b", "c", "a")] == [0, 1, 2]
    queue.ask("c", 0, now=11.5, within_s=10.0)  # b (last asked at 1) no longer waits
    assert "b" not in queue.askers and queue.ahead_of("c") == 0 and queue.ahead_of("a") == 1
    # grants the room does not bound (the trainer's pace unknown, a starving or lifted grant)
    assert fair_share(Admission(8), 5, smallest=1).tasks == 8
    assert fair_share(Admission(0, "covered", covered=True), 0, 1).tasks == 0
