"""The /ui dashboard in a real headless Chromium, against a live orchestrator with nodes.

The orchestrator serves its pool API and the dashboard on one port; nodes join through the
real API, one is banned through the admin route, and the run directory gets step rows the way
the trainer writes them while it runs (``trainer/steps.jsonl``). Chromium (Debian's
``chromium`` + ``chromium-driver``, installed by ``.ci/services``) loads every page; the test
fails on any console error and saves screenshots under ``test-artifacts/dashboard/``. What a
page may cost the orchestrator (rate limit, paging, a ledger checked once) is tested over
plain HTTP. ``swarmrl dashboard RUN_DIR`` over real run directories: test_dashboard_runs.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmrl.identity import KeyPair
from swarmrl.ledger.chain import Entry, Ledger
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.pool.server import OrchestratorServer, make_context
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import Heartbeat, InvalidateRequest, PoolSpec
from swarmrl.roles.orchestrator.dashboard.app import RateLimit, admin_token, build_dashboard
from swarmrl.roles.orchestrator.dashboard.data import RunData
from swarmrl.serving import ThreadServer
from swarmrl.testing.pool_nodes import CPU_NODE

REPO = Path(__file__).resolve().parents[1]
# a page is built in a child process: on a loaded machine that takes longer than httpx's 5 s
_get = functools.partial(httpx.get, timeout=60)
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
    ctx = make_context(orch, run / "orchestrator")
    data = RunData(ctx, run, orch.public_key_hex)
    token = admin_token(run / "orchestrator")
    # one browser and the tests' requests, all from 127.0.0.1: a limit none of them reaches
    roomy = RateLimit(per_s=100.0, burst=1000)
    ui = build_dashboard(data, token, limit=roomy)
    server = OrchestratorServer(ctx, mounts={"/ui": ui})
    with server, contextlib.closing(ui.state.pages):
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
    assert len(charts) == 5  # reward, loss, time, staleness, mismatch
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


def _sign_in(browser, live: dict, page: str) -> None:
    """Sign in through the login form, landing on ``page``."""
    from selenium.webdriver.common.by import By

    browser.get(live["url"] + f"login?next={page}")
    browser.find_element(By.NAME, "token").send_keys(live["token"])
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    _wait(lambda: "admin sign-in" not in browser.title, "the sign-in")


def test_a_banned_node_shows_as_banned_with_its_reason(live, browser):
    from selenium.webdriver.common.by import By

    _sign_in(browser, live, "nodes")
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

    # signed in here: with pytest -n 2 this module's tests may share a browser in any order,
    # or not share it
    _sign_in(browser, live, "versions")
    _open(browser, live["url"] + "versions", "versions")
    assert "who holds which version" in browser.page_source

    def verified() -> bool:  # the chain is checked in the background, once
        browser.get(live["url"] + "ledger")
        return browser.find_element(By.CSS_SELECTOR, ".chain b").text == "verified"

    _wait(verified, "the chain check")
    _open(browser, live["url"] + "ledger", "ledger")
    node = live["nodes"][0].node_id
    _open(browser, live["url"] + f"ledger?node={node[:8]}&kind=invalidation", "ledger-filtered")
    cells = browser.find_elements(By.CSS_SELECTOR, "table.ledger tbody tr")
    assert len(cells) == 1 and BAN_REASON in cells[0].text


def test_node_logs_need_the_admin_token(live, browser):
    from selenium.webdriver.common.by import By

    node = live["nodes"][1].node_id
    logs = live["url"] + f"nodes/swarm/{node}/logs"
    assert _get(logs, follow_redirects=False).status_code == 303
    bearer = {"authorization": "Bearer " + live["token"]}
    assert f"hello from {node[:6]}" in _get(logs, headers=bearer).text
    wrong = {"authorization": "Bearer " + "x" * len(live["token"])}
    assert _get(logs, headers=wrong, follow_redirects=False).status_code == 303
    browser.get(live["url"])  # on the dashboard's origin, signed out whatever ran before
    browser.delete_all_cookies()
    _open(browser, logs, "login")
    assert "admin sign-in" in browser.title
    browser.find_element(By.NAME, "token").send_keys(live["token"])
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    _wait(lambda: "hello from" in browser.page_source, "the log tail after signing in")
    browser.save_screenshot(str(SHOTS / "node-logs.png"))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


# --- what a page may cost the orchestrator (plain HTTP) --------------------------------------


def _filler_ledger(run: Path, entries: int) -> tuple[RunData, Any]:
    """A pool database whose ledger holds ``entries`` signed entries (node joins of about the
    size of a real run's entries, a hard invalidation every 1,000th), and a dashboard over it."""
    orch = KeyPair.generate()
    engine = make_engine(sqlite_url(run / "pool.db"))
    nodes = [KeyPair.generate().node_id for _ in range(20)]
    batch = [
        Entry(
            "invalidation" if i % 1000 == 999 else "node_joined",
            {"severity": "hard", "reason": f"ban {i}"}
            if i % 1000 == 999
            else {"metadata": {"note": "x" * 400, "i": i}},
            pool_id="swarm",
            node_id=nodes[i % len(nodes)],
        )
        for i in range(entries)
    ]
    with engine.begin() as conn:
        Ledger(orch).append_many(conn, batch)
    return RunData(engine, run, orch.public_key_hex), nodes


def test_the_ledger_page_is_paged_and_answers_before_the_chain_is_checked(tmp_path):
    """20,000 entries: the first page shows 50 of them at once, while the chain is checked
    in the background; older pages follow by link; a kind filter finds the rare entries."""
    data, nodes = _filler_ledger(tmp_path, 20_000)
    app = build_dashboard(data, "t" * 32, base="/")
    with ThreadServer(app) as server, contextlib.closing(app.state.pages):
        first = _get(f"{server.url}/ledger", timeout=30).text
        assert "chain: <b>checking</b>" in first  # not all 20,000 verified inside the page load
        assert first.count("<tr>") == 51  # header + 50 entries, newest first
        assert "entries 19999 down to 19950 shown" in first
        older = first.split("class='older' href='", 1)[1].split("'", 1)[0].replace("&amp;", "&")
        second = _get(f"{server.url}/{older}").text
        assert "entries 19949 down to 19900 shown" in second
        bans = _get(f"{server.url}/ledger?kind=invalidation&limit=500").text
        assert bans.count("<tr>") == 21 and "ban 19999" in bans and "ban 999<" not in bans
        mine = _get(f"{server.url}/ledger?node={nodes[3][:10]}").text
        assert mine.count(f"<code>{nodes[3][:12]}</code>") == 50
        assert _get(f"{server.url}/ledger?node=zz").status_code == 400
        verified = "chain: <b>verified</b> (20000 entries"
        _wait(lambda: verified in _get(f"{server.url}/ledger").text, "the check", 180)


def test_a_client_over_its_page_rate_gets_429_with_retry_after(live):
    """Three page loads at once, then one a second; other clients and static files unaffected."""
    data = RunData(None, live["run"], None)
    now = [0.0]  # the limit's clock, moved by the test (a page's build takes its own time)
    limit = RateLimit(per_s=1.0, burst=3, clock=lambda: now[0])
    app = build_dashboard(data, live["token"], base="/", limit=limit)
    with ThreadServer(app) as server, contextlib.closing(app.state.pages):
        codes = [_get(f"{server.url}/ledger").status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        over = _get(f"{server.url}/ledger")
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        assert _get(f"{server.url}/static/dashboard.css").status_code == 200
        assert limit.wait_s("192.0.2.7") == 0.0  # another address has its own bucket
        now[0] += float(over.headers["retry-after"])
        assert _get(f"{server.url}/ledger").status_code == 200


def test_node_pages_need_the_token_and_head_answers_like_get(live):
    base = live["url"]
    for page in ("nodes", "versions"):
        assert _get(base + page).headers["location"] == f"/ui/login?next={page}"
    bearer = {"authorization": "Bearer " + live["token"]}
    assert live["nodes"][2].node_id[:12] in _get(base + "nodes", headers=bearer).text
    _wait(lambda: "<b>verified</b>" in _get(base + "ledger").text, "the chain check")
    for page in ("", "ledger", "static/dashboard.js"):
        head, get = httpx.head(base + page), _get(base + page)
        assert head.status_code == get.status_code == 200, page
        assert head.content == b"" and head.headers["content-length"] == str(len(get.content))
