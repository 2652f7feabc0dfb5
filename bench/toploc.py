"""Verifiable-inference benchmark: false rejections, detection of known cheats, and costs.

    python bench/toploc.py [--quick] [--skip-costs | --costs-only | --reference-only]
        [--out bench/toploc-results.json]

1. Models: the tiny Llama of ``swarmrl.model.factory`` (hidden 128, 4 layers), briefly trained
   on the reverse task (so its distributions are peaked like a real policy's), its checkpoint
   from earlier in training ("older version"), a smaller "cheap" model trained the same way,
   and the untrained random-init model (long outputs, many decode chunks).
2. Calibration: ``swarmrl.toploc.calibrate`` on a separate honest set -> thresholds.
3. Honest bar: samples generated across batch sizes 1/8/32, 1 and 2 threads, with the
   engine's KV cache and with a plain full-forward loop without cache; every one must pass.
4. Cheats (``swarmrl.testing.cheats``), >= 50 samples each: every one must be rejected.
5. Costs: proof building vs generation time, validation vs generation time, bytes per chunk,
   and build/verify speed of the reference ``toploc`` package on the same activations.

Prints markdown tables; writes all figures as JSON.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc.calibrate import Measurements, measure, recommend
from swarmrl.toploc.encoding import build_chunk_proofs, decode_chunks
from swarmrl.toploc.hidden import compare_chunks
from swarmrl.toploc.verify import Verifier
from toploc_cases import DIGEST, build_models, cheat_cases, detection, generate


def honest_sweep(engine, model, tokenizer, params, per_config, seed, prompt_fn):
    """Generations across batch sizes x threads x cache modes: list of (label, gens)."""
    runs = []
    configs = list(itertools.product([1, 8, 32], [1, 2], [True, False]))
    for i, (batch, threads, cache) in enumerate(configs):
        torch.set_num_threads(threads)
        prompts = prompt_fn(per_config, seed + i)
        seeds = [seed * 10_000 + i * 1000 + j for j in range(per_config)]
        gens = generate(engine, model, prompts, params, seeds, batch, cache)
        runs.append((f"b{batch}/t{threads}/{'cache' if cache else 'nocache'}", gens))
    torch.set_num_threads(1)
    return runs


def verify_gens(verifier: Verifier, worker: attacks.Worker, gens):
    subs = worker.prove(gens)
    items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    return verifier.check_many(items)


def logprob_gaps(gens, verdicts) -> list[list[float]]:
    """Per sample, |declared - replayed| log-prob of every token ([] when nothing replayed)."""
    out = []
    for gen, verdict in zip(gens, verdicts, strict=True):
        replayed = verdict.behaviour_logprobs or []
        if len(replayed) != len(gen.logprobs):
            replayed = []
        out.append([abs(a - b) for a, b in zip(gen.logprobs, replayed, strict=False)])
    return out


def _reference():
    """The reference package; this file's own directory is hidden because it is toploc.py."""
    import importlib
    import sys

    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        return importlib.import_module("toploc")
    finally:
        sys.path[:] = saved


