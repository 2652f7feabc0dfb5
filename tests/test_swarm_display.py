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
            metrics={"accepted": 40, "rejected": 3, "banned": 1, "tokens_replayed": 2100},
            events=["banned node cdcdcdcd: proof mismatch"],
        ),
    }


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(renderable)
    return console.export_text()


def test_summary_line_totals_the_reports():
    line = summary_line(_statuses(), total_steps=20)
    assert "step 7/20" in line and "version 7" in line
    assert "reward 0.625" in line and "held-out acc 83.0%" in line
    assert "accepted 40 rejected 3" in line and "banned 1" in line


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
    assert out.getvalue().count("step 7") == 1
