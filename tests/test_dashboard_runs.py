"""``swarmrl dashboard RUN_DIR`` on run directories that ``swarmrl run`` wrote.

Over the session's short swarm run and short colocated run (``runs`` in conftest.py), the
dashboard: the command itself as a user types it,
and its app in-process over copies of the run with pieces removed or altered.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import pytest

from swarmrl.identity import load_keypair
from swarmrl.serving import ThreadServer
from swarmrl.tools.dashboard import run_app

pytestmark = pytest.mark.slow


@contextmanager
def _command(run_dir: Path, tmp: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``swarmrl dashboard RUN_DIR`` on a free port: its base URL and process."""
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmrl.cli", "dashboard", str(run_dir), "--port", "0"]
        + ["--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None:
                raise AssertionError(f"swarmrl dashboard exited: {proc.stderr.read()}")
            assert time.monotonic() < deadline, "swarmrl dashboard did not start in 60 s"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}/ui/", proc
    finally:
        proc.terminate()
        proc.wait(20)


@contextmanager
def _served(run_dir: Path) -> Iterator[str]:
    app = run_app(run_dir)
    with ThreadServer(app) as server, closing(app.state.pages):
        yield f"{server.url}/ui/"


def _chain(url: str) -> str:
    """The ledger page's chain state once checking has finished (at most 30 s), asked once a
    second: the dashboard's rate limit (8 at once, then 1 a second) is left for the tests."""
    deadline = time.monotonic() + 30
    while True:
        page = httpx.get(url + "ledger").text
        state = page.split("chain: <b>", 1)[1].split("</b>", 1)[0]
        if state != "checking" or time.monotonic() > deadline:
            return state
        time.sleep(1.1)


def _copy(run_dir: Path, tmp: Path) -> Path:
    copy = tmp / run_dir.name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("rollouts", "*-?"))
    return copy


def test_swarm_run_the_command_verifies_its_ledger_and_shows_its_nodes(runs, tmp_path):
    run_dir = runs["swarm"]
    report = json.loads((run_dir / "report.json").read_text())
    token = (run_dir / "orchestrator" / "ui-admin-token").read_text().strip()
    worker = load_keypair(run_dir / "keys" / "worker-0.key").node_id
    with _command(run_dir, tmp_path) as (url, _):
        assert _chain(url) == "verified"
        ledger = httpx.get(url + "ledger").text
        assert f"{report['ledger']['entries']} entries, hash chain and signatures" in ledger
        assert httpx.get(url + "nodes").status_code == 303  # node pages need the token
        nodes = httpx.get(url + "nodes", headers={"authorization": f"Bearer {token}"}).text
        assert worker[:12] in nodes
        steps = httpx.get(url + "api/steps").json()
        assert [r["step"] for r in steps] == list(range(report["steps"]))
        head = httpx.head(url)
        get = httpx.get(url)
        assert head.status_code == get.status_code == 200
        assert head.content == b"" and int(head.headers["content-length"]) == len(get.content)


def test_swarm_run_without_its_key_file_verifies_against_the_key_report_json_records(
    runs, tmp_path
):
    run_dir = _copy(runs["swarm"], tmp_path)
    (run_dir / "keys" / "orchestrator.key").unlink()
    with _served(run_dir) as url:
        assert _chain(url) == "verified"


def test_swarm_run_with_no_key_at_all_says_so_in_one_line_and_raises_no_tamper_alarm(
    runs, tmp_path
):
    run_dir = _copy(runs["swarm"], tmp_path)
    (run_dir / "keys" / "orchestrator.key").unlink()
    report = json.loads((run_dir / "report.json").read_text())
    del report["ledger"]["orchestrator_key"]
    (run_dir / "report.json").write_text(json.dumps(report))
    with _command(run_dir, tmp_path) as (url, proc):
        page = httpx.get(url + "ledger").text
        assert "chain: <b>unchecked</b>" in page and "keys/orchestrator.key" in page
        assert "broken" not in page
    told = proc.stderr.read().strip().splitlines()
    assert len(told) == 1 and "the ledger is shown unchecked" in told[0], told


def test_swarm_run_whose_ledger_was_edited_is_refused(runs, tmp_path):
    """The real alarm still rings: an entry changed in the database is a one-line refusal."""
    run_dir = _copy(runs["swarm"], tmp_path)
    with sqlite3.connect(run_dir / "orchestrator" / "pool.db") as conn:
        conn.execute("update ledger set ts = ts + 1 where seq = 3")
    done = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "dashboard", str(run_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "entry 3" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_colocated_run_serves_its_curves_and_report_without_a_pool(runs, tmp_path):
    run_dir = runs["colocated"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with _command(run_dir, tmp_path) as (url, proc):
        overview = httpx.get(url)
        assert overview.status_code == 200
        assert f"<span id='step-count'>{len(rows)}</span>" in overview.text
        assert "held-out accuracy" in overview.text and "before" in overview.text
        assert httpx.get(url + "api/steps").json() == rows
        assert "it had no pool" in httpx.get(url + "ledger").text
        assert httpx.head(url).status_code == 200
    assert not (run_dir / "orchestrator").exists()  # nothing written into the run
