"""The submission counts' words, counted from ledger entries by hand-checkable cases."""

from swarmrl.ledger.counts import count_ledger


def _e(kind: str, node: str, **body) -> dict:
    return {"kind": kind, "node_id": node, "body": body}


def test_each_word_counts_what_its_definition_says():
    entries = [
        *(_e("submission", "a", submission_id=f"a{i}") for i in range(5)),
        _e("verdict", "a", submission_id="a0", accept=True),  # checked, accepted
        _e("release", "a", submission_ids=["a1", "a2"]),  # accepted unchecked
        _e("verdict", "a", submission_id="a3", accept=False, severity="soft"),  # expired
        _e("invalidation", "a", severity="soft", submission_id="a3"),
        *(_e("submission", "b", submission_id=f"b{i}") for i in range(3)),
        _e("verdict", "b", submission_id="b0", accept=False, severity="hard"),  # rejected
        _e("invalidation", "b", severity="hard", dropped_submissions=["b1", "b2"]),
        _e("pool_created", "b", spec={}),  # not a count
    ]
    counts = count_ledger(entries)
    a, b = counts.node("a"), counts.node("b")
    assert (a.taken_in, a.checked, a.accepted, a.rejected, a.expired, a.invalidated) == (
        5,
        1,
        3,
        0,
        1,
        1,
    )
    assert (b.taken_in, b.checked, b.accepted, b.rejected, b.expired, b.invalidated) == (
        3,
        1,
        0,
        1,
        0,
        2,
    )
    assert counts.total.taken_in == 8 and counts.total.invalidated == 3
    assert counts.total.trained is None  # not a ledger fact
    assert counts.total.text() == (
        "8 taken in, 2 checked, 3 accepted, 1 rejected, 1 expired, 3 invalidated"
    )
