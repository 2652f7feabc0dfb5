"""What a finished (or interrupted) local swarm did, for its report: submissions, verdicts and
bans from the orchestrator's API, the ledger exported with the orchestrator's attestation and
verified offline, what the trainer published, the run's flow over time and the share of
kept work never trained (``swarmrl.launch.flow``), and the closing account in words.

Reads the pool only through its API and the trainer only through its summary file; knows
nothing about starting or stopping roles (``swarmrl.launch.swarm``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from swarmrl.identity import load_keypair
from swarmrl.launch.flow import flow_facts, wasted
from swarmrl.ledger.counts import LedgerCounts, count_ledger
from swarmrl.protocol import NodeView
from swarmrl.protocol.swarm import RoleStatus

if TYPE_CHECKING:
    from swarmrl.launch.plan import SwarmPlan

POOL_ID = "swarm"  # the one pool a local swarm hosts


def swarm_facts(plan: SwarmPlan) -> dict:
    """What the run did as a swarm: submissions, bans, versions, bytes, and the ledger check.

    Everything about the pool comes from the orchestrator's API (metrics, nodes, the whole
    ledger), never from its database; the ledger export is then verified offline against the
    orchestrator's key."""
    from swarmrl.ledger.export import write_entries
    from swarmrl.ledger.verify import verify_export
    from swarmrl.pool.client import PoolClient

    trainer_key = load_keypair(plan.key("trainer"))
    with PoolClient(plan.orchestrator_url, trainer_key, plan.config.swarm.peer_timeout_s) as pool:
        metrics = pool.metrics(plan.pool_id)
        nodes = pool.nodes(plan.pool_id)
        ledger, attestation = pool.attested_ledger()
    ledger_file = plan.run_dir / "ledger.jsonl"
    entries = write_entries(ledger, ledger_file, attestation)
    orchestrator_key = plan.orchestrator_public_key()
    verified = verify_export(ledger_file, orchestrator_key)
    judged = verdict_counts(ledger)
    counts = count_ledger(ledger)
    names = {load_keypair(plan.key(w)).node_id: w for w in plan.workers}
    honest = {n for n, name in names.items() if name not in plan.cheats}
    by_status = metrics.submissions_by_status
    summary = trainer_summary(plan)
    origin = summary.get("origin", {})
    flow = summary.get("flow", {})
    waste = wasted(by_status, len(flow.get("stale_dropped", [])))
    return {
        "swarm": {
            "workers": worker_rows(plan, nodes, names, judged, counts),
            "submissions": {
                # the counts' words (swarmrl.ledger.counts): from the ledger, trained from the
                # pool's statuses; dropped/pending/unchecked are the pool's statuses at the end
                **counts.total.as_dict(),
                "trained": by_status.get("trained", 0),
                "dropped": by_status.get("dropped", 0),
                "pending": by_status.get("pending", 0),
                # not selected for a check and not yet released by a later passed one
                "unchecked": by_status.get("unchecked", 0),
                # twins whose output equalled the unit they repeated: credited, never trained
                # (the samples trained once, as the other's; swarmrl.pool.flow.twins)
                "twins_matched": by_status.get("matched", 0),
                "rejected_honest": sum(c["rejected"] for n, c in judged.items() if n in honest),
                # rejected by a validator yet acknowledged by the trainer: must stay 0
                "rejected_trained": len(
                    rejected_ids(ledger) & set(summary.get("consumed_submissions", []))
                ),
                **waste,
                # informative groups the trainer held over until too stale (their submission
                # counts as trained when another of its groups was)
                "stale_groups_dropped": flow.get("stale_groups"),
            },
            "wasted_share": waste["wasted_share"],
            "flow": flow_facts(ledger, summary),
            "banned_nodes": sorted(n.node_id for n in nodes if n.state == "banned"),
            "versions_published": origin.get("versions_published"),
            **trainer_idle(summary),
        },
        "shardcast": {
            "bytes_full": origin.get("bytes_full"),
            "bytes_delta": origin.get("bytes_delta"),
        },
        "ledger": {
            "entries": entries,
            "verified": verified.ok,
            "attested": verified.attested,  # the file's head signed by the orchestrator
            "file": str(ledger_file),
            "orchestrator_key": orchestrator_key,
            "credited_tokens": metrics.credited_tokens,
        },
    }


def verdict_counts(ledger: list[dict]) -> dict[str, dict[str, Any]]:
    """node id → accepted, rejected (hard: judged dishonest) and expired (soft: dropped
    without blame, e.g. its version was pruned before anyone could replay it) verdicts, from
    the ledger's verdict entries, and the reason given for the first hard rejection (``""``
    when none)."""
    judged: dict[str, dict[str, Any]] = {}
    for entry in ledger:
        if entry["kind"] == "verdict":
            counts = judged.setdefault(
                entry["node_id"],
                {"accepted": 0, "rejected": 0, "expired": 0, "first_rejection": ""},
            )
            body = entry["body"]
            outcome = "accepted" if body.get("accept") else "rejected"
            if outcome == "rejected" and body.get("severity") == "soft":
                outcome = "expired"
            counts[outcome] += 1
            if outcome == "rejected" and not counts["first_rejection"]:
                reasons = body.get("reasons") or ["no reason given"]
                counts["first_rejection"] = str(reasons[0])[:300]
    return judged


