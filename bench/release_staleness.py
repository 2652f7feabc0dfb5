"""What holding unchecked work costs honest workers: the release rules against staleness and
waste in a long multi-worker swarm.

An unchecked submission (not drawn for a spot check) trains only once ``k`` checks of the same
worker's later submissions passed (``swarm.spot_check_release_after``), and not before the
worker has passed ``n`` checks in all (``swarm.spot_check_release_young``). Larger k or n hold
a sparse cheater's work until it is caught (``bench/spot_residual.py`` counts that); they also
hold an honest worker's work, which may go stale (older than ``rl.async_level`` versions) and be
wasted. This runs the demo's swarm (``swarmrl run``, the embedded config, honest workers only)
once per arm and seed and reports, per arm: the mean age of trained samples (versions) and the
share of the oldest age, the wasted share of kept work (never trained), the units still
unchecked at the end, seconds per step, and held-out accuracy after the run.

    python bench/release_staleness.py [--arms k1 k2 k4 n16 n32] [--seeds 0 1] [--steps 30]
        [--workers 4] [--out bench/release_staleness.json] [--set key=value ...]

Seconds per step are of whatever else the machine does at the same time; arms alternate within
each seed, each seed starting one arm later.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from losses import interleaved
from swarmrl.config import EMBEDDED_DEFAULT, load_config

ARMS = {
    "k1": ["swarm.spot_check_release_after=1"],
    "k2": ["swarm.spot_check_release_after=2"],  # the default
    "k4": ["swarm.spot_check_release_after=4"],
    "n16": ["swarm.spot_check_release_young=16"],
    "n32": ["swarm.spot_check_release_young=32"],
    # twins (swarmrl.pool.flow.twins): a share of unchecked units generated again by another
    # worker, released at once when equal
    "t1": ["swarm.spot_check_twin=1.0"],
    "t1k1": ["swarm.spot_check_twin=1.0", "swarm.spot_check_release_after=1"],
}
BASE = ["eval.control=false", "eval.every=0", "eval.n=200", "run.threads=1"]


def one_run(overrides: list[str], arm: str, seed: int, work: Path, timeout_s: float) -> dict:
    from swarmrl.launch.swarm import run_swarm

    config = load_config([EMBEDDED_DEFAULT], [*overrides, *ARMS[arm], f"run.seed={seed}"])
    run_dir = work / f"{arm}-seed{seed}"
    started = time.perf_counter()
    report = run_swarm(config, run_dir, display=False, timeout_s=timeout_s)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    async_level = config.rl.async_level
    # each step's shares of trained samples by age, weighted by the step's samples alike
    oldest = statistics.fmean(float(r["staleness_shares"].get(str(async_level), 0.0)) for r in rows)
    swarm = report["swarm"]
    subs = swarm["submissions"]
    return {
        "arm": arm,
        "seed": seed,
        "status": report["status"],
        "steps": report["steps"],
        "mean_age": statistics.fmean(r["staleness"] for r in rows),
        "oldest_share": oldest,
        "wasted_share": swarm["wasted_share"],
        "unchecked_at_end": subs["never_trained"]["unchecked_at_end"],
        "taken_in": subs["taken_in"],
        "twins_matched": subs.get("twins_matched", 0),
        "twins": _twins(run_dir),
        "rejected_honest": subs["rejected_honest"],
        "checked": subs["checked"],
        "s_per_step": report["rl_seconds"] / max(report["steps"], 1),
        "accuracy_after": report["eval"]["after"]["accuracy"],
        "wall_s": wall,
    }


def _twins(run_dir: Path) -> dict[str, int]:
    """The run's twins from its ledger: units drawn for one, and the answers equal, different
    or on another version."""
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    entries = [e for e in map(json.loads, lines) if "kind" in e]  # past the file's header
    twins = [e["body"] for e in entries if e["kind"] == "release" and e["body"].get("twin")]
    drawn = sum(
        bool(e["body"].get("check", {}).get("twin")) for e in entries if e["kind"] == "submission"
    )
    return {
        "drawn": drawn,
        "equal": sum(bool(b["matched"]) for b in twins),
        "different": sum(not b["matched"] and not b.get("apart") for b in twins),
        "apart": sum(bool(b.get("apart")) for b in twins),  # other versions: sent to a check
    }


def report(runs: list[dict]) -> None:
    def med(arm: str, key: str) -> tuple[float, float, float] | None:
        xs = [r[key] for r in runs if r["arm"] == arm and key in r]  # older runs lack some
        return (statistics.median(xs), min(xs), max(xs)) if xs else None

    print(
        "| arm | mean age of trained samples | share at the oldest age | wasted share | "
        "unchecked at end | s/step | held-out after | submissions taken in | checked | twins "
        "matched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm in dict.fromkeys(r["arm"] for r in runs):
        cells = []
        for key, fmt in [
            ("mean_age", "{:.2f}"),
            ("oldest_share", "{:.1%}"),
            ("wasted_share", "{:.1%}"),
            ("unchecked_at_end", "{:.0f}"),
            ("s_per_step", "{:.2f}"),
            ("accuracy_after", "{:.1%}"),
            ("taken_in", "{:.0f}"),
            ("checked", "{:.0f}"),
            ("twins_matched", "{:.0f}"),
        ]:
            figures = med(arm, key)
            if figures is None:
                cells.append("—")
                continue
            m, lo, hi = figures
            cells.append(f"{fmt.format(m)} ({fmt.format(lo)}–{fmt.format(hi)})")
        print(f"| {arm} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per swarm run")
    parser.add_argument("--out", default="bench/release_staleness.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--table", metavar="JSON", help="only print the table of a saved run")
    args = parser.parse_args()
    if args.table:
        report(json.loads(Path(args.table).read_text())["runs"])
        return
    overrides = [*BASE, f"rl.steps={args.steps}", f"swarm.workers={args.workers}", *args.overrides]
    work = Path(tempfile.mkdtemp(prefix="swarmrl-release-"))
    runs = []
    for arm, seed in interleaved(args.arms, args.seeds):
        runs.append(one_run(overrides, arm, seed, work, args.timeout))
        print(json.dumps(runs[-1]), flush=True)
        Path(args.out).write_text(
            json.dumps({"overrides": overrides, "runs": runs}, indent=1) + "\n"
        )
    report(runs)
    print(f"figures in {args.out}; runs in {work}")


if __name__ == "__main__":
    main()
