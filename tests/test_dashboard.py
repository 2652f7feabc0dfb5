"""The /ui dashboard in a real headless Chromium, against a live orchestrator with nodes.

The orchestrator serves its pool API and the dashboard on one port; nodes join through the
real API, one is banned through the admin route, and the run directory gets step rows the way
the trainer writes them while it runs (``trainer/steps.jsonl``). Chromium (Debian's
``chromium`` + ``chromium-driver``, installed by ``.ci/services``) loads every page; the test
fails on any console error and saves screenshots under ``test-artifacts/dashboard/``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, InvalidateRequest, PoolSpec
from swarmrl.roles.orchestrator.dashboard.app import admin_token, build_dashboard
from swarmrl.roles.orchestrator.dashboard.data import RunData
from swarmrl.testing.pool_nodes import CPU_NODE

REPO = Path(__file__).resolve().parents[1]
SHOTS = REPO / "test-artifacts" / "dashboard"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
BAN_REASON = "proof chunk 0: 12/128 exponents match"


def _row(step: int) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "reward_mean": 0.1 * step,
        "accuracy": 0.05 * step,
        "loss": 1.0 / (step + 1),
        "kl": 0.001 * step,
        "clip_fraction": 0.02,
        "staleness": 0.5,
        "rollout_s": 1.5,
        "update_s": 0.4,
        "tokens_per_s": 90.0,
    }


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    run = tmp_path_factory.mktemp("run")
    (run / "trainer").mkdir()
    steps = run / "trainer" / "steps.jsonl"
    steps.write_text("".join(json.dumps(_row(s)) + "\n" for s in range(3)))
    orch, owner = KeyPair.generate(), KeyPair.generate()
    (run / "keys").mkdir()
    orch.save(run / "keys" / "orchestrator.json")
    ctx = make_context(orch, run / "orchestrator")
    data = RunData(ctx, run, orch.public_key_hex)
    token = admin_token(run / "orchestrator")
    server = OrchestratorServer(ctx, mounts={"/ui": build_dashboard(data, token)})
    with server:
        spec = PoolSpec(
            pool_id="swarm",
            owner_key=owner.public_key_hex,
            task_count=10,
            samples_per_task=2,
            sampling=SamplingParams(max_new_tokens=4),
            validators=[KeyPair.generate().public_key_hex],
        )
        PoolClient(server.url, orch, timeout_s=10).create_pool(spec)
        nodes = [KeyPair.generate() for _ in range(3)]
        for node in nodes:
            client = PoolClient(server.url, node, timeout_s=10)
            client.join("swarm", CPU_NODE, make_invite(owner, "swarm", 60))
            line = f"INFO hello from {node.node_id[:6]}"
            client.heartbeat("swarm", Heartbeat(status="ok", model_version=2, log_tail=[line]))
        PoolClient(server.url, owner, timeout_s=10).invalidate(
            "swarm", nodes[0].node_id, InvalidateRequest(severity="hard", reason=BAN_REASON)
        )
        ctx.beats.flush(ctx.engine)  # what `swarmrl dashboard RUN_DIR` reads is the database
        yield {
            "url": f"{server.url}/ui/",
            "nodes": nodes,
            "steps": steps,
            "token": token,
            "run": run,
        }


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/services installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    driver.set_page_load_timeout(60)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _open(driver, url: str, shot: str) -> None:
    """Load a page, save a screenshot, and fail on any console error it logged."""
    driver.get(url)
    driver.save_screenshot(str(SHOTS / f"{shot}.png"))
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == [], errors


def _wait(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_overview_draws_curves_with_points_and_follows_the_run(live, browser):
    from selenium.webdriver.common.by import By

    _open(browser, live["url"], "overview")
    assert browser.find_element(By.ID, "step-count").text == "3"
    charts = browser.find_elements(By.CSS_SELECTOR, ".chart .uplot canvas")
    assert len(charts) == 4
    # what the reward canvas plots: steps 0..2 on x and the rows' rewards, as points
    plotted = browser.execute_script(
        "const u = window.swarmrlPlots['chart-reward'];"
        "return [u.data[0], u.data[1], u.series[1].points.size]"
    )
    assert plotted == [[0, 1, 2], [0.0, 0.1, 0.2], 5]
    with live["steps"].open("a") as f:  # the trainer finishes another step
        f.write(json.dumps(_row(3)) + "\n")
    _wait(lambda: browser.find_element(By.ID, "step-count").text == "4", "the live update")
    steps = browser.execute_script("return window.swarmrlPlots['chart-reward'].data[0]")
    assert steps == [0, 1, 2, 3]
    browser.save_screenshot(str(SHOTS / "overview-live.png"))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_a_banned_node_shows_as_banned_with_its_reason(live, browser):
    from selenium.webdriver.common.by import By

    _open(browser, live["url"] + "nodes", "nodes")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.nodes tbody tr")
    assert len(rows) == 3
    banned_id = live["nodes"][0].node_id[:12]
    by_node = {r.find_element(By.CSS_SELECTOR, "td code").text: r for r in rows}
    banned = by_node[banned_id]
    assert banned.find_element(By.CSS_SELECTOR, ".state").text == "banned"
    assert banned.find_element(By.CSS_SELECTOR, ".reason").text == BAN_REASON
    others = [r for node, r in by_node.items() if node != banned_id]
    assert all(r.find_element(By.CSS_SELECTOR, ".state").text != "banned" for r in others)
    assert not any(r.find_elements(By.CSS_SELECTOR, ".reason") for r in others)


def test_versions_and_ledger_pages_load_and_the_chain_verifies(live, browser):
    from selenium.webdriver.common.by import By

    _open(browser, live["url"] + "versions", "versions")
    assert "who holds which version" in browser.page_source
    _open(browser, live["url"] + "ledger", "ledger")
    assert browser.find_element(By.CSS_SELECTOR, ".chain b").text == "verified"
    node = live["nodes"][0].node_id
    _open(browser, live["url"] + f"ledger?node={node[:8]}&kind=invalidation", "ledger-filtered")
    cells = browser.find_elements(By.CSS_SELECTOR, "table.ledger tbody tr")
    assert len(cells) == 1 and BAN_REASON in cells[0].text


def test_node_logs_need_the_admin_token(live, browser):
    from selenium.webdriver.common.by import By

    node = live["nodes"][1].node_id
    logs = live["url"] + f"nodes/swarm/{node}/logs"
    assert httpx.get(logs, follow_redirects=False).status_code == 303
    bearer = {"authorization": "Bearer " + live["token"]}
    assert f"hello from {node[:6]}" in httpx.get(logs, headers=bearer).text
    wrong = {"authorization": "Bearer " + "x" * len(live["token"])}
    assert httpx.get(logs, headers=wrong, follow_redirects=False).status_code == 303
    _open(browser, logs, "login")
    assert "admin sign-in" in browser.title
    browser.find_element(By.NAME, "token").send_keys(live["token"])
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    _wait(lambda: "hello from" in browser.page_source, "the log tail after signing in")
    browser.save_screenshot(str(SHOTS / "node-logs.png"))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_swarmrl_dashboard_serves_the_same_pages_over_the_run_directory(live):
    """``swarmrl dashboard RUN_DIR``'s app: the run's database, key, rows and admin token."""
    from swarmrl.serving import ThreadServer
    from swarmrl.tools.dashboard import run_app

    with ThreadServer(run_app(live["run"])) as server:
        assert httpx.get(server.url, follow_redirects=False).headers["location"] == "/ui/"
        nodes = httpx.get(f"{server.url}/ui/nodes").text
        assert BAN_REASON in nodes and nodes.count('class="state banned"') == 1
        assert "<b>verified</b>" in httpx.get(f"{server.url}/ui/ledger").text
        assert [r["step"] for r in httpx.get(f"{server.url}/ui/api/steps").json()][:3] == [0, 1, 2]
        node = live["nodes"][1].node_id
        logs = f"{server.url}/ui/nodes/swarm/{node}/logs"
        bearer = {"authorization": "Bearer " + live["token"]}
        assert f"hello from {node[:6]}" in httpx.get(logs, headers=bearer).text
