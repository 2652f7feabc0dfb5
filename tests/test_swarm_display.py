"""The live display shows what the roles report, including deaths and bans."""

import io
import time

from rich.console import Console

from swarmrl.launch.display import LiveDisplay, render, summary_line
from swarmrl.protocol.swarm import RoleStatus


def _statuses():
    return {
        "trainer": RoleStatus(
            role="trainer",
            name="trainer",
            state="training",
            policy_version=7,
            metrics={"step": 7, "reward_mean": 0.625, "accuracy": 0.83},
        ),
        "worker-0": RoleStatus(
            role="worker",
            name="worker-0",
            node_id="ab" * 16,
            state="generating",
            policy_version=6,
            metrics={"rollouts": 320, "tokens_per_s": 812.0},
        ),
        "validator": RoleStatus(
            role="validator",
            name="validator",
            state="checking",
            metrics={
                "checked": 43,
                "accepted": 40,
                "rejected": 3,
                "banned": 1,
                "tokens_replayed": 2100,
            },
            events=["banned node cdcdcdcd: proof mismatch"],
        ),
    }


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(renderable)
    return console.export_text()


def _orchestrator() -> RoleStatus:
    return RoleStatus(
        role="orchestrator",
        name="orchestrator",
        state="serving",
        policy_version=7,
        metrics={
            "taken_in": 55,
            "pending": 4,
            "checked": 43,
            "accepted": 50,
            "trained": 40,
            "rejected": 3,
            "invalidated": 2,
        },
    )


def test_summary_line_totals_the_reports_in_the_counts_words():
    statuses = {**_statuses(), "orchestrator": _orchestrator()}
    line = summary_line(statuses, total_steps=20)
    assert "steps done 7/20" in line and "version 7" in line
    assert "reward 0.625" in line and "last held-out acc 83.0%" in line
    assert (
        "submissions: 55 taken in, 43 checked, 50 accepted, 3 rejected, 2 invalidated, "
        "40 trained; 1 nodes banned"
    ) in line


def test_render_shows_workers_dead_roles_and_events():
    text = _text(render(_statuses(), {"worker-0": True, "relay-0": False}))
    assert "worker-0" in text and "abababab" in text and "812 tok/s" in text
    assert "relay-0" in text and "exited" in text
    assert "banned node cdcdcdcd" in text


def test_status_files_round_trip(tmp_path):
    for status in _statuses().values():
        status.write(tmp_path)
    (tmp_path / "garbage.json").write_text("{not json")
    read = RoleStatus.read_dir(tmp_path)
    assert set(read) == {"trainer", "worker-0", "validator"}
    assert read["validator"].metrics["rejected"] == 3
    assert time.time() - read["trainer"].updated_at < 60


def test_non_terminal_display_prints_changed_lines_only():
    out = io.StringIO()
    with LiveDisplay(Console(file=out, width=200)) as display:
        display.update(_statuses(), {})
        display.update(_statuses(), {})
    assert out.getvalue().count("steps done 7") == 1


def test_render_shows_live_orchestrator_relay_and_per_worker_verdicts():
    statuses = _statuses()
    node = "ab" * 16
    statuses["validator"].metrics |= {f"checked.{node}": 12, f"rejected.{node}": 2}
    statuses["orchestrator"] = _orchestrator()
    statuses["relay-0"] = RoleStatus(
        role="relay", name="relay-0", state="serving", policy_version=7
    )
    text = _text(render(statuses, {"orchestrator": True, "relay-0": True}))
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    assert "serving" in rows["orchestrator"] and "55 taken in" in rows["orchestrator"]
    assert "43 / 3" in rows["orchestrator"]  # checked / rejected
    assert "serving" in rows["relay-0"] and "starting" not in rows["relay-0"]
    assert "12 / 2" in rows["worker-0"]  # the validators' verdicts on this worker's node


def _trainer(state: str, step: float, **metrics: float) -> RoleStatus:
    return RoleStatus(
        role="trainer", name="trainer", state=state, metrics={"step": step, **metrics}
    )


