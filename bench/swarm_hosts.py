"""docs/deploy.md's worked example across bad links and machines: the swarm's figures per scenario.

Each run is ``swarmrl.testing.deploy.run_example`` (five namespace hosts, every role started
with the page's command; needs root) of a small arith config; the scenarios are run in turn,
``--runs`` rounds (A, B, A, B…), and each is reported as median (range) over its runs:

- ``clean``: the same hosts with no cap, delay or loss (the baseline; loopback-like);
- ``wan``: both workers behind 20 Mbit/s each way, 150 ms RTT (75 ms each way, ±5 ms jitter)
  and 2 % of connections reset (``swarmrl.testing.linkproxy``), 1 % of their packets dropped
  each way in the kernel (``Host.lose``: TCP retransmits them);
- ``clean-serial``, ``wan-serial``, ``relay-tier-serial``: the same with ``swarm.lease_ahead = false`` (a worker asks
  for its next unit only after its submission's receipt: two round trips a unit, not one);
- ``relay-tier``: the trainer's host (its origin) behind a 20 Mbit/s link with 150 ms RTT to
  every other host, the relay on the workers' side (their first weight source);
- ``relay-tier-lag1``: the same with ``swarm.lease_version_lag = 1`` (a lease may be generated
  on the version before the one it would ask for, while the newest crosses the far link);
- ``slow``: gpu2's worker held to 10 % of a core once it generates;
- ``cut-worker``: gpu1 cut off for 60 s (``pool.dead_after_s``) once it generates;
- ``cut-orch``: the orchestrator's host cut off for 20 s after the trainer's step 0.

Per run: the RL loop's seconds per step, the wasted share (kept work never trained), the
rejections, the most stale step trained, whether the exported ledger verifies, "lost":
submissions a worker was told were taken in that the pool's final account lacks, and the
held-out accuracy (100 problems, greedy) before and after RL: whether the run learnt across
its links.

Usage (as root): ``python bench/swarm_hosts.py [--runs 2] [--scenarios clean wan ...] [--steps 8]``
(``--steps``: RL steps per run; a run's first step also waits for the workers to join and
fetch their first version, a share of s/step that more steps make smaller).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tomli_w

from swarmrl.config import EMBEDDED_DEFAULT
from swarmrl.config.load import read_toml
from swarmrl.testing.deploy import Deployment, Outcome, Started, run_example

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
CONFIG = {
    "env": {"digits": 1},
    "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}},
    "sft": {"steps": 60, "batch_size": 64},
    "rl": {"steps": 8, "prompts_per_step": 16, "group_size": 4},
    "eval": {"n": 100, "control": False},  # held-out greedy accuracy before and after RL
}
WAN = {"delay_ms": 75, "jitter_ms": 5, "reset_probability": 0.02}
SLOW_LINK = {"up_mbit": 20, "down_mbit": 20}
LOSSY_LINK = SLOW_LINK | {"loss": 0.01}
FAR = {"delay_ms": 75, "jitter_ms": 5}


def _wait_for(role: Started, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in role.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)


def _cut(host: str, after: tuple[str, str], seconds: float):
    def during(deployment: Deployment, roles: dict[str, Started]) -> None:
        _wait_for(roles[after[0]], after[1])
        deployment.hosts[host].cut()
        time.sleep(seconds)
        deployment.hosts[host].reconnect()

    return during


def _slow(deployment: Deployment, roles: dict[str, Started]) -> None:
    _wait_for(roles["worker@gpu2"], "generating with policy")
    deployment.throttle("worker@gpu2", 0.1)


SCENARIOS: dict[str, dict[str, Any]] = {
    "clean": {},
    "wan": {
        "links": {"gpu1.lan": LOSSY_LINK, "gpu2.lan": LOSSY_LINK},
        "impair": {"gpu1.lan": WAN, "gpu2.lan": WAN},
    },
    # the same two, a worker asking for its next unit only after its submission's receipt
    "clean-serial": {"config": {"swarm": {"lease_ahead": False}}},
    "wan-serial": {
        "links": {"gpu1.lan": LOSSY_LINK, "gpu2.lan": LOSSY_LINK},
        "impair": {"gpu1.lan": WAN, "gpu2.lan": WAN},
        "config": {"swarm": {"lease_ahead": False}},
    },
    "relay-tier": {
        "links": {"trainer.lan": SLOW_LINK},
        "impair": {"trainer.lan": FAR}
        | {host: {"trainer.lan": FAR} for host in ("relay.lan", "gpu1.lan", "gpu2.lan")},
    },
    "relay-tier-serial": {
        "links": {"trainer.lan": SLOW_LINK},
        "impair": {"trainer.lan": FAR}
        | {host: {"trainer.lan": FAR} for host in ("relay.lan", "gpu1.lan", "gpu2.lan")},
        "config": {"swarm": {"lease_ahead": False}},
    },
    # the same, its operator letting leases lag one version (swarm.lease_version_lag)
    "relay-tier-lag1": {
        "links": {"trainer.lan": SLOW_LINK},
        "impair": {"trainer.lan": FAR}
        | {host: {"trainer.lan": FAR} for host in ("relay.lan", "gpu1.lan", "gpu2.lan")},
        "config": {"swarm": {"lease_version_lag": 1}},
    },
    "slow": {"cpu": {"gpu2.lan": 1.0}, "during": _slow},
    "cut-worker": {"during": _cut("gpu1.lan", ("worker@gpu1", "generating with policy"), 60)},
    "cut-orch": {"during": _cut("orch.lan", ("trainer@trainer", "step 0:"), 20)},
}


def _config(folder: Path, cache: Path, extra: dict[str, dict[str, Any]]) -> Path:
    data = read_toml(EMBEDDED_DEFAULT)
    for config in (CONFIG, extra):
        for section, values in config.items():
            data.setdefault(section, {}).update(values)
    data["run"]["cache_dir"] = str(cache)
    path = folder / "my.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def figures(outcome: Outcome) -> dict[str, float]:
    swarm = outcome.report["swarm"]
    counts = swarm["submissions"]
    lost = sum(
        max(0, outcome.receipts(w) - outcome.taken_in(w)) for w in ("worker@gpu1", "worker@gpu2")
    )
    return {
        "s_per_step": outcome.seconds_per_step(),
        # the steps after the first (which also waits for the workers to join and fetch)
        "later_s_per_step": (
            float(outcome.metrics[-1]["wall_time"]) - float(outcome.metrics[0]["wall_time"])
        )
        / max(1, len(outcome.metrics) - 1),
        "wasted": swarm["wasted_share"] or 0.0,
        "rejected": counts["rejected"],
        "staleness_max": max(row["staleness_max"] for row in outcome.metrics),
        "verified": float(outcome.report["ledger"]["verified"]),
        "lost": lost,
        "slow_receipts": outcome.receipts("worker@gpu2"),
        "before": outcome.report["eval"]["before"]["accuracy"],
        "after": outcome.report["eval"]["after"]["accuracy"],
        "fast_receipts": outcome.receipts("worker@gpu1"),
        # where a step's time goes: its first step (which waits for the workers' first work)
        # and the median step's wait for its batch and its update
        "first_step_s": float(outcome.metrics[0]["wall_time"]),
        "rollout_s": statistics.median(float(r["rollout_s"]) for r in outcome.metrics[1:]),
        "update_s": statistics.median(float(r["update_s"]) for r in outcome.metrics[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--steps", type=int, default=CONFIG["rl"]["steps"])
    args = parser.parse_args()
    CONFIG["rl"]["steps"] = args.steps
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.scenarios}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for round_ in range(args.runs):
            for name in args.scenarios:
                folder = Path(tmp) / f"{name}-{round_}"
                folder.mkdir()
                scenario = dict(SCENARIOS[name])
                extra = scenario.pop("config", {})
                outcome = run_example(
                    PAGE,
                    folder / "hosts",
                    _config(folder, cache, extra),
                    timeout_s=args.timeout_s,
                    **scenario,
                )
                results[name].append(figures(outcome))
                print(f"{name} run {round_}: {results[name][-1]}", flush=True)

    def baseline(name: str) -> str:
        """The clean scenario ``name`` is compared with: clean-serial for the -serial ones."""
        return "clean-serial" if name.endswith("-serial") and "clean-serial" in results else "clean"

    def median(name: str, key: str) -> float | None:
        runs = results.get(name)
        return statistics.median(r[key] for r in runs) if runs else None

    steps = CONFIG["rl"]["steps"]
    rows = CONFIG["rl"]["prompts_per_step"] * CONFIG["rl"]["group_size"]
    print(f"\n{steps} RL steps of {rows} rollouts, 2 workers, {args.runs} runs each")
    for name, runs in results.items():
        compared = baseline(name)
        base, later_base = median(compared, "s_per_step"), median(compared, "later_s_per_step")
        sps = [r["s_per_step"] for r in runs]
        later = [r["later_s_per_step"] for r in runs]
        ratio = f", {statistics.median(sps) / base:.2f}× {compared}" if base else ""
        later_ratio = f", {statistics.median(later) / later_base:.2f}×" if later_base else ""
        print(
            f"{name:10s} s/step {statistics.median(sps):.2f} ({min(sps):.2f}–{max(sps):.2f})"
            f"{ratio}; after the first step {statistics.median(later):.2f} "
            f"({min(later):.2f}–{max(later):.2f}){later_ratio}; wasted {statistics.median(r['wasted'] for r in runs):.0%}; "
            f"rejected {sum(r['rejected'] for r in runs):.0f}; "
            f"max staleness {max(r['staleness_max'] for r in runs):.0f}; "
            f"lost {sum(r['lost'] for r in runs):.0f}; "
            f"ledger verified {sum(r['verified'] for r in runs):.0f}/{len(runs)}; "
            f"units gpu1/gpu2 {statistics.median(r['fast_receipts'] for r in runs):.0f}/"
            f"{statistics.median(r['slow_receipts'] for r in runs):.0f}; "
            f"held-out {statistics.median(r['before'] for r in runs):.0%} → "
            f"{statistics.median(r['after'] for r in runs):.0%} "
            f"({min(r['after'] for r in runs):.0%}–{max(r['after'] for r in runs):.0%}); "
            f"first step {statistics.median(r['first_step_s'] for r in runs):.2f} s, later "
            f"steps' batch wait / update {statistics.median(r['rollout_s'] for r in runs):.2f} / "
            f"{statistics.median(r['update_s'] for r in runs):.2f} s (medians)"
        )


if __name__ == "__main__":
    main()
