"""Cross-engine verifiable inference: torch and vLLM workers checked by torch and vLLM validators.

    python bench/cross_engine.py [--quick] [--out bench/cross-engine-results.json]

Pairings, worker engine -> validator engine: torch -> torch (the baseline of
``bench/toploc.py``), vllm -> torch, vllm -> vllm, torch -> vllm. The models and the cheats are
those of ``bench/toploc.py`` (``toploc_cases``). One vLLM engine serves every vLLM role: it is
started once; a cheater's weights are loaded into it in place (``VllmEngine.load_state_dict``)
and the declared weights are loaded back before anything honest runs on it.

1. Calibration, on its own honest set: generations of each worker engine at batch 1/8/32
   (trained and random-init model) replayed by each validator engine; per pairing the worst
   honest values and ``recommend``'s thresholds; "cross" = the thresholds over all pairings
   together (what a validator that does not trust the worker's engine claim needs), and
   "torch-only" = those of torch -> torch alone.
2. Honest bar: fresh honest samples of each worker engine (>= 1,000 of the trained model over
   batch 1, 8 and 32, plus random-init ones) checked by both validators with the cross
   thresholds (and counted against the torch-only ones): every one must pass.
3. Cheats: every cheat of ``toploc_cases`` built on each worker engine, checked by each
   validator with the cross and with the torch-only thresholds. A cheat only the torch-only
   thresholds catch is hidden by the cross-engine gap; ``hidden_states_pass`` counts the cheat
   samples whose hidden-state chunks alone would pass (the signal the gap can hide).

Prints one line per figure; writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc.calibrate import Measurements, measure, recommend
from swarmrl.toploc.verify import Verifier
from toploc_cases import DIGEST, build_models, cheat_cases, detection

PAIRINGS = (("torch", "torch"), ("vllm", "torch"), ("vllm", "vllm"), ("torch", "vllm"))
BATCHES = (1, 8, 32)
KEY = KeyPair.from_seed(bytes(32))


class Engines:
    """The torch engines and the one vLLM engine; vLLM holds the weights of ``holding``."""

    def __init__(self, models: SimpleNamespace, scratch: Path) -> None:
        from swarmrl.inference.vllm_engine import VllmEngine

        self.models = models
        declared = scratch / "declared"
        models.model.save_pretrained(declared, safe_serialization=True)
        models.tokenizer.save_pretrained(declared)
        started = time.perf_counter()
        self.vllm = VllmEngine(declared)
        self.vllm_start_s = time.perf_counter() - started
        self.torch = {
            "trained": TorchEngine(models.model, models.tokenizer),
            "random-init": TorchEngine(models.untrained, models.tokenizer),
        }
        self.holding = "trained"

    def hold(self, name: str) -> None:
        """Load the trained or random-init weights into the vLLM engine (if not there)."""
        if self.holding != name:
            model = self.models.model if name == "trained" else self.models.untrained
            self.vllm.load_state_dict(model.state_dict())
            self.holding = name

    def get(self, backend: str, name: str) -> Any:
        """The ``backend`` engine holding model ``name``."""
        if backend == "vllm":
            self.hold(name)
            return self.vllm
        return self.torch[name]

    def cheater(self, backend: str):
        """``engine_for`` of ``cheat_cases``: a vLLM cheater loads its weights into the vLLM
        engine; bf16 models run on the torch engine (the vLLM engine is fp32)."""

        def engine_for(model: torch.nn.Module) -> Any:
            if backend == "torch" or next(model.parameters()).dtype != torch.float32:
                return TorchEngine(model, self.models.tokenizer)
            self.vllm.load_state_dict(model.state_dict())
            self.holding = "cheat"
            return self.vllm

        return engine_for


def generate(engine: Any, prompts, params, seeds, batch: int) -> list:
    """Honest generations with hidden states, ``batch`` prompts per engine call."""
    out = []
    for start in range(0, len(prompts), batch):
        out += engine.generate(
            prompts[start : start + batch], params, seeds[start : start + batch], return_hidden=True
        )
    return out


def honest_sets(engines: Engines, models, params, counts: dict, seed: int) -> dict:
    """{(model name, worker backend, batch): generations} for ``counts[model name][batch]``."""
    sets = {}
    for m, (name, per_batch) in enumerate(counts.items()):
        for b, batch in enumerate(BATCHES):
            count = per_batch[batch]
            prompts = models.prompt_fn(count, seed + 10 * m + b)
            seeds = [seed * 100_000 + m * 10_000 + b * 1000 + j for j in range(count)]
            for backend in ("torch", "vllm"):
                engine = engines.get(backend, name)
                sets[(name, backend, batch)] = generate(engine, prompts, params, seeds, batch)
    return sets


def calibrate(engines: Engines, sets: dict, params, cfg: ToplocConfig) -> dict:
    """Per pairing measurements and thresholds, plus the cross and torch-only sets."""
    measured = {pair: Measurements() for pair in PAIRINGS}
    for (name, worker, _batch), gens in sets.items():
        for pair in PAIRINGS:
            if pair[0] == worker:
                measured[pair].extend(measure(engines.get(pair[1], name), gens, params, cfg))
    everything = Measurements()
    for m in measured.values():
        everything.extend(m)
    return {
        "pairings": {
            f"{w}->{v}": {"measured": m.summary(), "thresholds": recommend(m, cfg.topk)}
            for (w, v), m in measured.items()
        },
        "cross": recommend(everything, cfg.topk),
        "torch-only": recommend(measured[("torch", "torch")], cfg.topk),
    }


def verifiers(engines: Engines, models, name: str, thresholds: dict) -> dict:
    """{(validator backend, threshold set): Verifier} for model ``name``."""
    out = {}
    for backend in ("torch", "vllm"):
        for label in ("cross", "torch-only"):
            out[(backend, label)] = Verifier(
                engines.get(backend, name),
                ToplocConfig(**thresholds[label]),
                eos_token_ids=engines.vllm.eos_ids,
                vocab_size=len(models.tokenizer),
                scorer=models.score if name == "trained" else None,
            )
    return out


def honest_bar(engines: Engines, models, params, sets: dict, thresholds: dict) -> list[dict]:
    """Every fresh honest sample, checked by both validators with both threshold sets."""
    rows = []
    for name in ("trained", "random-init"):
        checks = verifiers(engines, models, name, thresholds)
        for (model_name, worker_backend, batch), gens in sets.items():
            if model_name != name:
                continue
            worker = attacks.Worker(engines.get(worker_backend, name), KEY, params, 7, DIGEST)
            subs = worker.prove(gens)
            items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
            for (validator, label), verifier in checks.items():
                engines.hold(name)
                verdicts = verifier.check_many(items)
                bad = [v for v in verdicts if not v.accepted]
                rows.append(
                    {
                        "model": name,
                        "pairing": f"{worker_backend}->{validator}",
                        "thresholds": label,
                        "batch": batch,
                        "samples": len(verdicts),
                        "rejected": len(bad),
                        "first_reasons": [r.detail for r in bad[0].reasons] if bad else [],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def cheats(engines: Engines, models, params, thresholds: dict, per_attack: int) -> dict:
    """{worker backend: {cheat: {validator/thresholds: detection}}}."""
    prompts = models.prompt_fn(per_attack, 77)
    seeds = list(range(5000, 5000 + per_attack))
    out: dict[str, dict] = {}
    for backend in ("torch", "vllm"):
        worker = attacks.Worker(engines.get(backend, "trained"), KEY, params, 7, DIGEST)
        honest_subs = attacks.honest(worker, prompts, seeds)
        cases = cheat_cases(models, worker, prompts, seeds, engines.cheater(backend))
        out[backend] = {}
        for cheat, build in cases.items():
            engines.hold("trained")
            subs = build()
            engines.hold("trained")  # a vLLM cheater swapped the weights
            checks = verifiers(engines, models, "trained", thresholds)
            out[backend][cheat] = {
                f"{backend}->{validator}/{label}": detection(verifier, worker, subs, honest_subs)
                for (validator, label), verifier in checks.items()
            }
            brief = {k: (v["rejected"], v["samples"]) for k, v in out[backend][cheat].items()}
            print(backend, cheat, brief, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sample counts (smoke run)")
    parser.add_argument("--out", default="bench/cross-engine-results.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    scale = 8 if args.quick else 1
    calib_counts = {
        "trained": {1: 16 // scale or 2, 8: 48 // scale, 32: 64 // scale},
        "random-init": {1: 4 // scale or 1, 8: 8 // scale or 1, 32: 32 // scale},
    }
    bar_counts = {
        "trained": {1: 112 // scale, 8: 448 // scale, 32: 448 // scale},
        "random-init": {1: 8 // scale or 1, 8: 32 // scale, 32: 64 // scale},
    }
    per_attack = 12 if args.quick else 56
    models = build_models(started)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    cfg = ToplocConfig()
    results: dict[str, Any] = {"quick": args.quick, "training": models.training}

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - started, 1)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory(prefix="cross-engine-") as scratch:
        engines = Engines(models, Path(scratch))
        try:
            results["vllm_start_s"] = round(engines.vllm_start_s, 1)
            print(f"vLLM engine started in {engines.vllm_start_s:.0f}s", flush=True)
            calib_sets = honest_sets(engines, models, params, calib_counts, seed=900)
            results["calibration"] = calibrate(engines, calib_sets, params, cfg)
            for label in ("cross", "torch-only"):
                print(label, results["calibration"][label], flush=True)
            save()
            bar_sets = honest_sets(engines, models, params, bar_counts, seed=0)
            thresholds = results["calibration"]
            results["honest"] = honest_bar(engines, models, params, bar_sets, thresholds)
            save()
            results["cheats"] = cheats(engines, models, params, thresholds, per_attack)
            save()
        finally:
            engines.vllm.close()
    print(f"done in {time.perf_counter() - started:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
