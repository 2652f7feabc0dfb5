"""``swarmrl toploc calibrate``: measure honest proof statistics of a model, write thresholds.

    swarmrl toploc calibrate --model DIR [--dtype float32] [--samples 256] [--out FILE]
        [--engines torch,vllm]

Generates honest samples from random prompts across batch sizes, thread counts and with and
without the KV cache, replays each as a validator would, and writes a JSON file::

    {"model": ..., "dtype": ..., "samples": N, "runs": [{"batch": 8, "threads": 1,
     "cache": true, "samples": 32}, ...], "measured": {"mant_err_mean": {"max": ..., "p99":
     ..., "mean": ..., "count": ...}, ...}, "margin": {"rel": 1.0, "abs_ulps": 1.0},
     "thresholds": {"min_exponent_matches": ..., "max_mantissa_mean": ..., ...}}

With ``--engines torch,vllm`` the samples are generated on each engine (across batch sizes;
torch also across thread counts and without its KV cache) and replayed on every one, every
pairing measured (``thresholds.calibrate_engines``): the thresholds and evidence reference of
a pool whose workers and validators run either engine; the document adds ``engines`` and each
pairing's honest means (``pairings``), which validators measure a unit against by the engine
its node declared and their own.

Set ``toploc.thresholds_path`` to that file and the verifier uses its thresholds.
Knows nothing about pools or workers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from swarmrl.config.inference import InferenceConfig
from swarmrl.config.toploc import engines_advice
from swarmrl.errors import UserError

BACKENDS: tuple[str, ...] = get_args(InferenceConfig.model_fields["backend"].annotation)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("want positive integers")
    return values


def _engines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"want engines from {', '.join(BACKENDS)}, each once, comma-separated; got {text!r}"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl toploc", description="verifiable inference")
    sub = parser.add_subparsers(dest="action", required=True)
    cal = sub.add_parser("calibrate", help="measure honest statistics, recommend thresholds")
    cal.add_argument("--model", required=True, help="HF model directory or hub id")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cal.add_argument("--samples", type=int, default=256, help="honest samples per engine")
    cal.add_argument("--max-new-tokens", type=int, default=48)
    cal.add_argument("--temperature", type=float, default=1.0)
    cal.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    cal.add_argument("--threads", type=_ints, default=[1, 2])
    cal.add_argument("--no-nocache", action="store_true", help="skip the no-KV-cache runs")
    cal.add_argument("--margin-rel", type=float, default=1.0, help="relative safety margin")
    cal.add_argument("--margin-ulps", type=float, default=1.0, help="absolute margin, ulps")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument(
        "--engines",
        type=_engines,
        default=["torch"],
        help="comma-separated engines the pool's workers and validators run (torch, vllm); "
        "more than one: every pairing is measured",
    )
    cal.add_argument("--out", default="toploc-thresholds.json", help="JSON file to write")
    return parser


def calibrate(args: argparse.Namespace) -> dict:
    """Run the honest generations, measure and recommend; returns the JSON document."""
    # torch and transformers only now, after parsing: ``--help`` answers at once
    from swarmrl.toploc.thresholds import CalibrationPlan, calibrate_model

    plan = CalibrationPlan(
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_sizes=tuple(args.batch_sizes),
        threads=tuple(args.threads),
        nocache=not args.no_nocache,
        margin_rel=args.margin_rel,
        margin_ulps=args.margin_ulps,
        seed=args.seed,
    )
    return calibrate_model(args.model, plan, dtype=args.dtype, engines=args.engines)


def main(verb: str, argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.samples < 1:
        raise UserError("--samples must be at least 1")
    document = calibrate(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document["thresholds"], indent=2))
    print(f"wrote {out}")
    print(engines_advice(args.engines, str(out.resolve())))
    return 0
