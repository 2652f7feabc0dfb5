"""The flow of a swarm run over time, for its report: versions published, submissions accepted,
rejected and trained, the staleness of what was trained, the trainer busy or idle, and the
share of the kept work (taken in, not rejected) never trained (``wasted_share``).

Times are seconds since the trainer's RL loop began (``rl_started_at`` in its summary, Unix
seconds), taken from the ledger (verdicts and releases of unchecked work, stamped by the
orchestrator) and the
trainer's summary (its steps, publications and acknowledgements). Knows nothing about how the
run was started or how the numbers were produced; :func:`plot_flow` draws them.
"""

from __future__ import annotations

from typing import Any


def wasted(by_status: dict[str, int], stale_dropped: int = 0) -> dict[str, Any]:
    """Kept submissions never trained, from the pool's submission statuses at the end and
    the trainer's count of those it acknowledged untrained.

    Kept = trained + still accepted or leased (queued: stale or unused at the end) +
    unchecked at the end (stored and credited, never released by a later passed spot check) +
    dropped (invalidated: with their node, or alone): every submission taken in that was not
    rejected, expired or still waiting for its check (the words: ``swarmrl.ledger.counts``). "Trained" in the pool means
    acknowledged by the trainer, which includes submissions it used up without training any of
    their groups: filtered out (all rewards equal: the filter used them) or every group dropped
    as too stale to carry into a later step (``stale_dropped``: never trained).
    ``wasted_share`` = (kept − trained + stale_dropped) ÷ kept;
    ``wasted_share_by_status`` leaves the stale-dropped out (the pool's statuses alone). Both
    None when nothing was kept. ``wasted_share_excluding_invalidated`` is the first with the
    dropped left out of both sides: work invalidated as a penalty (a banned node's untrained
    work, a soft-invalidated unit) is refused for cause and its credit taken back, where the
    rest of the never-trained work was honest compute the run could not use; the report gives
    both, and the headline is ``wasted_share``."""
    trained = by_status.get("trained", 0)
    queued = by_status.get("accepted", 0) + by_status.get("leased", 0)
    unchecked = by_status.get("unchecked", 0)
    dropped = by_status.get("dropped", 0)
    kept = trained + queued + unchecked + dropped
    return {
        "kept": kept,
        "never_trained": {
            "queued_at_end": queued,
            "unchecked_at_end": unchecked,
            "dropped": dropped,
            "acknowledged_stale": stale_dropped,
        },
        "wasted_share": (kept - trained + stale_dropped) / kept if kept else None,
        "wasted_share_by_status": (kept - trained) / kept if kept else None,
        "wasted_share_excluding_invalidated": (
            (kept - dropped - trained + stale_dropped) / (kept - dropped)
            if kept > dropped
            else None
        ),
    }


def flow_facts(ledger: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """The timeline (module docstring); ``{}`` when the trainer never began its RL loop."""
    flow = summary.get("flow") or {}
    t0 = flow.get("rl_started_at")
    if t0 is None:
        return {}
    accepted: list[float] = []
    rejected: list[float] = []
    for entry in ledger:
        body = entry["body"]
        at = round(entry["ts"] - t0, 3)
        if entry["kind"] == "verdict":
            if body.get("accept"):
                accepted.append(at)
            elif body.get("severity") != "soft":  # soft: dropped without blame
                rejected.append(at)
        elif entry["kind"] == "release":  # unchecked work made trainable by a passed check
            accepted += [at] * len(body.get("submission_ids", []))
    history = summary.get("training", {}).get("history", [])
    steps = []
    for row in history:
        end = row["wall_time"]
        # drawn as a wait then a busy stretch: gradients computed early, while the step still
        # waited for the rest of its batch, count in the busy one (swarmrl.trainer.loop)
        batch = end - row["update_s"]
        steps.append(
            {
                "step": row["step"],
                "start": round(batch - row["rollout_s"], 3),
                "batch": round(batch, 3),
                "end": round(end, 3),
                "staleness": row["staleness"],
            }
        )
    return {
        "rl_started_at": t0,
        "versions": [[round(t - t0, 3), v] for t, v in flow.get("versions", [])],
        "accepted": sorted(accepted),
        "rejected": sorted(rejected),
        "trained": [[round(t - t0, 3), n] for t, n in flow.get("acks", [])],
        "steps": steps,
    }


def _cumulative(times: list[float]) -> tuple[list[float], list[int]]:
    xs = sorted(times)
    return xs, list(range(1, len(xs) + 1))


def plot_flow(ax_counts: Any, ax_trainer: Any, flow: dict[str, Any]) -> None:
    """Submissions over time (cumulative accepted, rejected, trained; versions as ticks) on
    ``ax_counts``; the trainer's steps (idle waiting for rollouts vs busy training) and the
    staleness of what each step trained on ``ax_trainer``."""
    for label, times, style in (
        ("accepted", flow["accepted"], "-"),
        ("rejected", flow["rejected"], "--"),
    ):
        if times:
            xs, ys = _cumulative(times)
            ax_counts.step(xs, ys, where="post", linestyle=style, label=f"{label} ({len(xs)})")
    if flow["trained"]:
        xs = [t for t, _ in flow["trained"]]
        ys, total = [], 0
        for _, n in flow["trained"]:
            total += n
            ys.append(total)
        ax_counts.step(xs, ys, where="post", linewidth=2, label=f"trained ({total})")
    for i, (t, _v) in enumerate(flow["versions"]):
        ax_counts.axvline(
            t,
            color="grey",
            alpha=0.25,
            linewidth=0.8,
            label="version published" if i == 0 else None,
        )
    ax_counts.set_ylabel("submissions")
    ax_counts.set_title("flow: submissions over time")
    ax_counts.grid(alpha=0.3)
    ax_counts.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    steps = flow["steps"]
    idle = [(s["start"], s["batch"] - s["start"]) for s in steps]
    busy = [(s["batch"], s["end"] - s["batch"]) for s in steps]
    ax_trainer.broken_barh(idle, (0.1, 0.8), color="tab:orange", alpha=0.7, label="idle")
    ax_trainer.broken_barh(busy, (0.1, 0.8), color="tab:green", alpha=0.9, label="training")
    ax_trainer.set_yticks([])
    ax_trainer.set_xlabel("seconds since RL began")
    ax_trainer.set_title("trainer: waiting for rollouts vs training; staleness trained")
    stale = ax_trainer.twinx()
    stale.plot([s["end"] for s in steps], [s["staleness"] for s in steps], "k.-", label="staleness")
    stale.set_ylabel("staleness (versions)")
    handles = ax_trainer.get_legend_handles_labels()
    more = stale.get_legend_handles_labels()
    ax_trainer.legend(
        handles[0] + more[0],
        handles[1] + more[1],
        loc="upper left",
        bbox_to_anchor=(1.08, 1.0),
        fontsize=8,
    )
