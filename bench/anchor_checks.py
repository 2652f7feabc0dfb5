"""What two statistical checks of the sampled tokens would add to the verifier: the end token's
probability where a sample stops, and the typicality of the chosen tokens under the replay.

    python bench/anchor_checks.py [--quick] [--no-vllm] [--out bench/anchor-checks.json]

Systems that cannot replay their sampler check a sample's tokens statistically: a sample that
stops where the model gave the end token almost no probability, or whose tokens are far less
likely under the declared model than a sample of it would be (tokens from a flatter
distribution, or from a mix of two models), stands out. The verifier here replays every token
from the seed (its ``sampling`` stage) and already rejects a final end token the replay gives
less than ``eos_min_prob`` (its ``termination`` stage). This bench measures both statistics on
honest work and on every cheat of the catalogue, beside the verifier's own verdicts:

* ``p_end``: the replayed probability of the final end token of a sample claimed "eos";
* ``z``: Σ_t (log p_t(x_t) + H_t) / sqrt(Σ_t V_t) under the replayed sampling distribution p_t
  (H_t its entropy, V_t the variance of log p_t(x) for x ~ p_t). Every term has mean 0 given the
  tokens before it when x_t is drawn from p_t, so an honest sample's z is near 0 with spread
  near 1; a chosen token the distribution excludes gives −inf.

Flagged, with limits fixed before any run: ``z < --z-limit`` (−4) and ``p_end < eos_min_prob``.
Honest work: the trained tiny reverse-task Llama of ``toploc_cases`` decoded by torch (batch 1,
8 and 32, one and two threads, with and without its KV cache) and by vLLM (batch 1, 8 and 32;
``--no-vllm`` leaves it out), replayed by torch. Cheats: ``toploc_cases.cheat_cases`` and
three more: the end token placed where the model did not end (``stopped_early``), a higher
temperature, and tokens chosen from the declared model or its older version by a coin at every
step, proven and reported with the declared model's own hidden states and log-probs (a mix of
two models).

Prints a table; writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarmrl.config.toploc import ToplocConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.sampling import mask_logits
from swarmrl.protocol import SamplingParams
from swarmrl.testing import cheats as attacks
from swarmrl.toploc.calibrate import Measurements, generate_without_cache, measure, recommend
from swarmrl.toploc.verify import Verifier
from toploc_cases import DIGEST, build_models, cheat_cases, generate

BATCHES = (1, 8, 32)


class MixedLogits(torch.nn.Module):
    """The declared model, whose next-token logits are another model's at a share of the steps
    (a coin per row and step): a worker mixing two models, with the declared one's hidden
    states."""

    def __init__(self, declared: torch.nn.Module, other: torch.nn.Module, share: float) -> None:
        super().__init__()
        self.declared, self.other, self.share = declared, other, share
        self.coins = torch.Generator().manual_seed(17)

    def forward(self, **kwargs):  # type: ignore[no-untyped-def]
        out = self.declared(**kwargs)
        alt = self.other(**{**kwargs, "output_hidden_states": False})
        pick = torch.rand(out.logits.shape[0], generator=self.coins) < self.share
        out.logits[:, -1] = torch.where(pick[:, None], alt.logits[:, -1], out.logits[:, -1])
        return out


def mixed(worker, declared, other, prompts, seeds, share: float):
    """Tokens from a coin between two models; proofs and log-probs from the declared one."""
    gens = generate_without_cache(
        MixedLogits(declared, other, share),
        prompts,
        worker.params,
        seeds,
        sorted(worker.engine.eos_ids),
        worker.engine.pad_id,
    )
    for gen in gens:
        replay = worker.engine.prefill(gen.prompt_tokens, gen.output_tokens)
        logprobs = torch.log_softmax(mask_logits(replay.logits, worker.params), dim=-1)
        gen.logprobs = logprobs.gather(1, torch.tensor(gen.output_tokens)[:, None])[:, 0].tolist()
    return worker.prove(gens)


def statistics_of(engine: TorchEngine, params: SamplingParams, claim, ends: set[int]) -> dict:
    """``z`` and ``p_end`` of one claimed sample under ``engine``'s replay."""
    replay = engine.prefill(claim.prompt_tokens, claim.output_tokens)
    logp = torch.log_softmax(mask_logits(replay.logits, params).double(), dim=-1)  # [n, V]
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    entropy = -plogp.sum(-1)
    second = torch.where(p > 0, p * logp * logp, torch.zeros_like(p)).sum(-1)
    variance = (second - entropy * entropy).clamp(min=0)
    chosen = logp.gather(1, torch.tensor(claim.output_tokens)[:, None])[:, 0]
    excess = float((chosen + entropy).sum())
    spread = math.sqrt(float(variance.sum()))
    if math.isinf(excess) or math.isnan(excess):
        z = -math.inf
    elif spread > 0:
        z = excess / spread
    else:
        z = 0.0 if abs(excess) < 1e-9 else -math.inf
    stopped = claim.finish_reason in ("eos", "stop") and claim.output_tokens[-1] in ends
    return {"z": z, "p_end": math.exp(float(chosen[-1])) if stopped else None}


