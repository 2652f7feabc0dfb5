"""One run's submission counts agree everywhere, and its console and logs read as a normal run.

One short ``swarmrl run`` per test session, its console captured as a user piping it sees it;
then the counts (taken in, checked, accepted, rejected, expired, invalidated, trained:
``swarmrl.ledger.counts``) from its ``report.json``, the console's closing account, the
``swarmrl ledger verify`` command and the dashboard's nodes page, and every step's console line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from swarmrl.serving import ThreadServer
from swarmrl.testing.runs import SWARM_RUN_STEPS
from swarmrl.tools.dashboard import run_app

pytestmark = pytest.mark.slow

STEPS = SWARM_RUN_STEPS
WORDS = ("taken_in", "checked", "accepted", "rejected", "expired", "invalidated", "trained")
# what a line of a normal run's role logs must not say
FAULT = re.compile(r"fail|error|warning|traceback|refused|unavailable|dropping", re.IGNORECASE)


@pytest.fixture(scope="session")
def run(swarm_run: tuple[Path, str]) -> tuple[Path, str]:
    """``swarmrl run configs/arith.toml`` (short, ``STEPS`` steps), piped: its run directory and
    console (the shared run of conftest.py)."""
    return swarm_run


def _report_counts(run_dir: Path) -> dict[str, int]:
    subs = json.loads((run_dir / "report.json").read_text())["swarm"]["submissions"]
    return {word: subs[word] for word in WORDS}


def _said(text: str, words: tuple[str, ...]) -> dict[str, int]:
    """``{word: n}`` from a text that says ``n <word>`` for each word."""
    found = {}
    for word in words:
        match = re.search(rf"(\d+) {word.replace('_', ' ')}\b", text)
        assert match, f"{word!r} not in {text!r}"
        found[word] = int(match.group(1))
    return found


def test_report_console_ledger_and_dashboard_give_one_set_of_counts(run):
    run_dir, console = run
    report = _report_counts(run_dir)
    assert report["taken_in"] > 0 and 0 < report["checked"] <= report["taken_in"]
    assert report["checked"] <= report["accepted"] + report["rejected"] <= report["taken_in"]
    assert 0 < report["trained"] <= report["accepted"]

    closing_account = next(line for line in console.splitlines() if line.startswith("submissions:"))
    assert _said(closing_account, WORDS) == report

    key = json.loads((run_dir / "report.json").read_text())["ledger"]["orchestrator_key"]
    verify = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "ledger", "verify", str(run_dir / "ledger.jsonl")]
        + ["--orchestrator-key", key],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    totals = next(line for line in verify.splitlines() if line.startswith("submissions"))
    without_trained = tuple(w for w in WORDS if w != "trained")  # not a ledger fact
    assert _said(totals, without_trained) == {w: report[w] for w in without_trained}

    app = run_app(run_dir)
    token = (run_dir / "orchestrator" / "ui-admin-token").read_text().strip()
    with ThreadServer(app) as server, closing(app.state.pages):
        url = f"{server.url}/ui/"
        for _ in range(30):  # the chain is verified in the background; counts come from it
            if "chain: <b>verified" in httpx.get(url + "ledger", timeout=60).text:
                break
            time.sleep(1.1)  # the dashboard's rate limit: 8 at once, then 1 a second
        time.sleep(1.1)
        reply = httpx.get(url + "nodes", headers={"authorization": f"Bearer {token}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    page = reply.text
    assert "verified entries only" not in page  # the counts cover the whole ledger
    head = re.findall(r"<th>(.*?)</th>", page)
    row = re.findall(r"<td>(.*?)</td>", page.split("<tbody>", 1)[1].split("</tr>", 1)[0])
    shown = {h: row[i] for i, h in enumerate(head) if i < len(row)}
    for word in ("taken_in", "checked", "accepted", "rejected", "invalidated", "trained"):
        assert int(shown[word.replace("_", " ")]) == report[word], (word, shown)


def test_console_tells_every_step_once_and_each_evaluation_when_it_ran(run):
    _, console = run
    lines = console.splitlines()
    steps = [line for line in lines if line.startswith("trainer: step ")]
    # numbered as the trainer's log numbers them, none skipped, none twice
    assert [int(line.split()[2]) for line in steps] == list(range(STEPS)), console
    assert f"({STEPS}/{STEPS} done)" in steps[-1]
    assert not any("held-out" in line for line in steps)
    evals = [line for line in lines if "held-out accuracy" in line and line.startswith("trainer")]
    assert [line.split("(")[-1] for line in evals] == ["before RL)", f"after {STEPS} RL steps)"]
    assert len(lines) == len(set(lines)), console  # nothing told twice


def test_a_normal_runs_logs_hold_no_line_that_reads_like_a_fault(run):
    run_dir, _ = run
    faults = [
        f"{log.name}: {line}"
        for log in sorted((run_dir / "logs").glob("*.log"))
        for line in log.read_text().splitlines()
        if FAULT.search(line)
    ]
    assert faults == []
    validator = (run_dir / "logs" / "validator-0.log").read_text()
    assert re.search(r"validator-0: accepted [0-9a-f]+ from node [0-9a-f]+", validator)
