"""A ``swarmrl run`` that fails at start says why in its run directory: report.json's ``reason``
is the one line the console printed (after ``swarmrl run: ``), in both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmrl.config import EMBEDDED_DEFAULT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["colocated", "swarm"])
def test_a_run_that_fails_at_start_records_the_reason_the_console_printed(
    tmp_path: Path, mode: str
) -> None:
    missing = tmp_path / "no-model"
    command = [
        sys.executable, "-m", "swarmrl.cli", "run", str(EMBEDDED_DEFAULT), "--quiet",
        "--set", f"run.run_dir={tmp_path / 'runs'}",
        "--set", f"model.path={missing}",
        "--set", "swarm.ready_timeout_s=120",
    ] + (["--colocated"] if mode == "colocated" else [])  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"}
    )
    assert done.returncode != 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "failed"
    printed = [x for x in done.stderr.splitlines() if x.startswith("swarmrl run: ")]
    assert printed, done.stderr
    assert report["reason"] == printed[0].removeprefix("swarmrl run: ")
    assert "\n" not in report["reason"] and str(missing) in report["reason"]
