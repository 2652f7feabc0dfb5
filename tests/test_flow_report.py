"""A swarm run's flow in its report: the wasted share and the timeline, from the ledger and the
trainer's summary, drawn into report.png."""

from swarmrl.launch.flow import flow_facts, wasted
from swarmrl.launch.report import plot_report

T0 = 1_000_000.0


def _entry(kind: str, ts: float, **body) -> dict:
    return {"kind": kind, "ts": T0 + ts, "body": body, "node_id": "n" * 32}


def test_the_wasted_share_counts_accepted_work_never_trained():
    facts = wasted({"trained": 18, "accepted": 1, "unchecked": 1, "dropped": 0, "rejected": 7})
    assert facts["kept"] == 20
    assert facts["never_trained"] == {
        "queued_at_end": 1,
        "unchecked_at_end": 1,
        "dropped": 0,
        "acknowledged_stale": 0,
    }
    assert facts["wasted_share"] == facts["wasted_share_by_status"] == 0.1
    assert wasted({"rejected": 3})["wasted_share"] is None


def test_work_invalidated_as_a_penalty_is_waste_in_the_headline_and_left_out_beside_it():
    facts = wasted({"trained": 18, "accepted": 1, "unchecked": 1, "dropped": 5}, stale_dropped=2)
    assert facts["kept"] == 25 and facts["never_trained"]["dropped"] == 5
    assert facts["wasted_share"] == 9 / 25  # 1 queued + 1 unchecked + 5 dropped + 2 stale
    assert facts["wasted_share_excluding_invalidated"] == 4 / 20
    assert wasted({"dropped": 3})["wasted_share_excluding_invalidated"] is None
    assert wasted({"trained": 9, "accepted": 1})["wasted_share_excluding_invalidated"] == 0.1


def test_submissions_acknowledged_with_every_group_stale_count_as_never_trained():
    """The pool counts them trained (the trainer acknowledged them); nothing of them was."""
    facts = wasted({"trained": 18, "accepted": 1, "unchecked": 1}, stale_dropped=2)
    assert facts["never_trained"]["acknowledged_stale"] == 2
    assert facts["wasted_share"] == 0.2
    assert facts["wasted_share_by_status"] == 0.1


def test_the_timeline_comes_from_the_ledger_and_the_trainer():
    ledger = [
        _entry("submission", 1.0),
        _entry("verdict", 2.0, accept=True),
        _entry("verdict", 3.0, accept=False, severity="hard"),
        _entry("verdict", 4.0, accept=False, severity="soft"),  # expired: neither
        _entry("release", 5.0, submission_ids=["a", "b"]),  # unchecked work made trainable
        _entry("credit", 6.0, measured_by="orchestrator"),  # credit is not acceptance
    ]
    history = [
        {"step": 0, "wall_time": 10.0, "rollout_s": 8.0, "update_s": 2.0, "staleness": 0.0},
        {"step": 1, "wall_time": 13.0, "rollout_s": 0.5, "update_s": 2.5, "staleness": 1.0},
    ]
    summary = {
        "training": {"history": history},
        "flow": {
            "rl_started_at": T0,
            "versions": [[T0 + 10.5, 1], [T0 + 13.4, 2]],
            "acks": [[T0 + 10.2, 3], [T0 + 13.1, 2]],
        },
    }
    flow = flow_facts(ledger, summary)
    assert flow["accepted"] == [2.0, 5.0, 5.0] and flow["rejected"] == [3.0]
    assert flow["versions"] == [[10.5, 1], [13.4, 2]]
    assert flow["trained"] == [[10.2, 3], [13.1, 2]]
    assert flow["steps"][1] == {"step": 1, "start": 10.0, "batch": 10.5, "end": 13.0,
                                "staleness": 1.0}  # fmt: skip
    assert flow_facts(ledger, {"training": {"history": history}}) == {}  # RL never began


def test_report_png_gains_the_timeline(tmp_path):
    flow = {
        "accepted": [1.0, 2.0, 4.0],
        "rejected": [3.0],
        "trained": [[5.0, 2]],
        "versions": [[5.5, 1]],
        "steps": [{"step": 0, "start": 0.0, "batch": 4.5, "end": 5.0, "staleness": 0.0}],
    }
    rows = [{"step": 0, "reward_mean": 0.5, "accuracy": 0.4}]
    plain = plot_report(rows, {}, tmp_path / "plain.png")
    timeline = plot_report(rows, {}, tmp_path / "flow.png", flow)
    from PIL import Image

    assert Image.open(timeline).height > 2 * Image.open(plain).height