def reference_speed(hidden: int, chunks: int, reps: int = 31) -> dict:
    """Our build/verify vs the reference ``toploc`` on the same bf16 activations.

    One untimed call of each first (first-call set-up), then ``reps`` rounds that time ours and
    the reference back to back; medians and the range of the per-round ratios are reported (a
    single timing of a few milliseconds is mostly noise). Times are this process's CPU time
    (``time.process_time``; torch runs on one thread here), so other programs on the machine
    do not count against either arm."""
    gen = torch.Generator().manual_seed(0)
    acts = [torch.randn(32 * chunks + 7, hidden, generator=gen)]
    result: dict = {"hidden": hidden, "chunks": chunks + 1, "reps": reps}
    try:
        toploc = _reference()
    except ImportError:
        toploc = None
        result["reference"] = "toploc not installed"
    bf16 = acts[0].to(torch.bfloat16)
    ref_acts = [bf16[:7]] + [bf16[7 + i : 8 + i] for i in range(bf16.shape[0] - 7)]

    def ours_build() -> bytes:
        return build_chunk_proofs(acts, [7], 32, 128)[0]

    ours = ours_build()
    moduli, coeffs = decode_chunks(ours, 128)

    def ours_verify() -> None:
        compare_chunks(acts, [7], [moduli], [coeffs], 32, 128)

    arms = {"ours_build": ours_build, "ours_verify": ours_verify}
    if toploc is not None:
        ref = toploc.build_proofs_bytes(ref_acts, 32, 128)
        result["bytes_equal"] = ref == ours
        arms["ref_build"] = lambda: toploc.build_proofs_bytes(ref_acts, 32, 128)
        arms["ref_verify"] = lambda: toploc.verify_proofs_bytes(ref_acts, ref, 32, 128)
    for fn in arms.values():
        fn()  # untimed first call
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, fn in arms.items():
            t = time.process_time()
            fn()
            times[name].append(time.process_time() - t)
    for name, values in times.items():
        result[f"{name}_s"] = statistics.median(values)
    if toploc is not None:
        for what in ("build", "verify"):
            ratios = [
                r / o for r, o in zip(times[f"ref_{what}"], times[f"ours_{what}"], strict=True)
            ]
            result[f"{what}_speedup"] = statistics.median(ratios)
            result[f"{what}_speedup_range"] = [min(ratios), max(ratios)]
    return result


def reference_rows() -> list[dict]:
    """The reference comparison at the tiny model's width and at a 7B-class width."""
    return [reference_speed(128, 64), reference_speed(4096, 16)]


def costs(engine, worker, verifier, prompts, params, batch_sizes):
    """Generation vs proof building vs validation, same samples, one thread."""
    torch.set_num_threads(1)
    rows = []
    for batch in batch_sizes:
        p = prompts[: max(batch, 32)]
        seeds = list(range(len(p)))
        t = time.perf_counter()
        for s in range(0, len(p), batch):
            engine.generate(p[s : s + batch], params, seeds[s : s + batch])
        gen_plain = time.perf_counter() - t
        gens = []
        t = time.perf_counter()
        for s in range(0, len(p), batch):
            gens += engine.generate(
                p[s : s + batch], params, seeds[s : s + batch], return_hidden=True
            )
        gen_hidden = time.perf_counter() - t
        t = time.perf_counter()
        for s in range(0, len(gens), batch):
            worker.prove(gens[s : s + batch])
        prove = time.perf_counter() - t
        subs = worker.prove(gens)
        items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
        t = time.perf_counter()
        verdicts = verifier.check_many(items)
        validate = time.perf_counter() - t
        tokens = sum(len(g.output_tokens) for g in gens)
        rows.append(
            {
                "batch": batch,
                "samples": len(gens),
                "output_tokens": tokens,
                "generate_s": gen_plain,
                "generate_hidden_s": gen_hidden,
                "prove_s": prove,
                "validate_s": validate,
                "accepted": sum(v.accepted for v in verdicts),
                "proof_overhead_pct": 100 * prove / gen_plain,
                "hidden_copy_overhead_pct": 100 * (gen_hidden - gen_plain) / gen_plain,
                "validation_speedup": gen_plain / validate,
                "bytes_per_chunk": len(__import__("base64").b64decode(subs[0][0].chunks[0])),
            }
        )
    return rows


