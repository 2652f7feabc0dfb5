"""Prometheus on every role: the orchestrator's /metrics and the roles' own metrics servers."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.config import SwarmConfig
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import InvalidateRequest, PoolSpec
from swarmrl.rolekit.metrics import serve_metrics
from swarmrl.rolekit.toolkit import StatusReporter, add_role_args
from swarmrl.roles.trainer.origin import Origin
from swarmrl.roles.trainer.progress import Summary, role_hooks
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator
from swarmrl.trainer.loop import ROW_KEYS

REPO = Path(__file__).resolve().parents[1]


def _scrape(url: str) -> dict[str, list]:
    """{family name: [(sample name, labels, value)]} with the family's type as key 'type:name'."""
    text = httpx.get(url, timeout=10).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
        out[f"type:{family.name}"] = family.type
    return out


def test_orchestrator_metrics_count_nodes_by_state_and_time_requests(tmp_path: Path):
    orch, owner = KeyPair.generate(), KeyPair.generate()
    spec = PoolSpec(
        pool_id="arith",
        owner_key=owner.public_key_hex,
        task_count=10,
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=4),
        validators=[KeyPair.generate().public_key_hex],
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        admin = PoolClient(server.url, owner, timeout_s=10)
        PoolClient(server.url, orch, timeout_s=10).create_pool(spec)
        nodes = [KeyPair.generate() for _ in range(3)]
        for node in nodes:
            PoolClient(server.url, node, timeout_s=10).join(
                "arith", CPU_NODE, make_invite(owner, "arith", 60)
            )
        admin.invalidate(
            "arith", nodes[0].node_id, InvalidateRequest(severity="hard", reason="forged proof")
        )
        leasing = PoolClient(server.url, nodes[1], timeout_s=10)
        replies = [leasing.lease("arith") for _ in range(3)]  # the third: the node's cap
        got = _scrape(f"{server.url}/metrics")
    by_state = {s[1]["state"]: s[2] for s in got["swarmrl_pool_nodes"]}
    assert by_state["banned"] == 1 and by_state["healthy"] == 2
    assert [r.outcome for r in replies] == ["work", "work", "wait"]
    assert got["swarmrl_pool_leases_active"] == [
        ("swarmrl_pool_leases_active", {"pool": "arith"}, 2)
    ]
    answers = {
        (s[1]["outcome"], s[1]["rule"]): s[2]
        for s in got["swarmrl_pool_lease_answers"]
        if s[0].endswith("_total")
    }
    assert answers == {("work", ""): 2, ("wait", "# leases in flight (cap #)"): 1}
    counts = {
        (s[1]["method"], s[1]["route"], s[1]["status"]): s[2]
        for s in got["swarmrl_orchestrator_request_seconds"]
        if s[0].endswith("_count")
    }
    assert counts[("POST", "/pools/{pool_id}/join", "200")] == 3
    assert counts[("POST", "/pools/{pool_id}/lease", "200")] == 3
    assert got["type:swarmrl_orchestrator_request_seconds"] == "histogram"


def test_a_role_serves_its_status_as_counters_gauges_and_labelled_counters(tmp_path: Path):
    reporter = StatusReporter("validator", "validator-0", tmp_path, node_id="ab" * 16)
    url = serve_metrics(reporter, "127.0.0.1", 0)
    reporter.set(state="replaying", version=3, reward_mean=0.25)
    reporter.add(accepted=2, tokens_replayed=40)
    reporter.add(accepted=1)
    reporter.count("verdicts", outcome="rejected", severity="hard")
    reporter.count("verdicts", 2, outcome="accepted", severity="none")
    got = _scrape(url)
    assert got["type:swarmrl_validator_accepted"] == "counter"
    assert got["swarmrl_validator_accepted"][0][2] == 3
    assert got["type:swarmrl_validator_reward_mean"] == "gauge"
    assert got["swarmrl_validator_policy_version"][0][2] == 3
    verdicts = {
        (s[1]["outcome"], s[1]["severity"]): s[2] for s in got["swarmrl_validator_verdicts"]
    }
    assert verdicts == {("rejected", "hard"): 1, ("accepted", "none"): 2}
    assert got["swarmrl_validator_info"][0][1] == {"name": "validator-0", "state": "replaying"}
    reporter.flush()  # the status file names the metrics address
    assert json.loads((tmp_path / "validator-0.json").read_text())["metrics_url"] == url


def test_every_role_takes_metrics_port_and_the_docs_name_every_metric():
    parser = argparse.ArgumentParser()
    add_role_args(parser)
    args = parser.parse_args(["--key", "k", "--metrics-port", "0"])
    assert args.metrics_port == 0 and args.metrics_host == "127.0.0.1"
    doc = (REPO / "docs" / "observability.md").read_text()
    for name in (
        "swarmrl_pool_nodes",
        "swarmrl_pool_lease_answers_total",
        "swarmrl_orchestrator_request_seconds",
        "swarmrl_trainer_loss",
        "swarmrl_trainer_mismatch_kl",
        "swarmrl_trainer_corrected_fraction",
        "swarmrl_trainer_staleness_max",
        "swarmrl_trainer_versions_published_total",
        "swarmrl_trainer_idle_seconds_total",
        "swarmrl_worker_tokens_per_s",
        "swarmrl_validator_verdicts_total",
        "swarmrl_validator_replay_seconds_total",
        "shardcast_bytes_served_total",
    ):
        assert name in doc, name
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    assert "swarmrl_pool_nodes" in exprs and "swarmrl_trainer_reward_mean" in exprs


def test_the_trainer_exports_each_steps_mismatch_and_staleness(tmp_path: Path):
    reporter = StatusReporter("trainer", "trainer", tmp_path)
    url = serve_metrics(reporter, "127.0.0.1", 0)
    origin = Origin(tmp_path / "origin", KeyPair.generate(), SwarmConfig(), "127.0.0.1", 0)
    try:
        summary = Summary(tmp_path / "summary.json", origin)
        hooks = role_hooks(
            logging.getLogger("test"), reporter, tmp_path / "steps.jsonl", [], summary, tmp_path
        )
        row = dict.fromkeys(ROW_KEYS, 0.0) | {
            "step": 0,
            "policy_version": 2,
            "mismatch_kl": 0.0125,
            "corrected_fraction": 0.25,
            "staleness": 0.5,
            "staleness_max": 2,
            "staleness_shares": {"0": 0.75, "2": 0.25},
        }
        hooks.on_step(row)
        got = _scrape(url)
    finally:
        origin.stop()
    assert got["swarmrl_trainer_mismatch_kl"][0][2] == 0.0125
    assert got["swarmrl_trainer_corrected_fraction"][0][2] == 0.25
    assert got["swarmrl_trainer_staleness_max"][0][2] == 2
    assert got["type:swarmrl_trainer_mismatch_kl"] == "gauge"
    assert json.loads((tmp_path / "steps.jsonl").read_text())["staleness_shares"]["2"] == 0.25