def rejected_ids(ledger: list[dict]) -> set[str]:
    """Ids of the submissions a validator rejected, from the ledger's verdict entries."""
    return {
        e["body"]["submission_id"]
        for e in ledger
        if e["kind"] == "verdict" and not e["body"].get("accept")
    }


def worker_rows(
    plan: SwarmPlan,
    nodes: list[NodeView],
    names: dict[str, str],
    judged: dict[str, dict[str, Any]],
    counts: LedgerCounts,
) -> list[dict]:
    """One row per pool node: name, state, cheat, its submission counts (taken in, checked,
    accepted, rejected, ...: ``swarmrl.ledger.counts``), why it was first rejected,
    throughput, rollouts."""
    statuses = RoleStatus.read_dir(plan.status_dir)
    rows = []
    for n in nodes:
        name = names.get(n.node_id)
        rows.append(
            {
                "name": name or n.node_id[:8],
                "node_id": n.node_id,
                "state": n.state,
                "cheat": plan.cheats.get(name or "", ""),
                "model_version": n.model_version,
                **{
                    word: count
                    for word, count in counts.node(n.node_id).as_dict().items()
                    if word != "trained"  # the pool's statuses say it per run, not per node
                },
                "first_rejection": judged.get(n.node_id, {}).get("first_rejection", ""),
                "measured_tokens_per_s": n.measured_tokens_per_s,
                "rollouts": statuses[name].metrics.get("rollouts", 0) if name in statuses else None,
            }
        )
    return rows


def trainer_idle(summary: dict) -> dict:
    """The trainer's idle time: seconds its steps spent waiting for accepted rollouts."""
    training = summary.get("training", {})
    history, rl_seconds = training.get("history", []), training.get("rl_seconds")
    idle_s = sum(row["rollout_s"] for row in history) if history else None
    return {
        "trainer_idle_s": idle_s,
        "trainer_idle_fraction": idle_s / rl_seconds if idle_s and rl_seconds else None,
    }


def trainer_summary(plan: SwarmPlan) -> dict:
    """What the trainer wrote at its end (``{}`` while it has not): the training loop's result
    (``training``), what its origin published (``origin``) and the submissions it consumed."""
    path = plan.run_dir / "trainer" / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _waste_clause(subs: dict) -> str:
    """The summary's clause on never-trained work, e.g. ``(12% of the 40 kept never trained;
    9% leaving out the 7 invalidated as a penalty)``; the second part only where work was
    invalidated, nothing without a share."""
    if subs.get("wasted_share") is None:
        return ""
    clause = f" ({subs['wasted_share']:.0%} of the {subs['kept']} kept never trained"
    without = subs.get("wasted_share_excluding_invalidated")
    if subs.get("dropped") and without is not None:
        clause += f"; {without:.0%} leaving out the {subs['dropped']} invalidated as a penalty"
    return clause + ")"


def summary_text(report: dict) -> str:
    """What happened, in words, for a person at the end of a swarm run: learning, who cheated
    and how they were caught, what was rejected, and how to check the ledger oneself."""
    ev, swarm, ledger = report["eval"], report["swarm"], report["ledger"]
    subs = swarm["submissions"]
    control = ev.get("control", {}).get("accuracy")
    lines = [
        f"held-out accuracy (n={ev['n']}): {ev['before']['accuracy']:.1%} before RL, "
        f"{ev['after']['accuracy']:.1%} after {report['steps']} RL steps "
        f"({report['rl_seconds']:.0f} s of {report['wall_seconds']:.0f} s)"
        + (
            f"; the control (the warm start's SFT continued as long): {control:.1%}"
            if control is not None
            else f"; no control: {ev.get('control_skipped', 'not run')}"
        )
    ]
    for w in swarm["workers"]:
        if w["cheat"] or w["state"] == "banned":
            lines.append(
                f"{w['name']} cheated ({w['cheat'] or 'not planted by this run'}): "
                f"{w['accepted']} submissions accepted before it was caught, then "
                f"{w['rejected']} rejected by a validator that replayed them"
                + (f" ({w['first_rejection']})" if w["first_rejection"] else "")
                + f"; {'banned' if w['state'] == 'banned' else 'state ' + w['state']}"
            )
    lines.append(
        f"submissions: {subs['taken_in']} taken in, {subs['checked']} checked by a validator, "
        f"{subs['accepted']} accepted (passed a check, or released by a later passed one), "
        f"{subs['rejected']} rejected ({subs['rejected_honest']} of them from honest workers), "
        f"{subs['expired']} expired unchecked, {subs['invalidated']} invalidated, "
        f"{subs['trained']} trained"
        + _waste_clause(subs)
        + (
            f", {subs['twins_matched']} twins that matched another worker's output (credited, "
            "not trained again)"
            if subs.get("twins_matched")
            else ""
        )
        + (
            f", {subs['stale_groups_dropped']} held-over groups went too stale to train"
            if subs.get("stale_groups_dropped")
            else ""
        )
        + "; "
        + (
            "none of the rejected reached the trainer"
            if not subs["rejected_trained"]
            else f"{subs['rejected_trained']} REJECTED SUBMISSIONS WERE TRAINED ON"
        )
    )
    verified = "verifies" if ledger["verified"] else "DOES NOT VERIFY"
    lines.append(
        f"the ledger ({ledger['entries']} signed entries) {verified}; check it yourself: "
        f"swarmrl ledger verify {ledger['file']} --orchestrator-key {ledger['orchestrator_key']}"
    )
    return "\n".join(lines)