def save(results: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sample counts (smoke run)")
    parser.add_argument("--out", default="bench/toploc-results.json")
    parser.add_argument(
        "--costs-only", action="store_true", help="skip the honest and cheat phases"
    )
    parser.add_argument(
        "--skip-costs", action="store_true", help="run the honest and cheat phases only"
    )
    parser.add_argument(
        "--reference-only",
        action="store_true",
        help="only time proof building and checking against the reference toploc package",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_config = 8 if args.quick else 76
    per_attack = 12 if args.quick else 56
    results: dict = {"quick": args.quick}
    started = time.perf_counter()
    if args.reference_only:
        results["reference"] = reference_rows()
        save(results, args.out)
        print(json.dumps(results["reference"], indent=1))
        return

    models = build_models(started)
    results["training"] = models.training
    model, untrained, tokenizer = models.model, models.untrained, models.tokenizer
    older, cheap, tiny = models.older, models.cheap, models.tiny
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    worker = attacks.Worker(engine, KeyPair.from_seed(bytes(32)), params, 7, DIGEST)
    score, prompt_fn = models.score, models.prompt_fn

    # -- calibration on a separate honest set ------------------------------------------------
    cfg = ToplocConfig()
    calib = Measurements()
    for _, gens in honest_sweep(engine, model, tokenizer, params, 8, 900, prompt_fn):
        calib.extend(measure(engine, gens, params, cfg))
    random_engine = TorchEngine(untrained, tokenizer)
    for _, gens in honest_sweep(random_engine, untrained, tokenizer, params, 2, 950, prompt_fn):
        calib.extend(measure(random_engine, gens, params, cfg))
    thresholds = recommend(calib, cfg.topk)
    results["calibration"] = {"measured": calib.summary(), "thresholds": thresholds}
    print("thresholds", thresholds)
    tuned = ToplocConfig(**thresholds)
    verifier = Verifier(
        engine, tuned, eos_token_ids=engine.eos_ids, vocab_size=len(tokenizer), scorer=score
    )

    random_verifier = Verifier(
        random_engine, tuned, eos_token_ids=engine.eos_ids, vocab_size=len(tokenizer)
    )
    setup = SimpleNamespace(
        engine=engine,
        model=model,
        untrained=untrained,
        tokenizer=tokenizer,
        verifier=verifier,
        random_verifier=random_verifier,
        random_engine=random_engine,
        worker=worker,
        params=params,
        prompt_fn=prompt_fn,
        score=score,
        per_config=per_config,
        per_attack=per_attack,
        started=started,
        older=older,
        cheap=cheap,
        tiny=tiny,
        cfg=cfg,
    )
    if not args.costs_only:
        honest_and_cheats(args, results, setup)
    if not args.skip_costs:
        run_costs(args, results, setup)


def honest_and_cheats(args, results: dict, env: SimpleNamespace) -> None:
    """Phases 3 and 4 (see the module docstring)."""
    engine, model, untrained, tokenizer = (
        env.engine,
        env.model,
        env.untrained,
        env.tokenizer,
    )
    verifier, random_verifier, random_engine = (
        env.verifier,
        env.random_verifier,
        env.random_engine,
    )
    worker, params, prompt_fn, score = env.worker, env.params, env.prompt_fn, env.score
    per_config, per_attack, started = env.per_config, env.per_attack, env.started
    cfg = env.cfg
    # -- honest bar ----------------------------------------------------------------------------
    honest_rows = []
    sweeps = [("trained", engine, model, verifier, per_config)]
    random_worker = attacks.Worker(random_engine, worker.keypair, params, 7, DIGEST)
    sweeps.append(("random-init", random_engine, untrained, random_verifier, per_config // 9))
    for name, eng, mdl, ver, count in sweeps:
        wkr = worker if name == "trained" else random_worker
        for label, gens in honest_sweep(
            eng, mdl, tokenizer, params, count, 0 if name == "trained" else 500, prompt_fn
        ):
            verdicts = verify_gens(ver, wkr, gens)
            bad = [v.reasons for v in verdicts if not v.accepted]
            gaps = logprob_gaps(gens, verdicts)
            tolerance = ver.config.logprob_tolerance
            print(name, label, len(gens), "rejected", len(bad), bad[:1], flush=True)
            honest_rows.append(
                {
                    "model": name,
                    "config": label,
                    "samples": len(gens),
                    "chunks": sum(len(v.chunks) for v in verdicts),
                    "tokens": sum(len(g.output_tokens) for g in gens),
                    "rejected": len(bad),
                    "first_reasons": [r.detail for r in bad[0]] if bad else [],
                    # largest honest |declared - replayed| log-prob, and the samples with a
                    # token beyond logprob_tolerance (isolated misses the rule lets pass)
                    "logprob_err_max": max((max(g) for g in gaps if g), default=None),
                    "samples_with_logprob_miss": sum(
                        any(not x <= tolerance for x in g) for g in gaps
                    ),
                }
            )
    results["honest"] = honest_rows
    save(results, args.out)
    total = sum(r["samples"] for r in honest_rows)
    rejected = sum(r["rejected"] for r in honest_rows)
    print(f"honest: {rejected} rejected of {total} ({time.perf_counter() - started:.0f}s)")

    # -- cheats --------------------------------------------------------------------------------
    torch.set_num_threads(1)
    prompts = prompt_fn(per_attack, 77)
    seeds = list(range(5000, 5000 + per_attack))
    honest_subs = attacks.honest(worker, prompts, seeds)
    cases = cheat_cases(env, worker, prompts, seeds, lambda m: TorchEngine(m, tokenizer))
    attack_rows = {}
    for name, build in cases.items():
        subs = build()
        attack_rows[name] = detection(verifier, worker, subs, honest_subs)
        print(name, attack_rows[name])

    # declared model in bf16; the worker runs the fp32 master weights (vice versa of the above)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    bf16_engine = TorchEngine(bf16_model, tokenizer)
    bf16_calib = Measurements()
    for _, gens in honest_sweep(bf16_engine, bf16_model, tokenizer, params, 8, 700, prompt_fn):
        bf16_calib.extend(measure(bf16_engine, gens, params, cfg))
    bf16_thresholds = recommend(bf16_calib, cfg.topk)
    bf16_verifier = Verifier(
        bf16_engine,
        ToplocConfig(**bf16_thresholds),
        eos_token_ids=engine.eos_ids,
        vocab_size=len(tokenizer),
        scorer=score,
    )
    bf16_worker = attacks.Worker(bf16_engine, worker.keypair, params, 7, DIGEST)
    bf16_honest = attacks.honest(bf16_worker, prompts, seeds)
    attack_rows["fp32 weights claimed as bf16"] = detection(
        bf16_verifier,
        bf16_worker,
        attacks.with_engine(bf16_worker, engine, prompts, seeds),
        bf16_honest,
    )
    bf16_honest_verdicts = bf16_verifier.check_many(
        [(b, c, bf16_worker.assignment(c.prompt_tokens, b.seed)) for b, c in bf16_honest]
    )
    results["bf16_declared"] = {
        "thresholds": bf16_thresholds,
        "measured": bf16_calib.summary(),
        "honest_rejected": sum(not v.accepted for v in bf16_honest_verdicts),
        "honest_samples": len(bf16_honest_verdicts),
    }
    print(
        "fp32 claimed bf16",
        attack_rows["fp32 weights claimed as bf16"],
        results["bf16_declared"]["honest_rejected"],
    )
    results["attacks"] = attack_rows
    save(results, args.out)


def run_costs(args, results: dict, env: SimpleNamespace) -> None:
    """Phase 5 (see the module docstring)."""
    engine, worker, verifier = env.engine, env.worker, env.verifier
    random_engine, random_verifier, params = (
        env.random_engine,
        env.random_verifier,
        env.params,
    )
    prompt_fn, started = env.prompt_fn, env.started
    # -- costs ---------------------------------------------------------------------------------
    long_params = SamplingParams(temperature=1.0, max_new_tokens=64)
    long_worker = attacks.Worker(random_engine, worker.keypair, long_params, 7, DIGEST)
    results["costs_random_init_64"] = costs(
        random_engine, long_worker, random_verifier, prompt_fn(64, 31), long_params, [1, 8, 32]
    )
    results["costs_trained"] = costs(
        engine, worker, verifier, prompt_fn(64, 32), params, [1, 8, 32]
    )
    results["reference"] = reference_rows()
    results["seconds"] = time.perf_counter() - started
    save(results, args.out)
    print(
        json.dumps(
            {k: results[k] for k in ("costs_random_init_64", "costs_trained", "reference")},
            indent=1,
            default=str,
        )
    )
    print(f"done in {results['seconds']:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
