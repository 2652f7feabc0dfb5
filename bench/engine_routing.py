"""Which validator judges each unit in a swarm of two engines: the share measured against the
tight honest means of the node's own engine (docs/toploc.md, "The pool routes each unit").

    python bench/engine_routing.py --runs 3 [--before-src PATH] [--out bench/engine-routing.json]
    python bench/engine_routing.py --summarise RUN_DIR [RUN_DIR ...]

Each run is the bfloat16 demo with a torch and a vLLM validator and a torch and a vLLM worker
(``swarmrl demo --quiet --set inference.dtype=bfloat16 --set 'toploc.engines=["torch","vllm"]'
--set swarm.validators=2``; the cheater runs torch). ``--before-src`` alternates each run with
one of another source tree (``PYTHONPATH=PATH/src``, e.g. a worktree of an earlier commit).
From each run directory: every unit a validator accepted or rejected, by the engine its node
ran and the validator's own (its log names the pairing of each accepted unit), the units
expired unchecked, held-out accuracy before and after, and the run's status. Counts, not timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from swarmrl.testing.runs import logged_backend

DEMO = [
    "--quiet",
    "--set",
    "inference.dtype=bfloat16",
    "--set",
    'toploc.engines=["torch","vllm"]',
    "--set",
    "swarm.validators=2",
]


def summarise(run: Path) -> dict:
    report = json.loads((run / "report.json").read_text())
    workers = {w["node_id"]: w for w in report["swarm"]["workers"]}
    engine = {
        n: logged_backend((run / "logs" / f"{w['name']}.log").read_text())
        for n, w in workers.items()
    }
    judged: Counter[tuple[str, str, str]] = Counter()
    for log_path in sorted((run / "logs").glob("validator-*.log")):
        text = log_path.read_text()
        own = logged_backend(text)
        for node, _, validator in re.findall(r"accepted \S+ from node (\w+) \((\w+)->(\w+),", text):
            judged[(workers[node]["name"], f"{engine[node]}->{validator}", "accepted")] += 1
        for node in re.findall(r"rejected \S+ from node (\w+):", text):
            judged[(workers[node]["name"], f"{engine[node]}->{own}", "rejected")] += 1
    rows = {}
    for w in workers.values():
        mine = {f"{p} {o}": n for (name, p, o), n in judged.items() if name == w["name"]}
        own = sum(n for key, n in mine.items() if len(set(key.split()[0].split("->"))) == 1)
        rows[w["name"]] = {
            "engine": engine[w["node_id"]],
            "cheat": w["cheat"],
            "state": w["state"],
            "judged": mine,
            "own_engine": own,
            "total": sum(mine.values()),
            "expired": w["expired"],
        }
    evaluation = report.get("eval", {})
    return {
        "run": str(run),
        "status": report["status"],
        "accuracy": [evaluation.get(k, {}).get("accuracy") for k in ("before", "after")],
        "expired": report["swarm"]["submissions"]["expired"],
        "rejected_honest": report["swarm"]["submissions"]["rejected_honest"],
        "own_engine": sum(r["own_engine"] for r in rows.values()),
        "judged": sum(r["total"] for r in rows.values()),
        "workers": rows,
    }


def run_demo(run_dir: Path, source: str | None) -> Path:
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = str(Path(source) / "src")
    else:
        env.pop("PYTHONPATH", None)
    argv = [sys.executable, "-m", "swarmrl.cli", "demo", *DEMO, "--set", f"run.run_dir={run_dir}"]
    subprocess.run(argv, env=env, check=True)
    (run,) = [p for p in run_dir.iterdir() if (p / "report.json").exists()]
    return run


def line(arm: str, s: dict) -> str:
    share = s["own_engine"] / s["judged"] if s["judged"] else 0.0
    return (
        f"{arm}: own engine {s['own_engine']}/{s['judged']} ({share:.1%}), expired {s['expired']}, "
        f"honest rejected {s['rejected_honest']}, accuracy {s['accuracy'][0]} -> {s['accuracy'][1]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before-src", help="alternate each run with this source tree")
    parser.add_argument("--summarise", nargs="+", type=Path, help="summarise these run dirs")
    parser.add_argument("--out", default="bench/engine-routing.json")
    args = parser.parse_args()
    if args.summarise:
        for run in args.summarise:
            print(line(str(run), summarise(run)))
        return
    arms = [("routed", None)] + ([("before", args.before_src)] if args.before_src else [])
    results: dict[str, list[dict]] = {arm: [] for arm, _ in arms}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.runs):
            for arm, source in arms:
                started = time.perf_counter()
                print(f"run {i + 1}/{args.runs}, {arm} ...", flush=True)
                run = run_demo(Path(scratch) / f"{arm}-{i}", source)
                summary = summarise(run)
                summary["seconds"] = time.perf_counter() - started
                summary["load"] = os.getloadavg()
                results[arm].append(summary)
                print(line(arm, summary), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