def judge(verifier, worker, subs, honest_keys, args) -> dict:
    """The verifier's verdicts and both statistics of ``subs``. A sample whose tokens are the
    honest ones (same prompt, seed and tokens) has the honest statistics, whatever else it
    changed: those are counted (``same_tokens``), with what rejected them."""
    items = [(b, c, worker.assignment(c.prompt_tokens, b.seed)) for b, c in subs]
    verdicts = verifier.check_many(items)
    ends = set(worker.engine.eos_ids)
    row = {"samples": len(subs), "same_tokens": 0, "rejected": 0, "codes": {}, "z": []}
    row |= {"p_end": [], "z_flagged": 0, "end_flagged": 0, "accepted_but_flagged": 0}
    row |= {"rejected_by_sampling_alone": 0, "of_those_flagged": 0}
    for verdict, (bundle, claim) in zip(verdicts, subs, strict=True):
        key = (tuple(claim.prompt_tokens), bundle.seed, tuple(claim.output_tokens))
        row["same_tokens"] += key in honest_keys
        row["rejected"] += not verdict.accepted
        for code in verdict.codes:
            row["codes"][code] = row["codes"].get(code, 0) + 1
        stats = statistics_of(worker.engine, worker.params, claim, ends)
        z_bad = stats["z"] < args.z_limit
        end_bad = stats["p_end"] is not None and stats["p_end"] < verifier.config.eos_min_prob
        row["z"].append(stats["z"])
        if stats["p_end"] is not None:
            row["p_end"].append(stats["p_end"])
        row["z_flagged"] += z_bad
        row["end_flagged"] += end_bad
        row["accepted_but_flagged"] += verdict.accepted and (z_bad or end_bad)
        if verdict.codes == {"sampling"}:  # what only the seeded replay caught
            row["rejected_by_sampling_alone"] += 1
            row["of_those_flagged"] += z_bad or end_bad
    return row


def honest_torch(engine, model, params, prompt_fn, per_config: int, offset: int):
    """Torch decodes across batch sizes, thread counts and with and without the KV cache."""
    out = []
    for i, (batch, threads, cache) in enumerate(
        (b, t, c) for b in BATCHES for t in (1, 2) for c in (True, False)
    ):
        torch.set_num_threads(threads)
        prompts = prompt_fn(per_config, offset + i)
        seeds = [offset * 100_000 + i * 1_000 + j for j in range(per_config)]
        out += generate(engine, model, prompts, params, seeds, batch, cache)
    torch.set_num_threads(1)
    return out


def honest_vllm(models, params, prompt_fn, per_batch: int, offset: int):
    """vLLM decodes of the declared weights at each batch size (its own process)."""
    from swarmrl.inference.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory() as scratch:
        models.model.save_pretrained(scratch, safe_serialization=True)
        models.tokenizer.save_pretrained(scratch)
        engine = VllmEngine(scratch)
        try:
            out = []
            for i, batch in enumerate(BATCHES):
                prompts = prompt_fn(per_batch, offset + i)
                seeds = [offset * 100_000 + i * 1_000 + j for j in range(per_batch)]
                for start in range(0, per_batch, batch):
                    out += engine.generate(
                        prompts[start : start + batch],
                        params,
                        seeds[start : start + batch],
                        return_hidden=True,
                    )
            return out
        finally:
            engine.close()


