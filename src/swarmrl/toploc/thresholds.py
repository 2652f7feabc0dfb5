"""Verifier thresholds calibrated for one model and dtype, made at run start and recorded.

The default thresholds (``ToplocConfig``) are the reference TOPLOC values for GPU bf16: far too
loose for a model replayed bit for bit (float32 on CPU), so a worker decoding with int8
weights passes them. ``calibrate_policy`` measures how honest generations of *this* model look
when replayed (batch sizes, thread counts, with and without the KV cache) and recommends
limits (formulas in ``calibrate``); ``ensure_thresholds`` does that once per model and dtype,
caches the result by the digest of the model's files, and writes the document where the run
records it (``toploc.thresholds_path``), which is what validators load.

Document (also what ``swarmrl toploc calibrate`` writes)::

    {"model": DIR, "model_digest": HEX, "dtype": "float32", "samples": N,
     "runs": [{"batch": 8, "threads": 1, "cache": true, "samples": 32, "seconds": 0.4,
               "worst": {"mant_err_mean": ..., "logprob_error": ..., ...}}, ...],
     "measured": {"mant_err_mean": {"max": ..., "p99": ..., "mean": ..., "count": ...}, ...},
     "margin": {"rel": 1.0, "abs_ulps": 1.0},
     "thresholds": {"min_exponent_matches": 126, "max_mantissa_mean": 1.0, ...},
     "evidence_reference": {"logprobs": ..., "mantissa": ..., "exponents": ...}}

``load_thresholds`` reads such a document back into a ``ToplocConfig`` (the keys in
``THRESHOLD_KEYS``, and the honest means the per-node evidence can be measured against,
``evidence_reference``: ``calibrate.reference``; a calibration across engines also records each
pairing's, ``"pairings": {"torch->vllm": {"evidence_reference": ..., "worst": ...}, ...}``,
read into ``evidence_pairing_references``). Knows nothing about pools, roles or the command line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config.inference import InferenceConfig
from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import MissingPathError, UserError
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.interface import Engine, open_engine
from swarmrl.inference.types import Generation
from swarmrl.model.io import DType, load_policy, load_tokenizer
from swarmrl.protocol import SamplingParams
from swarmrl.toploc.calibrate import (
    Measurements,
    generate_without_cache,
    measure,
    recommend,
    reference,
    reference_across,
)

FORMAT = 4  # bump when the calibration recipe changes, so cached documents are not reused

THRESHOLD_KEYS = (
    "min_exponent_matches",
    "max_mantissa_mean",
    "max_mantissa_median",
    "sampling_tolerance",
    "top_p_tolerance",
    "logprob_tolerance",
)


def load_thresholds(config: ToplocConfig) -> ToplocConfig:
    """``config`` with the thresholds of ``config.thresholds_path`` (calibrate's JSON) applied."""
    if config.thresholds_path is None:
        return config
    path = Path(config.thresholds_path)
    if not path.is_file():
        raise MissingPathError(f"toploc thresholds file not found: {path}")
    try:
        document = json.loads(path.read_text())
        values = document["thresholds"]
        update = {k: values[k] for k in THRESHOLD_KEYS if k in values}
        if "evidence_reference" in document:
            update["evidence_reference"] = document["evidence_reference"]
        pairings = document.get("pairings", {})
        update["evidence_pairing_references"] = {
            name: pairing["evidence_reference"] for name, pairing in pairings.items()
        }
        return ToplocConfig.model_validate({**config.model_dump(), **update})
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a toploc thresholds file ({exc})") from exc


def measured_engines(path: str | Path) -> list[str] | None:
    """The engines a thresholds document was calibrated on (a document written before it
    recorded them was calibrated on torch alone); None while ``path`` does not exist yet."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        engines = json.loads(path.read_text()).get("engines", ["torch"])
    except (ValueError, AttributeError) as exc:
        raise UserError(f"{path} is not a toploc thresholds file ({exc})") from exc
    if not isinstance(engines, list) or not all(isinstance(e, str) for e in engines):
        raise UserError(f"{path} is not a toploc thresholds file (engines: {engines!r})")
    return engines


@dataclass(frozen=True)
class CalibrationPlan:
    """What honest generations to measure, and the safety margin on the worst of them."""

    samples: int = 64  # honest samples per worker engine, spread over the runs below
    max_new_tokens: int = 48  # > one 32-token chunk, so decode chunks are measured too
    temperature: float = 1.0  # the run's sampling (log-prob and near-tie slack depend on it)
    top_p: float = 1.0
    top_k: int = 0
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    threads: tuple[int, ...] = (1, 2)
    nocache: bool = True  # also measure the plain full-forward decoding path
    margin_rel: float = 1.0
    margin_ulps: float = 1.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # recorded as is (e.g. who asked)

    def key(self) -> dict[str, Any]:
        """The settings that shape the result (the cache key)."""
        return {k: v for k, v in self.__dict__.items() if k != "extra"}

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        )


WORST_KEYS = (
    "exp_mismatches",
    "mant_err_mean",
    "mant_err_median",
    "sampling_margin",
    "logprob_error",
)


def worst(measured: Measurements) -> dict[str, float]:
    """The worst honest value of each quantity the thresholds come from, for one run or
    pairing: where a loose threshold comes from (e.g. the no-cache path in bfloat16)."""
    return {k: v["max"] for k, v in measured.summary().items() if k in WORST_KEYS}


def seeded_chunks(
    plan: CalibrationPlan, run_index: int, prompts: list[list[int]], batch: int
) -> Iterator[tuple[list[list[int]], list[int]]]:
    """``prompts`` in chunks of ``batch``, each with its samples' seeds (reproducible from the
    plan's seed and the run)."""
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        first = plan.seed * 1_000_003 + run_index * 100_000 + start
        yield chunk, [first + i for i in range(len(chunk))]


def random_prompts(vocab: int, special: set[int], count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 4..24 ordinary token ids, reproducible from ``seed``."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab) if t not in special]
    if not ordinary:
        raise UserError("the tokenizer has no ordinary (non-special) tokens")
    return [[rng.choice(ordinary) for _ in range(rng.randint(4, 24))] for _ in range(count)]


def _worker_runs(worker: str, plan: CalibrationPlan) -> list[tuple[int, int | None, bool]]:
    """The (batch, threads, KV cache) runs whose generations of ``worker`` are measured: the
    torch engine across thread counts, with and without its KV cache; another engine at each
    batch size (threads None: the engine's own)."""
    if worker != "torch":
        return [(batch, None, True) for batch in plan.batch_sizes]
    cache_modes = [True, False] if plan.nocache else [True]
    return list(itertools.product(plan.batch_sizes, plan.threads, cache_modes))


def _honest_generations(
    engine: Engine, chunk: list[list[int]], params: SamplingParams, seeds: list[int], cache: bool
) -> list[Generation]:
    """``chunk`` generated as an honest worker would: with the engine's KV cache, or (the
    torch engine alone, :func:`_worker_runs`) with the plain full-forward loop."""
    if cache:
        return engine.generate(chunk, params, seeds, return_hidden=True)
    model = cast(TorchEngine, engine).model
    return generate_without_cache(
        model, chunk, params, seeds, sorted(engine.eos_ids), engine.pad_id
    )


def calibrate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    plan: CalibrationPlan,
    *,
    dtype: str,
    topk: int = 128,
) -> dict[str, Any]:
    """Generate honest samples, replay them as a validator would, recommend thresholds."""
    if plan.samples < 1:
        raise UserError("calibration needs at least 1 sample")
    engine = TorchEngine(model, tokenizer)
    cfg = ToplocConfig(topk=topk)
    params = plan.sampling()
    special = set(tokenizer.all_special_ids)
    runs = _worker_runs("torch", plan)
    per_run = max(1, plan.samples // len(runs))
    measured, log = Measurements(), []
    previous_threads = torch.get_num_threads()
    try:
        for run_index, (batch, threads, cache) in enumerate(runs):
            torch.set_num_threads(threads)
            prompts = random_prompts(len(tokenizer), special, per_run, plan.seed + run_index)
            started = time.perf_counter()
            this_run = Measurements()
            for chunk, seeds in seeded_chunks(plan, run_index, prompts, batch):
                gens = _honest_generations(engine, chunk, params, seeds, cache)
                this_run.extend(measure(engine, gens, params, cfg))
            measured.extend(this_run)
            log.append(
                {
                    "batch": batch,
                    "threads": threads,
                    "cache": cache,
                    "samples": per_run,
                    "seconds": round(time.perf_counter() - started, 2),
                    "worst": worst(this_run),
                }
            )
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "dtype": dtype,
        "engines": ["torch"],
        "samples": per_run * len(runs),
        "runs": log,
        "measured": measured.summary(),
        "margin": {"rel": plan.margin_rel, "abs_ulps": plan.margin_ulps},
        "thresholds": recommend(measured, topk, plan.margin_rel, plan.margin_ulps),
        "evidence_reference": reference(measured),
        **plan.extra,
    }


def calibrate_engines(
    model_dir: str | Path,
    plan: CalibrationPlan,
    *,
    dtype: str,
    backends: Sequence[str],
    inference: InferenceConfig | None = None,
    topk: int = 128,
) -> dict[str, Any]:
    """Calibrate across engines: ``plan.samples`` honest samples generated on each engine of
    ``backends`` (at each of ``plan.batch_sizes``; the torch engine also at each of
    ``plan.threads``, with and without the KV cache, as :func:`calibrate_policy` does) are
    replayed on every one of them, so every pairing (worker engine -> validator engine) is
    measured. Thresholds come from all
    pairings together, and the evidence reference is each measure's honest mean in the pairing
    where it is highest (``calibrate.reference_across``): a pool whose workers and validators
    run any of these engines. Each pairing's own means are recorded under ``pairings``, which a
    validator that knows the worker's declared engine judges by
    (``ToplocConfig.evidence_pairing_references``)."""
    if plan.samples < 1:
        raise UserError("calibration needs at least 1 sample")
    if len(set(backends)) != len(backends) or not backends:
        raise UserError(f"name each engine once, not {list(backends)}")
    base = inference or InferenceConfig()
    tokenizer = load_tokenizer(model_dir)
    special = set(tokenizer.all_special_ids)
    cfg = ToplocConfig(topk=topk)
    params = plan.sampling()
    # each worker engine generates plan.samples, over its runs: the thresholds of a pairing
    # come from the worst of its samples, and fewer per engine make them tighter than honest
    # work across engines needs (bench/evidence.py --reference-from pairings)
    runs: list[tuple[str, int, int, int | None, bool]] = []
    for worker in backends:
        own = _worker_runs(worker, plan)
        runs += [(worker, max(1, plan.samples // len(own)), *run) for run in own]
    engines: dict[str, Engine] = {}
    by_pairing: dict[str, Measurements] = {}
    log = []
    previous_threads = torch.get_num_threads()
    try:
        for backend in backends:
            config = base.model_copy(update={"backend": backend})
            engines[backend] = open_engine(model_dir, config, dtype=dtype)
        for run_index, (worker, per_run, batch, threads, cache) in enumerate(runs):
            if threads is not None:
                torch.set_num_threads(threads)
            prompts = random_prompts(len(tokenizer), special, per_run, plan.seed + run_index)
            started = time.perf_counter()
            for chunk, seeds in seeded_chunks(plan, run_index, prompts, batch):
                gens = _honest_generations(engines[worker], chunk, params, seeds, cache)
                for validator in backends:
                    pairing = by_pairing.setdefault(f"{worker}->{validator}", Measurements())
                    pairing.extend(measure(engines[validator], gens, params, cfg))
            log.append(
                {
                    "engine": worker,
                    "batch": batch,
                    **({"threads": threads, "cache": cache} if threads is not None else {}),
                    "samples": per_run,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
    finally:
        torch.set_num_threads(previous_threads)
        for engine in engines.values():
            engine.close()
    everything = Measurements()
    for measured in by_pairing.values():
        everything.extend(measured)
    return {
        "dtype": dtype,
        "engines": list(backends),
        "samples": sum(run["samples"] for run in log),
        "runs": log,
        "measured": everything.summary(),
        "pairings": {
            name: {"evidence_reference": reference(m), "worst": worst(m)}
            for name, m in by_pairing.items()
        },
        "margin": {"rel": plan.margin_rel, "abs_ulps": plan.margin_ulps},
        "thresholds": recommend(everything, topk, plan.margin_rel, plan.margin_ulps),
        "evidence_reference": reference_across(by_pairing),
        **plan.extra,
    }


def model_digest(model_dir: Path) -> str:
    """SHA-256 over the relative paths and bytes of every file of a model directory."""
    hasher = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        hasher.update(path.relative_to(model_dir).as_posix().encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                hasher.update(block)
    return hasher.hexdigest()


def write_document(document: dict[str, Any], out: Path) -> None:
    """Write ``document`` as JSON via a synced temporary file and a rename (never half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as handle:
            handle.write(json.dumps(document, indent=2) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def calibrate_model(
    model_dir: str | Path,
    plan: CalibrationPlan,
    *,
    dtype: DType,
    engines: Sequence[str] = ("torch",),
    inference: InferenceConfig | None = None,
    topk: int = 128,
) -> dict[str, Any]:
    """The calibration document of the model at ``model_dir``: on the torch engine alone
    (:func:`calibrate_policy`), or across ``engines`` in every pairing (:func:`calibrate_engines`,
    which opens, or refuses, each engine before any work)."""
    if list(engines) == ["torch"]:
        model, tokenizer = load_policy(model_dir, dtype=dtype)
        document = calibrate_policy(model, tokenizer, plan, dtype=dtype, topk=topk)
    else:
        document = calibrate_engines(
            model_dir, plan, dtype=dtype, backends=engines, inference=inference, topk=topk
        )
    return {"model": str(model_dir), **document}


def ensure_thresholds(
    model_dir: str | Path,
    dtype: DType,
    out: str | Path,
    *,
    plan: CalibrationPlan | None = None,
    cache_dir: str | Path | None = None,
    topk: int = 128,
    engines: Sequence[str] = ("torch",),
    inference: InferenceConfig | None = None,
) -> dict[str, Any]:
    """Calibrate ``model_dir`` in ``dtype`` on ``engines`` (:func:`calibrate_model`), or reuse the
    cached result, and record it at ``out``.

    The cache entry (``cache_dir/toploc/<digest>.json``) is keyed by the model's file digest,
    the dtype, ``topk``, the engines and the plan, so a warm-started run pays for calibration
    once.
    """
    plan = plan or CalibrationPlan()
    engines = list(engines)
    model_dir = Path(model_dir)
    digest = model_digest(model_dir)
    key = json.dumps(
        {
            "format": FORMAT,
            "model": digest,
            "dtype": dtype,
            "topk": topk,
            "engines": engines,
            **plan.key(),
        },
        sort_keys=True,
    )
    cached = None
    if cache_dir is not None:
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        cached = Path(cache_dir).expanduser() / "toploc" / f"{name}.json"
    if cached is not None and cached.is_file():
        document = json.loads(cached.read_text())
    else:
        document = calibrate_model(
            model_dir, plan, dtype=dtype, engines=engines, inference=inference, topk=topk
        )
        document = {"model": document["model"], "model_digest": digest, **document}
        if cached is not None:
            write_document(document, cached)
    write_document(document, Path(out))
    return document
