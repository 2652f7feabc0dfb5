"""The spot-check residual: falsified units that train before their node is banned.

A falsified unit the draw does not select waits as ``unchecked`` and trains (with the worker's
own declared log-probs) once a check of a later unit of the same node passes
(``swarmrl.pool.flow.spotcheck``). This drives a real orchestrator (SQLite, in this process)
with identities of a few strategies, one at a time, each until it is banned or has submitted
``--max-units``:

- ``always``: falsifies every unit;
- ``f=0.5``, ``f=0.1``: falsifies each unit with that probability;
- ``probation``: honest for its first ``--warmup`` units (its rate falls to the floor), then
  falsifies each unit with probability 0.25.

A validator claims every selected unit and replays it (the synthetic model of
``swarmrl.testing.pool_nodes`` is a function of the unit's seed, so a falsified unit really
differs: one output token changed), and the trainer takes and acknowledges every batch. For
each strategy it reports the falsified units that reached the trainer per identity (mean and
per caught identity), the validator's replays per unit trained, the share of trained units that
trained on the worker's own log-probs (released unchecked), and the expectation
(1 − f)(1 − p)/p at the floor p (docs/pool.md, "When unchecked work trains"; an identity's rate
starts at 1 and falls by ``--decay`` per passed check, so fresh identities stay below it).

Usage: ``python bench/spot_residual.py [--identities 20] [--floor 0.5] [--decay 0.8]``
(the floor and decay of ``swarm.spot_check_floor`` / ``swarm.spot_check_decay``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "residual"


@dataclass
class Identity:
    submitted: int = 0
    falsified: int = 0
    trained: int = 0  # units of it served to the trainer
    falsified_trained: int = 0
    replays: int = 0  # units of it the validator replayed
    banned: bool = False

    @property
    def trained_unchecked(self) -> int:
        """Units trained with the worker's own declared log-probs (released, never replayed):
        every trained unit but the checks that passed."""
        return self.trained - (self.replays - self.banned)


@dataclass
class Strategy:
    name: str
    f: float
    warmup: int = 0
    identities: list[Identity] = field(default_factory=list)


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
    mine: set[str] = set()
    for n in range(args.max_units):
        node.heartbeat(POOL, Heartbeat(status="ok"))
        work = node.lease(POOL).work
        samples = synthetic_samples(work, 0)
        cheat = n >= strategy.warmup and rng.random() < strategy.f
        if cheat:
            samples[0].output_tokens[0] = (samples[0].output_tokens[0] + 1) % 1000
        sid = node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples)).submission_id
        me.submitted += 1
        mine.add(sid)
        if cheat:
            me.falsified += 1
            falsified.add(sid)
        for pending in checker.claim(POOL, limit=256):
            verdict = _replay(pending)
            me.replays += 1
            receipt = checker.verdict(POOL, verdict)
            me.banned |= receipt.status == "rejected"
        batch = trainer.batch(POOL, step=0, holder="t" * 32, limit=256)
        served = {s.submission_id for s in batch.submissions}
        if served:
            trainer.ack_batch(POOL, sorted(served))
        me.trained += len(served & mine)
        me.falsified_trained += len(served & falsified)
        if me.banned:
            break
    return me


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--identities", type=int, default=20, help="identities per strategy")
    parser.add_argument("--floor", type=float, default=0.5, help="validated_fraction")
    parser.add_argument("--decay", type=float, default=0.8, help="check_rate_decay")
    parser.add_argument("--max-units", type=int, default=400, help="most units per identity")
    parser.add_argument("--warmup", type=int, default=10, help="honest units of 'probation'")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cheating choices")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    strategies = [
        Strategy("always", 1.0),
        Strategy("f=0.5", 0.5),
        Strategy("f=0.1", 0.1),
        Strategy("probation", 0.25, warmup=args.warmup),
    ]
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=100_000, open=True,
        sampling=SamplingParams(max_new_tokens=2), validators=[validator.public_key_hex],
        validated_fraction=args.floor, check_rate_decay=args.decay, max_tasks_per_lease=1,
        max_leases_in_flight=64,
    )  # fmt: skip
    rng = random.Random(args.seed)
    config = PoolConfig(join_burst=100_000)  # every identity joins at once, unthrottled
    with (
        tempfile.TemporaryDirectory() as tmp,
        local_orchestrator(Path(tmp), orch, config) as server,
    ):
        PoolClient(server.url, orch).create_pool(spec)
        for strategy in strategies:
            for _ in range(args.identities):
                strategy.identities.append(
                    run_identity(server.url, owner, validator, strategy, args, rng)
                )
    p = args.floor
    rows = []
    print(f"floor p = {p}, decay {args.decay}, {args.identities} identities per strategy")
    header = ("strategy", "caught", "units", "falsified", "falsified trained / identity",
              "/ caught", "max", "(1-f)(1-p)/p", "replays / unit trained",
              "trained unchecked")  # fmt: skip
    print(" | ".join(header))
    for s in strategies:
        ids = s.identities
        caught = [i for i in ids if i.banned]
        residual = [i.falsified_trained for i in ids]
        trained = sum(i.trained for i in ids)
        row = {
            "strategy": s.name,
            "caught": len(caught),
            "units": sum(i.submitted for i in ids),
            "falsified": sum(i.falsified for i in ids),
            "falsified_trained_per_identity": statistics.mean(residual),
            "falsified_trained_per_caught": (
                sum(i.falsified_trained for i in caught) / len(caught) if caught else None
            ),
            "max": max(residual),
            "expected_at_floor": (1 - s.f) * (1 - p) / p,
            "replays_per_unit_trained": sum(i.replays for i in ids) / trained if trained else None,
            "trained_unchecked_share": (
                sum(i.trained_unchecked for i in ids) / trained if trained else None
            ),
            "identities": [asdict(i) for i in ids],
        }
        rows.append(row)
        per_caught = row["falsified_trained_per_caught"]
        cells = (s.name, f"{len(caught)}/{len(ids)}", str(row["units"]), str(row["falsified"]),
                 f"{row['falsified_trained_per_identity']:.2f}",
                 "-" if per_caught is None else f"{per_caught:.2f}", str(row["max"]),
                 f"{row['expected_at_floor']:.2f}",
                 "-" if row["replays_per_unit_trained"] is None
                 else f"{row['replays_per_unit_trained']:.2f}",
                 "-" if row["trained_unchecked_share"] is None
                 else f"{row['trained_unchecked_share']:.0%}")  # fmt: skip
        print(" | ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "strategies": rows}, indent=1))


if __name__ == "__main__":
    main()
