"""The per-node evidence (a CUSUM per measure, docs/toploc.md) across engines: honest nodes that
must never be flagged, and cheaper engines that must be, within 20 checked units.

    python bench/evidence.py [--dtype bfloat16] [--units 2000] [--unit-samples 1]
        [--cheat-units 40] [--drift K --limit H] [--measure-limit MEASURE=H ...]
        [--calibration 256]
        [--scale S [--reference 64 | --reference-from engines | --reference-from pairings]]
        [--model-shape JSON]
        [--pairings torch->torch vllm->torch vllm->vllm torch->vllm] [--series]
        [--judge-batch 1] [--out FILE]

On the declared model of ``bench/toploc.py`` (``toploc_cases``: a tiny model trained on the
reverse task), in ``--dtype``:

1. **Thresholds** calibrated the way a pool does it across engines (``recommend`` over the
   honest measurements of every pairing together: the "cross" set of ``bench/cross_engine.py``).
   ``--scale S`` measures the evidence in reference units instead (``toploc.evidence_scale``):
   S times the honest means a run-start calibration of ``--reference`` samples records
   (``calibrate_policy`` on the torch engine), or with ``--reference-from engines`` the means
   of the pairing where each is highest in the calibration across the engines above
   (``reference_across``: its own samples, none of the units judged below). With
   ``--reference-from pairings`` the thresholds and the means are those of a pool's own
   calibration across the engines (``calibrate_engines`` on ``--reference`` samples: the run
   start's recipe), and each unit is measured against the means of its pairing (the engine
   its node declares -> the validator's: ``ToplocConfig.evidence_pairing_references``).
2. **Honest nodes**: per pairing (worker engine -> validator engine), ``--units`` units of
   ``--unit-samples`` fresh honest samples each (batch 8), each unit judged and its
   measurements (``swarmrl.toploc.evidence.unit_measures``) added to one node's record at the
   drift k and limit h (toploc's defaults, or ``--drift``/``--limit``). Reported: units rejected, the record's highest S per measure and
   the mean x per measure, and whether the node was ever flagged (the target: never).
3. **Cheaper engines**, each a node of its own claiming the declared model, on the torch
   engine, judged by each validator: int8 weights (``int8_per_channel``), float8 e4m3 weights
   (``fp8_per_channel``) and the older version (step 100 of 150). Reported: the unit at which
   the node is stopped, by a rejected unit or by its record (the target: within 20), and how
   many of its units were accepted before. With ``--reference-from pairings`` each cheat is
   judged once per engine it may declare (every worker engine of ``--pairings``): a cheat
   choosing what to declare picks the pairing whose honest means are loosest. With
   ``--series`` and validators of both engines, each node is also judged by them in turn (unit
   i by validator i mod 2, one record: ``validators_in_turn``), as a pool with a validator of
   each engine keeps it.

A unit of one sample is the hardest case for the honest side (a unit's mean over more samples
varies less). Every number is a count over real generations and replays; nothing is resampled.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cross_engine import generate
from swarmrl.config.model import TinyModelConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.ledger.evidence import Cusum, add_unit
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc import evidence
from swarmrl.toploc.calibrate import Measurements, measure, recommend, reference_across
from swarmrl.toploc.evidence import unit_measures
from swarmrl.toploc.thresholds import CalibrationPlan, calibrate_engines, calibrate_policy
from swarmrl.toploc.verify import Verifier
from toploc_cases import DIGEST, build_models

PAIRINGS = ("torch->torch", "vllm->torch", "vllm->vllm", "torch->vllm")
SHARES = (3, 5, 10)  # validators_in_turn: the declared engine's validator judges 1 unit in these
KEY = KeyPair.from_seed(bytes(32))
BATCH = 8


class Engines:
    """The torch engine and (when a pairing needs it) one vLLM engine, both in ``dtype``."""

    def __init__(self, model, tokenizer, dtype: str, declared: Path, need_vllm: bool) -> None:
        self.torch = TorchEngine(model, tokenizer)
        self.vllm = None
        if need_vllm:
            from swarmrl.inference.vllm_engine import VllmEngine

            self.vllm = VllmEngine(declared, dtype=dtype)

    def get(self, backend: str) -> Any:
        return self.vllm if backend == "vllm" else self.torch

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()


def judged(verifier: Verifier, worker: attacks.Worker, units: list, per_call: int):
    """Each unit's submissions and verdicts, ``per_call`` units replayed together (as a
    validator that claimed that many judges them: one batched prefill)."""
    for first in range(0, len(units), per_call):
        subs = [worker.prove(unit) for unit in units[first : first + per_call]]
        items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for s in subs for b, c in s]
        verdicts = iter(verifier.check_many(items))
        for unit_subs in subs:
            yield unit_subs, [next(verdicts) for _ in unit_subs]


def judge_units(
    verifier: Verifier,
    worker: attacks.Worker,
    gens: list,
    unit_samples: int,
    cfg: ToplocConfig,
    stop_when_caught: bool,
    series: bool = False,
    per_call: int = 1,
    pairing: str | None = None,
) -> dict:
    """Judge ``gens`` unit by unit into one node's record; what happened to the node, with
    every accepted unit's measurements in order where ``series`` (to weigh other rules on the
    same units afterwards; a rejected unit is null). ``pairing``: whose honest means measure
    the units (``unit_measures``)."""
    record: dict[str, Cusum] = {}
    rejected, accepted, caught_at, how = 0, 0, None, ""
    xs: dict[str, list[float]] = {}
    measured: list[dict[str, float] | None] = []
    units = [gens[i : i + unit_samples] for i in range(0, len(gens), unit_samples)]
    for n, (subs, verdicts) in enumerate(judged(verifier, worker, units, per_call), start=1):
        if not all(v.accepted for v in verdicts):
            rejected += 1
            measured.append(None)
            if caught_at is None:
                caught_at = n
                how = "rejected: " + next(
                    r.detail for v in verdicts if not v.accepted for r in v.reasons
                )
            if stop_when_caught:
                break
            continue
        accepted += 1
        measures = unit_measures(verdicts, [c.logprobs for _, c in subs], cfg, pairing)
        measured.append({k: round(v, 5) for k, v in measures.items()})
        for name, x in measures.items():
            xs.setdefault(name, []).append(x)
        flagged = add_unit(
            record, measures, cfg.evidence_drift, cfg.evidence_limit, cfg.evidence_measure_limits
        )
        if flagged and caught_at is None:
            caught_at, how = n, flagged
            if stop_when_caught:
                break
    row = {
        "units": len(units),
        "judged": accepted + rejected,
        "rejected": rejected,
        "accepted": accepted,
        "caught_at": caught_at,
        "how": how,
        "mean_x": {k: sum(v) / len(v) for k, v in xs.items()},
        "max_x": {k: max(v) for k, v in xs.items()},
        "final_s": {k: c.value for k, c in record.items()},
    }
    return {**row, "series": measured} if series else row


def alternating(
    series: list[list[dict[str, float] | None]],
    cfg: ToplocConfig,
    turns: list[int] | None = None,
) -> dict:
    """One node's record when its units are judged by validators in turn (unit i by validator
    ``turns[i mod len(turns)]``, by default i mod n), from each validator's ``series`` of the
    same units: what a pool whose validators run different engines keeps (one record per
    node). A rejected unit (None) stops it."""
    turns = turns or list(range(len(series)))
    record: dict[str, Cusum] = {}
    highest: dict[str, float] = {}
    for n in range(min(len(s) for s in series)):
        measures = series[turns[n % len(turns)]][n]
        if measures is None:
            return {"caught_at": n + 1, "how": "rejected", "highest_s": highest}
        flagged = add_unit(
            record, measures, cfg.evidence_drift, cfg.evidence_limit, cfg.evidence_measure_limits
        )
        for name, cusum in record.items():
            highest[name] = round(max(highest.get(name, 0.0), cusum.value), 3)
        if flagged:
            return {"caught_at": n + 1, "how": flagged, "highest_s": highest}
    return {"caught_at": None, "how": "", "highest_s": highest}


def _brief(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "series"})


def run_start_reference(model, tokenizer, dtype: str, samples: int) -> dict[str, float]:
    """The honest means the run-start calibration records (``calibrate_policy``: the torch
    engine replaying itself across batch sizes, thread counts, with and without the KV cache),
    what a validator measures evidence against at ``toploc.evidence_scale`` > 0."""
    plan = CalibrationPlan(samples=samples, temperature=1.0, max_new_tokens=48)
    document = calibrate_policy(model, tokenizer, plan, dtype=dtype)
    return document["evidence_reference"]


def in_turn(results: dict, workers: list[str], validators: list[str], cfg: ToplocConfig) -> dict:
    """Each honest node and each cheat (by the engine it declares) judged by the validators in
    turn (``alternating``), from the series already recorded; each cheat also where the
    validator of the engine it declares judges only 1 unit in 3, 5 or 10 (``SHARES``: a pool
    with fewer validators of that engine, or slower ones)."""
    rows = {}
    for w in workers:
        series = [results["honest"][f"{w}->{v}"]["series"] for v in validators]
        rows[f"honest {w}"] = alternating(series, cfg)
    names = {key.split(" -> ")[0] for key in results["cheats"]}
    for name in sorted(names):
        for d in workers:
            keys = [f"{name} -> {v}, declared {d}" for v in validators]
            series = [results["cheats"][k]["series"] for k in keys]
            rows[f"{name}, declared {d}"] = alternating(series, cfg)
            own = validators.index(d)
            for every in SHARES:  # the declared engine's validator judges 1 unit in `every`
                turns = [own] + [1 - own] * (every - 1)
                rows[f"{name}, declared {d}, own engine 1 in {every}"] = alternating(
                    series, cfg, turns
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--units", type=int, default=2000, help="honest units per pairing")
    parser.add_argument("--unit-samples", type=int, default=1)
    parser.add_argument("--cheat-units", type=int, default=40)
    parser.add_argument("--calibration", type=int, default=256, help="samples per worker engine")
    parser.add_argument("--pairings", nargs="+", default=list(PAIRINGS), choices=PAIRINGS)
    parser.add_argument("--seed", type=int, default=0, help="offsets the honest and cheat sets")
    parser.add_argument("--drift", type=float, help="the CUSUM's k (default: toploc's)")
    parser.add_argument("--limit", type=float, help="the CUSUM's h (default: toploc's)")
    parser.add_argument(
        "--scale", type=float, default=0.0, help="toploc.evidence_scale (0: threshold units)"
    )
    parser.add_argument(
        "--reference", type=int, default=64, help="samples of the run-start calibration"
    )
    parser.add_argument(
        "--reference-from",
        choices=["run-start", "engines", "pairings"],
        default="run-start",
        help="the honest means of the run-start calibration (torch replaying itself), or of "
        "the pairing where each is highest in the calibration across the engines (its own "
        "samples, not the honest units judged), or each unit's own pairing's in a pool's "
        "calibration across the engines (calibrate_engines, --reference samples; its "
        "thresholds too)",
    )
    parser.add_argument(
        "--model-shape",
        help='the declared model\'s TinyModelConfig as JSON (e.g. \'{"arch": "qwen2", '
        '"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 1024}\'); '
        "default: toploc_cases' model",
    )
    parser.add_argument(
        "--judge-batch",
        type=int,
        default=1,
        help="units a validator replays together (one batched prefill), as one that claims "
        "that many does",
    )
    parser.add_argument(
        "--measure-limit",
        action="append",
        default=[],
        help="MEASURE=H: that measure's own limit (toploc.evidence_measure_limits)",
    )
    parser.add_argument(
        "--token-cap",
        type=float,
        help="the most one token's or chunk's term counts, in units (default: "
        "swarmrl.toploc.evidence.TOKEN_CAP)",
    )
    parser.add_argument(
        "--series",
        action="store_true",
        help="keep every unit's measurements, and judge each cheat's units past its stop",
    )
    parser.add_argument("--out", default="bench/evidence.json")
    args = parser.parse_args()
    if args.token_cap is not None:
        evidence.TOKEN_CAP = args.token_cap
    torch.set_num_threads(1)
    started = time.perf_counter()
    shape = TinyModelConfig(**json.loads(args.model_shape)) if args.model_shape else None
    models = build_models(started, shape)
    dtype = getattr(torch, args.dtype)
    model, older = models.model.to(dtype), models.older.to(dtype)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    pairs = [tuple(p.split("->")) for p in args.pairings]
    workers = sorted({w for w, _ in pairs})
    results: dict[str, Any] = {"args": vars(args), "training": models.training}

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - started, 1)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")

    with tempfile.TemporaryDirectory(prefix="evidence-") as scratch:
        declared = Path(scratch) / "declared"
        model.save_pretrained(declared, safe_serialization=True)
        models.tokenizer.save_pretrained(declared)
        need_vllm = any("vllm" in p for p in pairs)
        pool_calibration = None
        if args.reference_from == "pairings":  # before the bench's engines: its own close
            plan = CalibrationPlan(samples=args.reference, temperature=1.0, max_new_tokens=48)
            backends = sorted({e for p in pairs for e in p})
            pool_calibration = calibrate_engines(
                declared, plan, dtype=args.dtype, backends=backends
            )
            results["calibration_runs"] = pool_calibration["runs"]
            print(f"pool calibration ({time.perf_counter() - started:.0f}s)", flush=True)
        engines = Engines(model, models.tokenizer, args.dtype, declared, need_vllm)
        try:
            cfg = ToplocConfig()
            measured = Measurements()
            by_pairing: dict[str, Measurements] = {}
            for w in workers:
                prompts = models.prompt_fn(args.calibration, 900)
                seeds = list(range(900_000, 900_000 + args.calibration))
                gens = generate(engines.get(w), prompts, params, seeds, BATCH)
                for wv, v in pairs:
                    if wv == w:
                        by_pairing[f"{w}->{v}"] = measure(engines.get(v), gens, params, cfg)
                        measured.extend(by_pairing[f"{w}->{v}"])
            thresholds = recommend(measured, cfg.topk)
            chosen = {"evidence_drift": args.drift, "evidence_limit": args.limit}
            own = (item.partition("=") for item in args.measure_limit)
            limits = {name: float(h) for name, _, h in own}
            per_pairing: dict[str, dict[str, float]] = {}
            if pool_calibration is not None:
                thresholds = pool_calibration["thresholds"]
                reference = pool_calibration["evidence_reference"]
                per_pairing = {
                    name: p["evidence_reference"]
                    for name, p in pool_calibration["pairings"].items()
                }
                results["pairing_references"] = per_pairing
            elif args.reference_from == "engines":  # the calibration's own samples
                reference = reference_across(by_pairing)
            else:
                reference = run_start_reference(model, models.tokenizer, args.dtype, args.reference)
            results["reference"] = reference
            print(f"honest reference: {reference} {per_pairing}", flush=True)
            cfg = ToplocConfig(
                **thresholds,
                **{k: v for k, v in chosen.items() if v is not None},
                evidence_scale=args.scale,
                evidence_reference=reference,
                evidence_pairing_references=per_pairing,
                evidence_measure_limits=limits,
            )
            results["thresholds"] = thresholds
            results["drift_limit"] = [cfg.evidence_drift, cfg.evidence_limit, limits]
            print(f"cross thresholds {thresholds} ({time.perf_counter() - started:.0f}s)")
            verifiers = {
                v: Verifier(
                    engines.get(v),
                    cfg,
                    eos_token_ids=engines.torch.eos_ids,
                    vocab_size=len(models.tokenizer),
                )
                for v in {v for _, v in pairs}
            }
            judge = functools.partial(
                judge_units,
                unit_samples=args.unit_samples,
                cfg=cfg,
                series=args.series,
                per_call=args.judge_batch,
            )
            total = args.units * args.unit_samples
            results["honest"] = {}
            for w in workers:
                prompts = models.prompt_fn(total, args.seed)
                first = args.seed * 10_000_000
                gens = generate(
                    engines.get(w), prompts, params, list(range(first, first + total)), BATCH
                )
                worker = attacks.Worker(engines.get(w), KEY, params, 7, DIGEST)
                for wv, v in pairs:
                    if wv != w:
                        continue
                    row = judge(
                        verifiers[v], worker, gens, stop_when_caught=False, pairing=f"{w}->{v}"
                    )
                    results["honest"][f"{w}->{v}"] = row
                    print(f"honest {w}->{v}: {_brief(row)}", flush=True)
                    save()
            cheaters = {
                "int8 weights": attacks.int8_per_channel(model),
                "fp8 (e4m3) weights": attacks.fp8_per_channel(model),
                "older version (step 100 of 150)": copy.deepcopy(older),
            }
            total = args.cheat_units * args.unit_samples
            prompts = models.prompt_fn(total, 77 + args.seed)
            seeds = list(range(5000 + args.seed * 1_000_000, 5000 + args.seed * 1_000_000 + total))
            worker = attacks.Worker(engines.torch, KEY, params, 7, DIGEST)
            results["cheats"] = {}
            for name, cheat_model in cheaters.items():
                gens = generate(
                    TorchEngine(cheat_model, models.tokenizer), prompts, params, seeds, BATCH
                )
                declares = workers if pool_calibration is not None else [None]
                for v in sorted(verifiers):
                    for d in declares:  # None: no pairing, the reference alone
                        row = judge(
                            verifiers[v],
                            worker,
                            gens,
                            stop_when_caught=not args.series,
                            pairing=None if d is None else f"{d}->{v}",
                        )
                        key = f"{name} -> {v}" + ("" if d is None else f", declared {d}")
                        results["cheats"][key] = row
                        print(f"cheat {key}: {_brief(row)}", flush=True)
                        save()
            every_pairing = len(pairs) == len(workers) * len(verifiers) == 4
            if pool_calibration is not None and args.series and every_pairing:
                results["validators_in_turn"] = in_turn(results, workers, sorted(verifiers), cfg)
                for key, row in results["validators_in_turn"].items():
                    print(f"validators in turn, {key}: {json.dumps(row)}", flush=True)
        finally:
            engines.close()
    save()
    print(f"done in {time.perf_counter() - started:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