def test_piped_output_tells_phases_steps_and_events_once_without_wrapping():
    out = io.StringIO()
    clock = [0.0]
    with LiveDisplay(Console(file=out, width=40)) as display:
        display._narrator.clock = lambda: clock[0]
        for sft_step in range(0, 101, 5):  # a warm start of 100 steps, 1 step a second
            clock[0] = float(sft_step)
            status = _trainer("warm start", 0, sft_step=sft_step, sft_steps=100, sft_loss=1.5)
            display.update({"trainer": status}, {})
        statuses = _statuses()
        for step in (1, 2):
            statuses["trainer"] = _trainer(f"training step {step}", step, reward_mean=0.5)
            display.update(statuses, {}, 20)
            statuses["trainer"] = _trainer(f"waiting for step {step + 1} rollouts", step)
            display.update(statuses, {}, 20)
        statuses["trainer"] = _trainer("control", 2)
        for _ in range(188):  # the control phase: nothing new to tell
            display.update(statuses, {}, 20)
        statuses["trainer"] = _trainer("done", 2)
        display.update(statuses, {}, 20)
    lines = out.getvalue().splitlines()
    warm = [line for line in lines if "warm start step" in line]
    assert 5 <= len(warm) <= 11, lines  # progress, not one line per SFT step
    assert "step 10/100" in warm[0] and "about 90 s left" in warm[0]
    steps = [line for line in lines if "steps done" in line]
    assert [line.split()[3] for line in steps] == ["1/20", "2/20"]  # one line per step
    assert len(lines) == len(set(lines)), lines  # nothing told twice
    assert sum("banned node cdcdcdcd" in line for line in lines) == 1
    assert "trainer: control" in lines and "trainer: done" in lines
    assert not any("waiting for step" in line or "generating" in line for line in lines)
    assert any(len(line) > 40 for line in lines)  # long lines are not wrapped at the width


def _row(step: int) -> dict:
    return {"step": step, "reward_mean": 0.5 + step / 100, "accuracy": 0.25, "staleness": 1.0}


def test_piped_output_tells_every_step_once_from_the_step_rows():
    """Steps that end between two looks at the status files still get their line each, numbered
    from 0 as the trainer's log numbers them; a finished warm start and each held-out
    evaluation are told once, the evaluation with when it ran."""
    out = io.StringIO()
    statuses = {**_statuses(), "orchestrator": _orchestrator()}
    with LiveDisplay(Console(file=out, width=200)) as display:
        for _ in range(4):  # the warm start's last step, seen on several looks
            statuses["trainer"] = _trainer("warm start", 0, sft_step=60, sft_steps=60)
            display.update(statuses, {}, 6, steps=[])
        statuses["trainer"] = _trainer("waiting for step 0 rollouts", 0, accuracy=0.3, evals=1)
        display.update(statuses, {}, 6, steps=[])
        display.update(statuses, {}, 6, steps=[_row(0)])
        statuses["trainer"] = _trainer("training step 4", 4, accuracy=0.3, evals=1)
        display.update(statuses, {}, 6, steps=[_row(i) for i in range(4)])  # three at once
        statuses["trainer"] = _trainer("done", 6, accuracy=0.3, evals=2)  # the same accuracy
        display.update(statuses, {}, 6, steps=[_row(i) for i in range(6)])
        display.update(statuses, {}, 6, steps=[_row(i) for i in range(6)])
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("trainer: step ")]
    assert [line.split()[2] for line in steps] == ["0", "1", "2", "3", "4", "5"], lines
    assert "step 5 (6/6 done)" in steps[-1] and "55 taken in" in steps[-1]
    assert sum("warm start step 60/60" in line for line in lines) == 1, lines
    evals = [line for line in lines if "held-out accuracy" in line]
    assert evals == [
        "trainer: held-out accuracy 30.0% (before RL)",
        "trainer: held-out accuracy 30.0% (after 6 RL steps)",
    ], lines
    assert not any("held-out" in line for line in steps)  # no stale accuracy on step lines