def summary(row: dict) -> dict:
    z = sorted(x for x in row.pop("z"))
    ends = sorted(row.pop("p_end"))
    finite = [x for x in z if math.isfinite(x)]
    row["z_min"] = z[0] if z else None
    row["z_median"] = statistics.median(z) if z else None
    row["z_mean_finite"] = statistics.fmean(finite) if finite else None
    row["z_sd_finite"] = statistics.pstdev(finite) if len(finite) > 1 else None
    row["z_minus_inf"] = len(z) - len(finite)
    row["stopped"] = len(ends)
    row["p_end_min"] = ends[0] if ends else None
    row["p_end_median"] = statistics.median(ends) if ends else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sample counts (smoke run)")
    parser.add_argument("--no-vllm", action="store_true", help="torch decodes only")
    parser.add_argument("--z-limit", type=float, default=-4.0, help="z below this is flagged")
    parser.add_argument("--seed", type=int, default=0, help="draws other prompts and seeds")
    parser.add_argument("--out", default="bench/anchor-checks.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    per_config, per_attack = (6, 12) if args.quick else (48, 64)
    models = build_models(started)
    engine = TorchEngine(models.model, models.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    worker = attacks.Worker(engine, KeyPair.from_seed(bytes(32)), params, 7, DIGEST)
    calib = Measurements()
    for gen in (honest_torch(engine, models.model, params, models.prompt_fn, 4, 10),):
        calib.extend(measure(engine, gen, params, ToplocConfig()))
    verifier = Verifier(
        engine,
        ToplocConfig(**recommend(calib, ToplocConfig().topk)),
        eos_token_ids=engine.eos_ids,
        vocab_size=len(models.tokenizer),
        scorer=models.score,
    )
    rows: dict[str, dict] = {}
    honest_sets = {
        "honest, torch": honest_torch(
            engine, models.model, params, models.prompt_fn, per_config, 300 + 1_000 * args.seed
        )
    }
    if not args.no_vllm:
        honest_sets["honest, vLLM (replayed by torch)"] = honest_vllm(
            models, params, models.prompt_fn, per_config * 4, 400 + 1_000 * args.seed
        )
    for name, gens in honest_sets.items():
        rows[name] = summary(judge(verifier, worker, worker.prove(gens), set(), args))
        print(name, rows[name], f"({time.perf_counter() - started:.0f}s)", flush=True)
    prompts = models.prompt_fn(per_attack, 77 + 1_000 * args.seed)
    seeds = [5_000 + 100_000 * args.seed + j for j in range(per_attack)]
    honest_subs = attacks.honest(worker, prompts, seeds)
    honest_keys = {(tuple(c.prompt_tokens), b.seed, tuple(c.output_tokens)) for b, c in honest_subs}
    cases = cheat_cases(models, worker, prompts, seeds, lambda m: TorchEngine(m, models.tokenizer))
    rng = random.Random(5 + args.seed)
    cases["end token where the model did not end"] = lambda: attacks.stopped_early(
        worker, prompts, seeds, rng
    )
    cases["higher temperature (1.5 for 1.0)"] = lambda: attacks.other_sampling(
        worker, prompts, seeds, temperature=1.5
    )
    for share in (0.5, 0.1):
        cases[f"mix with the older version ({share:.0%} of steps)"] = lambda share=share: mixed(
            worker, models.model, models.older, prompts, seeds, share
        )
    for name, build in cases.items():
        rows[name] = summary(judge(verifier, worker, build(), honest_keys, args))
        print(name, rows[name], f"({time.perf_counter() - started:.0f}s)", flush=True)
    result = {
        "z_limit": args.z_limit,
        "eos_min_prob": verifier.config.eos_min_prob,
        "quick": args.quick,
        "seed": args.seed,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print()
    print(
        "| case | samples (tokens as honest) | rejected (by code) | rejected by sampling "
        "alone, of them flagged | z < limit | p_end < eos_min_prob | accepted but flagged "
        "| z min / median |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["codes"].items()))
        print(
            f"| {name} | {r['samples']} ({r['same_tokens']}) | {r['rejected']} ({codes}) "
            f"| {r['rejected_by_sampling_alone']}, {r['of_those_flagged']} | {r['z_flagged']} "
            f"| {r['end_flagged']} of {r['stopped']} | {r['accepted_but_flagged']} "
            f"| {_number(r['z_min'])} / {_number(r['z_median'])} |"
        )


def _number(x: float | None) -> str:
    return "–" if x is None else "−inf" if x == -math.inf else f"{x:.2f}"


if __name__ == "__main__":
    main()
