"""``swarmrl toploc calibrate``: measure honest proof statistics of a model, write thresholds.

    swarmrl toploc calibrate --model DIR [--dtype float32] [--samples 256] [--out FILE]

Generates honest samples from random prompts across batch sizes, thread counts and with and
without the KV cache, replays each as a validator would, and writes a JSON file::

    {"model": ..., "dtype": ..., "samples": N, "runs": [{"batch": 8, "threads": 1,
     "cache": true, "samples": 32}, ...], "measured": {"mant_err_mean": {"max": ..., "p99":
     ..., "mean": ..., "count": ...}, ...}, "margin": {"rel": 1.0, "abs_ulps": 1.0},
     "thresholds": {"min_exponent_matches": ..., "max_mantissa_mean": ..., ...}}

Set ``toploc.thresholds_path`` to that file and the verifier uses its thresholds.
Knows nothing about pools or workers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import UserError
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.types import SamplingParams
from swarmrl.model.io import load_policy
from swarmrl.toploc.calibrate import Measurements, generate_without_cache, measure, recommend


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("want positive integers")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl toploc", description="verifiable inference")
    sub = parser.add_subparsers(dest="action", required=True)
    cal = sub.add_parser("calibrate", help="measure honest statistics, recommend thresholds")
    cal.add_argument("--model", required=True, help="HF model directory or hub id")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cal.add_argument("--samples", type=int, default=256, help="honest samples in total")
    cal.add_argument("--max-new-tokens", type=int, default=48)
    cal.add_argument("--temperature", type=float, default=1.0)
    cal.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    cal.add_argument("--threads", type=_ints, default=[1, 2])
    cal.add_argument("--no-nocache", action="store_true", help="skip the no-KV-cache runs")
    cal.add_argument("--margin-rel", type=float, default=1.0, help="relative safety margin")
    cal.add_argument("--margin-ulps", type=float, default=1.0, help="absolute margin, ulps")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--out", default="toploc-thresholds.json", help="JSON file to write")
    return parser


def random_prompts(vocab: int, special: set[int], count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 4..24 ordinary token ids, reproducible from ``seed``."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab) if t not in special]
    if not ordinary:
        raise UserError("the tokenizer has no ordinary (non-special) tokens")
    return [[rng.choice(ordinary) for _ in range(rng.randint(4, 24))] for _ in range(count)]


def calibrate(args: argparse.Namespace) -> dict:
    """Run the honest generations, measure and recommend; returns the JSON document."""
    model, tokenizer = load_policy(args.model, dtype=args.dtype)
    engine = TorchEngine(model, tokenizer)
    cfg = ToplocConfig()
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    special = set(tokenizer.all_special_ids)
    cache_modes = [True] if args.no_nocache else [True, False]
    runs = list(itertools.product(args.batch_sizes, args.threads, cache_modes))
    per_run = max(1, args.samples // len(runs))
    measured, log = Measurements(), []
    previous_threads = torch.get_num_threads()
    try:
        for run_index, (batch, threads, cache) in enumerate(runs):
            torch.set_num_threads(threads)
            prompts = random_prompts(len(tokenizer), special, per_run, args.seed + run_index)
            started = time.perf_counter()
            for start in range(0, per_run, batch):
                chunk = prompts[start : start + batch]
                base = args.seed * 1_000_003 + run_index * 100_000 + start
                seeds = [base + i for i in range(len(chunk))]
                if cache:
                    gens = engine.generate(chunk, params, seeds, return_hidden=True)
                else:
                    gens = generate_without_cache(
                        model, chunk, params, seeds, sorted(engine.eos_ids), engine.pad_id
                    )
                measured.extend(measure(engine, gens, params, cfg))
            log.append(
                {
                    "batch": batch,
                    "threads": threads,
                    "cache": cache,
                    "samples": per_run,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "samples": per_run * len(runs),
        "runs": log,
        "measured": measured.summary(),
        "margin": {"rel": args.margin_rel, "abs_ulps": args.margin_ulps},
        "thresholds": recommend(measured, cfg.topk, args.margin_rel, args.margin_ulps),
    }


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
    return 0
