"""Other rules of the per-node evidence, weighed on the units ``bench/evidence.py --series``
measured: the same honest and cheating units, judged again under each rule, nothing generated.

    python bench/evidence_rules.py FILE [FILE ...] [--rule NAME ...]

Each rule turns a unit's measurements x (as the file's run measured them: ``--scale`` honest
means, or shares of the thresholds) into what the node's CUSUM adds, and flags at the limit:

    per-measure   x per measure, drift k, limit h (toploc's rule: ``swarmrl.ledger.evidence``)
    combined      the mean of the unit's measures, one CUSUM at drift k, limit h
    weighted      x per measure times its ``--weight`` (MEASURE=W, 1 if not given): the scale
                  of that measure divided by W
    cross         x per measure in units of ``--cross-scale`` s times the highest honest
                  mean of any pairing in the file (what a calibration across the engines
                  would record): x / (s · max over pairings of the mean honest x)

``--measure-limit MEASURE=H`` gives one measure its own limit (the others keep ``--limit``).

Reported per file and rule: per honest pairing the unit a node is flagged at (the target:
never) and the highest S it reached; per cheat and validator engine the unit it is stopped at,
by a rejected unit or its record (the target: within 20).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path

from swarmrl.ledger.evidence import Cusum, add_unit

Measures = Mapping[str, float]

WEIGHTS: dict[str, float] = {}  # --weight
LIMITS: dict[str, float] = {}  # --measure-limit (toploc.evidence_measure_limits)

RULES: dict[str, Callable[[Measures], dict[str, float]]] = {
    "per-measure": dict,
    "combined": lambda m: {"combined": sum(m.values()) / len(m)} if m else {},
    "weighted": lambda m: {k: x * WEIGHTS.get(k, 1.0) for k, x in m.items()},
    "cross": lambda m: {k: x * CROSS.get(k, 1.0) for k, x in m.items()},
}
CROSS: dict[str, float] = {}  # per file: 1 / (s · the highest honest pairing's mean x)


def cross_weights(honest: Mapping[str, dict], scale: float) -> dict[str, float]:
    """1 / (``scale`` × the highest mean x of any honest pairing), per measure."""
    means: dict[str, float] = {}
    for row in honest.values():
        for name, mean in row["mean_x"].items():
            means[name] = max(means.get(name, 0.0), mean)
    return {name: 1.0 / (scale * mean) for name, mean in means.items() if mean > 0}


def replay(series: list, rule: str, drift: float, limit: float) -> tuple[int | None, float]:
    """The unit (1-based) a node of ``series`` is stopped at under ``rule`` (a rejected unit,
    null in the series, or its record past ``limit``), or None; and its record's highest S."""
    record: dict[str, Cusum] = {}
    highest = 0.0
    stopped = None
    for n, measures in enumerate(series, start=1):
        if measures is None:
            stopped = stopped or n
            continue
        flagged = add_unit(record, RULES[rule](measures), drift, limit, LIMITS)
        highest = max([highest, *(c.value for c in record.values())])
        if flagged and stopped is None:
            stopped = n
    return stopped, highest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rule", action="append", choices=sorted(RULES))
    parser.add_argument("--drift", type=float, nargs="+", default=[0.5])
    parser.add_argument("--limit", type=float, nargs="+", default=[2.0])
    parser.add_argument("--weight", action="append", default=[], help="MEASURE=W (weighted)")
    parser.add_argument(
        "--measure-limit", action="append", default=[], help="MEASURE=H: that measure's limit"
    )
    parser.add_argument("--cross-scale", type=float, default=2.5, help="s of the cross rule")
    args = parser.parse_args()
    WEIGHTS.update({k: float(w) for k, _, w in (item.partition("=") for item in args.weight)})
    LIMITS.update({k: float(h) for k, _, h in (i.partition("=") for i in args.measure_limit)})
    for path in args.files:
        data = json.loads(Path(path).read_text())
        shape = data["args"].get("model_shape") or "toploc_cases' model"
        print(f"== {path} ({shape}; scale {data['args'].get('scale')})")
        CROSS.clear()
        CROSS.update(cross_weights(data["honest"], args.cross_scale))
        for rule in args.rule or sorted(RULES):
            for drift in args.drift:
                for limit in args.limit:
                    honest = {
                        p: replay(row["series"], rule, drift, limit)
                        for p, row in data["honest"].items()
                    }
                    cheats = {
                        c: replay(row["series"], rule, drift, limit)[0]
                        for c, row in data["cheats"].items()
                    }
                    flagged = {p: f"{s} (S {h:.2f})" for p, (s, h) in honest.items() if s}
                    top = max(h for _, h in honest.values())
                    print(
                        f"{rule:12s} k {drift:<5g} h {limit:<5g} honest flagged: "
                        f"{flagged or 'none'}, highest S {top:.2f}; stopped at: "
                        + ", ".join(
                            f"{c.split(' ')[0]}->{c[-5:].strip()} {s}" for c, s in cheats.items()
                        )
                    )


if __name__ == "__main__":
    main()
