"""The spot-check residual: falsified units that train before their node is banned, per remedy.

A falsified unit the draw does not select waits as ``unchecked`` and trains (with the worker's
own declared log-probs) once checks of later submissions of the same node pass
(``swarmrl.pool.flow.spotcheck``). This drives a real orchestrator (SQLite, in this process)
with identities of a few strategies, one at a time, each until it is banned or has submitted
``--max-units``:

- ``always``: falsifies every unit;
- ``f=0.5``, ``f=0.1``: falsifies each unit with that probability;
- ``probation``: honest for its first ``--warmup`` units (its rate falls to the floor), then
  falsifies each unit with probability 0.25;
- ``honest``: never falsifies, submits ``--honest-units`` units; what a remedy costs it.

A validator claims every selected unit and replays it (the synthetic model of
``swarmrl.testing.pool_nodes`` is a function of the unit's seed, so a falsified unit really
differs: one output token changed), and the trainer takes and acknowledges every batch after
each submission. Each *arm* is one release rule (a fresh orchestrator): ``k`` =
``release_after_checks`` (an unchecked unit trains once k checks of later units of its node
passed), ``q`` = ``release_replay_fraction`` (that share of what a passed check would release
is replayed instead), ``n`` = ``release_young_checks`` (a node with fewer passed checks has
nothing released), ``p`` = ``validated_fraction`` (the floor; an arm replaying at release
lowers it so the validator's replays per unit stay those of the baseline). Arms alternate
within each seed; the seed fixes every identity's cheating choices, the same in every arm (the
spot-check draws are the orchestrator's own and differ between runs).

Per arm and strategy: falsified units trained per identity and per caught identity, the
validator's replays per unit submitted, and for ``honest`` the delay from a unit's submission
to its training, counted in the node's own later submissions, over the units of the first half
of its run (a unit delayed by more than the units a node submits in ``async_level`` policy
versions goes stale), and the units still held when it stops (discarded if it leaves then).

Usage: ``python bench/spot_residual.py [--identities 20] [--seeds 0 1] [--arms base,k2,...]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "residual"

# arm name → (floor p, release_after_checks k, release_replay_fraction q,
# release_young_checks n); the replay arms' floors keep p + (1 − p) q = 0.5, the baseline's
# replays per unit at its floor
ARMS: dict[str, tuple[float, int, float, int]] = {
    "base": (0.5, 1, 0.0, 0),
    "k2": (0.5, 2, 0.0, 0),
    "k4": (0.5, 4, 0.0, 0),
    "k8": (0.5, 8, 0.0, 0),
    "k16": (0.5, 16, 0.0, 0),
    "q0.25": (1 / 3, 1, 0.25, 0),
    "q0.25k4": (1 / 3, 4, 0.25, 0),
    "n16": (0.5, 1, 0.0, 16),
    "n32": (0.5, 1, 0.0, 32),
}


@dataclass
class Identity:
    submitted: int = 0
    falsified: int = 0
    trained: int = 0  # units of it served to the trainer
    falsified_trained: int = 0
    replays: int = 0  # units of it the validator replayed
    banned: bool = False
    # per unit of the first half of an honest run: its later units until it trained (None:
    # not by the end, so the delays of a run's first half are all seen unless one is None)
    delays: list[int | None] = field(default_factory=list)
    held: int = 0  # units neither trained nor dropped when it stopped


@dataclass
class Strategy:
    name: str
    f: float
    warmup: int = 0
    units: int | None = None  # honest: a fixed number of units


def _replay(pending) -> Verdict:
    want = synthetic_samples(pending.work, 0)
    ok = [s.output_tokens for s in pending.samples] == [w.output_tokens for w in want]
    return Verdict(
        submission_id=pending.submission_id,
        accept=ok,
        reasons=[] if ok else ["sampling replay mismatch"],
        measured_tokens=sum(len(w.output_tokens) for w in want) if ok else 0,
        behaviour_logprobs=[w.logprobs for w in want] if ok else None,
    )


def run_identity(url: str, owner: KeyPair, validator: KeyPair, strategy: Strategy, args,
                 rng: random.Random) -> Identity:  # fmt: skip
    node = PoolClient(url, KeyPair.generate())
    node.join(POOL, CPU_NODE)
    checker, trainer = PoolClient(url, validator), PoolClient(url, owner)
    me = Identity()
    falsified: set[str] = set()
    submitted_at: dict[str, int] = {}
    trained_at: dict[str, int] = {}
    for n in range(strategy.units or args.max_units):
        node.heartbeat(POOL, Heartbeat(status="ok"))
        work = node.lease(POOL).work
        samples = synthetic_samples(work, 0)
        cheat = n >= strategy.warmup and rng.random() < strategy.f
        if cheat:
            samples[0].output_tokens[0] = (samples[0].output_tokens[0] + 1) % 1000
        sid = node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples)).submission_id
        me.submitted += 1
        submitted_at[sid] = n
        if cheat:
            me.falsified += 1
            falsified.add(sid)
        while pending := checker.claim(POOL, limit=256):  # releases may send units to a check
            for unit in pending:
                me.replays += unit.submission_id in submitted_at
                try:
                    receipt = checker.verdict(POOL, _replay(unit))
                except Conflict:  # dropped: a verdict before it banned its node
                    continue
                me.banned |= receipt.status == "rejected"
        batch = trainer.batch(POOL, step=0, holder="t" * 32, limit=256)
        served = {s.submission_id for s in batch.submissions}
        if served:
            trainer.ack_batch(POOL, sorted(served))
        mine = served & submitted_at.keys()
        me.trained += len(mine)
        me.falsified_trained += len(mine & falsified)
        trained_at.update(dict.fromkeys(mine, n))
        if me.banned:
            break
    if not me.banned:
        me.held = me.submitted - me.trained
    if strategy.units:
        half = [s for s, n in submitted_at.items() if n < strategy.units // 2]
        me.delays = [trained_at[s] - submitted_at[s] if s in trained_at else None for s in half]
    return me


def run_arm(arm: str, seed: int, args) -> dict[str, list[Identity]]:
    floor, release_after, replay, young = ARMS[arm]
    strategies = [
        Strategy("always", 1.0),
        Strategy("f=0.5", 0.5),
        Strategy("f=0.1", 0.1),
        Strategy("probation", 0.25, warmup=args.warmup),
        Strategy("honest", 0.0, units=args.honest_units),
    ]
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=100_000, open=True,
        sampling=SamplingParams(max_new_tokens=2), validators=[validator.public_key_hex],
        validated_fraction=floor, check_rate_decay=args.decay, max_tasks_per_lease=1,
        max_leases_in_flight=64, release_after_checks=release_after,
        release_replay_fraction=replay, release_young_checks=young,
    )  # fmt: skip
    config = PoolConfig(join_burst=100_000)  # every identity joins at once, unthrottled
    out: dict[str, list[Identity]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        local_orchestrator(Path(tmp), orch, config) as server,
    ):
        PoolClient(server.url, orch).create_pool(spec)
        for i, strategy in enumerate(strategies):
            count = args.honest if strategy.units else args.identities
            out[strategy.name] = [
                # the same cheating choices for identity j of this strategy in every arm
                run_identity(
                    server.url, owner, validator, strategy, args, random.Random(f"{seed}/{i}/{j}")
                )  # fmt: skip
                for j in range(count)
            ]
    return out


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None


def summarise(ids: list[Identity]) -> dict:
    caught = [i for i in ids if i.banned]
    submitted = sum(i.submitted for i in ids)
    seen = [d for i in ids for d in i.delays]
    delays = sorted(d for d in seen if d is not None)
    return {
        "identities": len(ids),
        "caught": len(caught),
        "units": submitted,
        "falsified": sum(i.falsified for i in ids),
        "falsified_trained_per_identity": _mean([i.falsified_trained for i in ids]),
        "falsified_trained_per_caught": _mean([i.falsified_trained for i in caught]),
        "max": max((i.falsified_trained for i in ids), default=0),
        "replays_per_unit": sum(i.replays for i in ids) / submitted if submitted else None,
        "delay_mean": _mean(delays),
        "delay_p90": delays[int(0.9 * (len(delays) - 1))] if delays else None,
        "delay_max": delays[-1] if delays else None,
        "first_half_untrained": sum(d is None for d in seen),
        "held_at_end_per_identity": _mean([i.held for i in ids if not i.banned]),
    }


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--identities", type=int, default=20, help="identities per strategy")
    parser.add_argument("--honest", type=int, default=5, help="honest identities per arm")
    parser.add_argument("--honest-units", type=int, default=80, help="units per honest one")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--decay", type=float, default=0.8, help="check_rate_decay")
    parser.add_argument("--max-units", type=int, default=400, help="most units per identity")
    parser.add_argument("--warmup", type=int, default=10, help="honest units of 'probation'")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    arms = args.arms.split(",")
    runs: dict[tuple[str, int], dict[str, list[Identity]]] = {}
    for seed in args.seeds:  # arms alternate within each seed
        for arm in arms:
            runs[(arm, seed)] = run_arm(arm, seed, args)
            print(f"arm {arm} seed {seed} done", file=sys.stderr, flush=True)
    print(f"decay {args.decay}; {args.identities} identities per cheating strategy and "
          f"{args.honest} honest ones of {args.honest_units} units per arm; seeds {args.seeds}")  # fmt: skip
    header = ("arm (p, k, q, n)", "strategy", "caught", "falsified trained / caught (per seed)",
              "max", "replays / unit (per seed)", "honest delay mean / p90 / max",
              "held at end")  # fmt: skip
    print(" | ".join(header))
    rows = []
    for arm in arms:
        floor, k, q, young = ARMS[arm]
        for name in runs[(arm, args.seeds[0])]:
            per_seed = [summarise(runs[(arm, seed)][name]) for seed in args.seeds]
            rows.append({"arm": arm, "floor": floor, "release_after_checks": k,
                         "release_replay_fraction": q, "release_young_checks": young, "strategy": name, "seeds": args.seeds,
                         "per_seed": per_seed,
                         "runs": [[asdict(i) for i in runs[(arm, seed)][name]]
                                  for seed in args.seeds]})  # fmt: skip
            cells = (
                f"{arm} ({floor:.2f}, {k}, {q}, {young})", name,
                " / ".join(f"{r['caught']}/{r['identities']}" for r in per_seed),
                " / ".join(_fmt(r["falsified_trained_per_caught"]) for r in per_seed),
                str(max(r["max"] for r in per_seed)),
                " / ".join(_fmt(r["replays_per_unit"]) for r in per_seed),
                " / ".join(f"{_fmt(r['delay_mean'], '.1f')} {_fmt(r['delay_p90'], 'd')} "
                           f"{_fmt(r['delay_max'], 'd')}"
                           + (f" ({r['first_half_untrained']} never)"
                              if r["first_half_untrained"] else "")
                           for r in per_seed)
                if name == "honest" else "",
                " / ".join(_fmt(r["held_at_end_per_identity"], ".1f") for r in per_seed)
                if name == "honest" else "",
            )  # fmt: skip
            print(" | ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
