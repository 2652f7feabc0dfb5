"""A worker told to wait logs one line per kind of reason a minute: each admission rule its own
kind (before, every admission refusal was one kind, so the rule that held a run back went
unseen), the same rule with other counts one kind. The reasons are the pool's own."""

from swarmrl.pool.flow.admission import Supply, admit
from swarmrl.protocol.pool import reason_kind


def _reason(supply: Supply) -> str:
    decision = admit(supply, 3, 20, 2, 16.0, 2.0, 2.0, wanted=16, smallest=1)
    assert decision.tasks == 0
    return f"admission: {decision.reason}"


def test_each_admission_rule_is_its_own_kind_and_its_counts_are_not():
    backlog = _reason(Supply(leased=0, pending=34, trainable=0))
    backlog_again = _reason(Supply(leased=0, pending=40, trainable=0))
    trainable = _reason(Supply(leased=0, pending=0, trainable=33))
    enough = _reason(Supply(leased=48, pending=0, trainable=0))
    assert backlog != backlog_again and reason_kind(backlog) == reason_kind(backlog_again)
    kinds = {reason_kind(r) for r in (backlog, trainable, enough)}
    assert len(kinds) == 3, kinds
    assert reason_kind("node is unhealthy") != reason_kind("3 leases in flight (cap 1)")
    assert reason_kind("3 leases in flight (cap 1)") == reason_kind("2 leases in flight (cap 1)")
