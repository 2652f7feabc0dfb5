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

A cheater falsifies only its own units: a twin of another node's unit (the lease says whose,
``origin_node_id``) is compared with that node's output, so it answers those honestly.

In the twin arms a peer beside the identities answers every twin (it is the only other node
asking); with ``--sybil`` it is the cheaters' accomplice, answering the twin of a falsified unit
with the same falsified output, the worst case of a party holding two identities; banned (a
ban of its partner sends its copies to validators), it joins again as a new identity, and the
arm reports its copies, those whose credit it kept, and its identities banned. With
``--more-peers K``, K honest peers ask for work after it each round: a twin goes to a node drawn
among the healthy others first (``swarmrl.pool.flow.twins``), so the accomplice wins only its
share.

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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.errors import Conflict, NodeBanned
from swarmrl.identity import KeyPair
from swarmrl.ledger.export import read_entries
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state import db
from swarmrl.protocol.pool import Heartbeat, PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "residual"

# arm name → (floor p, release_after_checks k, release_replay_fraction q,
# release_young_checks n, twin_fraction t); the replay arms' floors keep p + (1 − p) q = 0.5,
# the baseline's replays per unit at its floor; the twin arms spend workers' compute instead
ARMS: dict[str, tuple[float, int, float, int, float]] = {
    "base": (0.5, 1, 0.0, 0, 0.0),
    "k2": (0.5, 2, 0.0, 0, 0.0),
    "k4": (0.5, 4, 0.0, 0, 0.0),
    "k8": (0.5, 8, 0.0, 0, 0.0),
    "k16": (0.5, 16, 0.0, 0, 0.0),
    "q0.25": (1 / 3, 1, 0.25, 0, 0.0),
    "q0.25k4": (1 / 3, 4, 0.25, 0, 0.0),
    "n16": (0.5, 1, 0.0, 16, 0.0),
    "n32": (0.5, 1, 0.0, 32, 0.0),
    "t0.5": (0.5, 2, 0.0, 0, 0.5),
    "t0.8": (0.5, 2, 0.0, 0, 0.8),
    "t1": (0.5, 2, 0.0, 0, 1.0),
    "t1k1": (0.5, 1, 0.0, 0, 1.0),
    "t1k1p0.4": (0.4, 1, 0.0, 0, 1.0),
    "t1k1p0.3": (0.3, 1, 0.0, 0, 1.0),
    "t1p0.4": (0.4, 2, 0.0, 0, 1.0),
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
    twin_answers: int = 0  # of its units, twins of another node's unit (twin arms)


@dataclass
class Party:
    """The accomplice under ``--sybil``: the copies it submitted (its answers to twins of its
    partners' falsified units) and its identities banned (each replaced by a new one)."""

    copies: list[str] = field(default_factory=list)
    banned: int = 0


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


def _falsify(samples: list) -> list:
    """The cheat every strategy plays: one output token changed."""
    samples[0].output_tokens[0] = (samples[0].output_tokens[0] + 1) % 1000
    return samples


def _peer_answers(peer: PoolClient, copies: set[tuple] | None = None) -> str | None:
    """The peer of a twin arm takes one unit (a twin first, when one waits) and answers it:
    honestly, or (``--sybil``) a twin of one of ``copies`` (the units its partner falsified,
    by tasks and seed) with the same falsified output. Returns the submission id of such a
    copy, else None; raises ``NodeBanned`` once the peer is banned."""
    peer.heartbeat(POOL, Heartbeat(status="ok"))
    work = peer.lease(POOL).work
    if work is None:
        return None
    samples = synthetic_samples(work, 0)
    copied = copies is not None and (tuple(work.task_indices), work.seed) in copies
    if copied:
        samples = _falsify(samples)
    receipt = peer.submit(POOL, Submission(lease_id=work.lease_id, samples=samples))
    return receipt.submission_id if copied else None


def run_identity(url: str, owner: KeyPair, validator: KeyPair, strategy: Strategy, args,
                 rng: random.Random, peers: list[PoolClient], party: Party) -> Identity:  # fmt: skip
    node = PoolClient(url, KeyPair.generate())
    node.join(POOL, CPU_NODE)
    checker, trainer = PoolClient(url, validator), PoolClient(url, owner)
    me = Identity()
    falsified: set[str] = set()
    copies: set[tuple] | None = set() if args.sybil else None  # told to a colluding peer
    submitted_at: dict[str, int] = {}
    trained_at: dict[str, int] = {}
    for n in range(strategy.units or args.max_units):
        node.heartbeat(POOL, Heartbeat(status="ok"))
        work = node.lease(POOL).work
        samples = synthetic_samples(work, 0)
        cheat = n >= strategy.warmup and rng.random() < strategy.f
        # a twin (another node's unit again: ``origin_node_id``) is answered honestly: its
        # output is compared with another node's, so falsifying it only gets the node caught
        cheat &= work.origin_node_id == node.keypair.node_id
        if cheat:
            samples = _falsify(samples)
            if copies is not None:
                copies.add((tuple(work.task_indices), work.seed))
        sid = node.submit(POOL, Submission(lease_id=work.lease_id, samples=samples)).submission_id
        me.submitted += 1
        if work.origin_node_id != node.keypair.node_id:  # another node's unit again: a twin
            me.twin_answers += 1  # judged by its match, trained only when nothing matched it
        else:
            submitted_at[sid] = n
        if cheat:
            me.falsified += 1
            falsified.add(sid)
        for i, peer in enumerate(peers):  # the first is the accomplice under --sybil
            try:
                if copy_id := _peer_answers(peer, copies if i == 0 else None):
                    party.copies.append(copy_id)
            except NodeBanned:  # the accomplice's copies were rechecked: the party makes
                party.banned += 1  # another identity (an honest peer is never banned)
                peers[i] = PoolClient(url, KeyPair.generate())
                peers[i].join(POOL, CPU_NODE)
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
        mine = served & (submitted_at.keys() | falsified)
        me.trained += len(mine)
        me.falsified_trained += len(mine & falsified)
        trained_at.update(dict.fromkeys(mine, n))
        if me.banned:
            break
    if not me.banned:
        me.held = len(submitted_at.keys() - trained_at.keys())
    if strategy.units:
        half = [s for s, n in submitted_at.items() if n < strategy.units // 2]
        me.delays = [trained_at[s] - submitted_at[s] if s in trained_at else None for s in half]
    return me


def run_arm(arm: str, seed: int, args) -> tuple[dict[str, list[Identity]], dict[str, int]]:
    """The identities of each strategy, and the arm's totals: units submitted, the
    validator's replays (verdicts), units trained, twins matched (workers' compute that
    trained nothing)."""
    floor, release_after, replay, young, twin = ARMS[arm]
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
        release_replay_fraction=replay, release_young_checks=young, twin_fraction=twin,
    )  # fmt: skip
    config = PoolConfig(join_burst=100_000)  # every identity joins at once, unthrottled
    out: dict[str, list[Identity]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        local_orchestrator(Path(tmp), orch, config) as server,
    ):
        PoolClient(server.url, orch).create_pool(spec)
        peers = []
        if twin > 0 or args.peer:  # nodes beside each identity, to answer twins
            for _ in range(1 + args.more_peers):
                peers.append(PoolClient(server.url, KeyPair.generate()))
                peers[-1].join(POOL, CPU_NODE)
        party = Party()
        for i, strategy in enumerate(strategies):
            count = args.honest if strategy.units else args.identities
            out[strategy.name] = [
                # the same cheating choices for identity j of this strategy in every arm
                run_identity(
                    server.url,
                    owner,
                    validator,
                    strategy,
                    args,
                    random.Random(f"{seed}/{i}/{j}"),
                    peers,
                    party,
                )  # fmt: skip
                for j in range(count)
            ]
        with server.ctx.engine.connect() as conn:
            status = dict(
                conn.execute(
                    sa.select(db.submissions.c.status, sa.func.count()).group_by(
                        db.submissions.c.status
                    )
                ).all()
            )
            kept = conn.execute(
                sa.select(sa.func.count()).where(
                    db.credits.c.submission_id.in_(party.copies), db.credits.c.dropped.is_(False)
                )
            ).scalar_one()
        kinds = Counter(e["kind"] for e in read_entries(server.ctx.engine))
    totals = {
        "units": sum(status.values()),
        "replays": kinds["verdict"],
        "trained": status.get("trained", 0),
        "matched": status.get("matched", 0),
        # --sybil: the accomplice's copies, those whose credit it kept, its identities banned
        "copies": len(party.copies),
        "copies_credited": kept,
        "accomplices_banned": party.banned,
    }
    return out, totals


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


def _ratio(ts: list[dict[str, int]], what: str) -> float:
    """``what`` per trained unit, over the seeds' totals."""
    return sum(t[what] for t in ts) / max(1, sum(t["trained"] for t in ts))


def combine(paths: list[str]) -> None:
    """Pool the runs of several ``--json`` files (or files holding a list of them) per arm and
    strategy, over every seed: falsified units trained per caught identity, the validator's
    replays per trained unit (all nodes, from the arm totals), workers' units per trained unit,
    and for ``honest`` its replays per trained unit and delays."""
    runs: list[dict] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs += data if isinstance(data, list) else [data]
    totals: dict[str, Counter] = {}
    pooled: dict[tuple[str, str], Counter] = {}
    for run in runs:
        for key, t in run["totals"].items():
            totals.setdefault(key.split("/")[0], Counter()).update(t)
        for row in run["rows"]:
            c = pooled.setdefault((row["arm"], row["strategy"]), Counter())
            for ids in row["runs"]:
                for i in ids:
                    c["identities"] += 1
                    c["caught"] += i["banned"]
                    c["falsified_trained_caught"] += i["falsified_trained"] * i["banned"]
                    c["max"] = max(c["max"], i["falsified_trained"])
                    for word in ("replays", "trained", "held"):
                        c[word] += i[word]
                    seen = [d for d in i.get("delays", []) if d is not None]
                    c["delays"] += len(seen)
                    c["delay_sum"] += sum(seen)
                    c["delay_max"] = max([c["delay_max"], *seen])
                    c["never"] += len(i.get("delays", [])) - len(seen)
    print("arm | units / replays / trained / twins matched | replays per trained unit | "
          "worker units per trained unit")  # fmt: skip
    for arm, t in totals.items():
        per = max(1, t["trained"])
        print(f"{arm} | {t['units']} / {t['replays']} / {t['trained']} / {t['matched']} | "
              f"{t['replays'] / per:.3f} | {t['units'] / per:.3f}")  # fmt: skip
    for arm, t in totals.items():
        if t["copies"]:  # --sybil: the accomplice's copies, their credit kept, its bans
            print(f"{arm} | the accomplice's copies {t['copies']}, their credit kept "
                  f"{t['copies_credited']}, its identities banned {t['accomplices_banned']}")  # fmt: skip
    print("arm | strategy | caught | falsified trained per caught identity | max | replays "
          "per trained unit | honest delay mean / max (never) | held at end per identity")  # fmt: skip
    for (arm, name), c in pooled.items():
        honest = name == "honest"
        print(" | ".join((
            arm, name, f"{c['caught']}/{c['identities']}",
            _fmt(c["falsified_trained_caught"] / c["caught"] if c["caught"] else None, ".3f"),
            str(c["max"]), f"{c['replays'] / max(1, c['trained']):.3f}",
            f"{c['delay_sum'] / max(1, c['delays']):.2f} / {c['delay_max']} ({c['never']})"
            if honest else "",
            f"{c['held'] / c['identities']:.1f}" if honest else "",
        )))  # fmt: skip


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
    parser.add_argument("--peer", action="store_true",
                        help="an honest peer beside each identity in every arm (the twin arms "
                        "always have one: it answers the twins)")  # fmt: skip
    parser.add_argument("--more-peers", type=int, default=0,
                        help="honest peers beside the first peer (which asks first): with "
                        "--sybil, the accomplice competes with them for its partner's twins")  # fmt: skip
    parser.add_argument("--sybil", action="store_true",
                        help="the peer colludes: it answers the twin of a unit its partner "
                        "falsified with the same falsified output (a party holding both "
                        "identities, winning every twin of its own units)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="only pool the runs of these --json files over their seeds")  # fmt: skip
    args = parser.parse_args()
    if args.combine:
        combine(args.combine)
        return
    arms = args.arms.split(",")
    runs: dict[tuple[str, int], dict[str, list[Identity]]] = {}
    totals: dict[tuple[str, int], dict[str, int]] = {}
    for seed in args.seeds:  # arms alternate within each seed
        for arm in arms:
            runs[(arm, seed)], totals[(arm, seed)] = run_arm(arm, seed, args)
            t = totals[(arm, seed)]
            print(f"arm {arm} seed {seed} done: {t['units']} units, {t['replays']} replays, "
                  f"{t['trained']} trained, {t['matched']} twins matched; accomplice copies "
                  f"{t['copies']}, credit kept {t['copies_credited']}, its identities banned "
                  f"{t['accomplices_banned']}", file=sys.stderr, flush=True)  # fmt: skip
    print(f"decay {args.decay}; {args.identities} identities per cheating strategy and "
          f"{args.honest} honest ones of {args.honest_units} units per arm; seeds {args.seeds}")  # fmt: skip
    print(
        "arm | units submitted / replays / trained / twins matched (per seed) | validator "
        "replays per trained unit | worker units per trained unit"
    )
    for arm in arms:
        ts = [totals[(arm, seed)] for seed in args.seeds]
        print(f"{arm} | " + " / ".join(f"{t['units']} {t['replays']} {t['trained']} "
                                       f"{t['matched']}" for t in ts)
              + f" | {_ratio(ts, 'replays'):.3f} | {_ratio(ts, 'units'):.3f}")  # fmt: skip
    if args.sybil:
        print(
            "arm | the accomplice's copies / their credit kept / its identities banned (per seed)"
        )
        for arm in arms:
            ts = [totals[(arm, seed)] for seed in args.seeds]
            print(f"{arm} | " + " / ".join(f"{t['copies']} {t['copies_credited']} "
                                           f"{t['accomplices_banned']}" for t in ts))  # fmt: skip
    header = ("arm (p, k, q, n, t)", "strategy", "caught", "falsified trained / caught (per seed)",
              "max", "replays / unit (per seed)", "honest delay mean / p90 / max",
              "held at end")  # fmt: skip
    print(" | ".join(header))
    rows = []
    for arm in arms:
        floor, k, q, young, twin = ARMS[arm]
        for name in runs[(arm, args.seeds[0])]:
            per_seed = [summarise(runs[(arm, seed)][name]) for seed in args.seeds]
            rows.append({"arm": arm, "floor": floor, "release_after_checks": k,
                         "release_replay_fraction": q, "release_young_checks": young,
                         "twin_fraction": twin, "strategy": name, "seeds": args.seeds,
                         "per_seed": per_seed,
                         "runs": [[asdict(i) for i in runs[(arm, seed)][name]]
                                  for seed in args.seeds]})  # fmt: skip
            cells = (
                f"{arm} ({floor:.2f}, {k}, {q}, {young}, {twin})", name,
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
        arm_totals = {f"{arm}/{seed}": t for (arm, seed), t in totals.items()}
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "totals": arm_totals, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
