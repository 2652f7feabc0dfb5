"""Honest-distribution measurement and threshold recommendation for the verifier.

Thresholds must fit the model and the hardware: what an honest worker's proofs look like
when replayed depends on dtype, kernels, batch composition and threads. ``measure`` replays
honest generations exactly as the verifier does and records, per chunk and per sample, the
quantities the verifier thresholds; ``recommend`` turns the worst honest values into limits::

    max_mantissa_mean    = worst_mean   * (1 + rel) + abs_ulps
    max_mantissa_median  = worst_median * (1 + rel) + abs_ulps

``abs_ulps`` defaults to 1 ulp: one top-k index that the prover and validator rank
differently (a near-tie at the boundary) evaluates to a random pattern whose exponent still
matches with probability ~1/256, and its mantissa error (up to 127) then adds up to ~1 ulp to
the mean of ~128 entries even when every other entry agrees bit for bit.
    min_exponent_matches = topk - ceil(worst_mismatches * (1 + rel)) - 2
    sampling_tolerance   = max(worst_margin * (1 + rel), 1e-4)   (score units)
    logprob_tolerance    = max(worst_logprob_err * (1 + rel), 1e-4)   (nats)

``generate_without_cache`` is a plain full-forward decoding loop (no KV cache, transformers'
own forward) so calibration covers a second code path next to the engine's cached one.

Knows nothing about signatures, wire formats or the command line (see ``cli``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swarmrl.config.toploc import ToplocConfig
from swarmrl.inference.sampling import sample_tokens
from swarmrl.inference.types import Generation
from swarmrl.protocol import SamplingParams
from swarmrl.toploc.encoding import build_chunk_proofs, decode_chunks
from swarmrl.toploc.hidden import compare_chunks
from swarmrl.toploc.prefill import Replayer, prefill_many
from swarmrl.toploc.replay import replay_sampling


@torch.no_grad()
def generate_without_cache(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seeds: Sequence[int],
    eos_ids: Sequence[int],
    pad_id: int = 0,
) -> list[Generation]:
    """Sample like the engine, but re-run the whole (left-padded) sequence at every step.

    Same sampling rule and noise as ``TorchEngine.generate``; hidden states are the
    final-norm states the model's own forward returns ([P + n - 1, hidden] per sample).
    """
    batch, width = len(prompts), max(len(p) for p in prompts)
    lens = torch.tensor([len(p) for p in prompts])
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        tokens[b, width - len(prompt) :] = torch.tensor(list(prompt))
    valid = torch.arange(width)[None] >= (width - lens)[:, None]  # [B, width]
    stops = torch.tensor(sorted(set(eos_ids) | set(params.stop_token_ids)))
    seed_t = torch.tensor([int(s) for s in seeds], dtype=torch.long)
    out_tokens, out_lp, states = [], [], []
    n_out = torch.full((batch,), params.max_new_tokens)
    stopped = torch.zeros(batch, dtype=torch.bool)
    prompt_states = None
    for t in range(params.max_new_tokens):
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=tokens,
            attention_mask=valid.long(),
            position_ids=positions,
            use_cache=False,
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1].float()  # [B, width + t, hidden]
        if t == 0:
            prompt_states = hidden
        else:
            states.append(hidden[:, -1])  # [B, hidden]
        tok, lp = sample_tokens(out.logits[:, -1].float(), params, seed_t, t)
        out_tokens.append(tok)
        out_lp.append(lp)
        hit = torch.isin(tok, stops) & ~stopped
        n_out = torch.where(hit, t + 1, n_out)
        stopped |= hit
        if bool(stopped.all()):
            break
        tokens = torch.cat([tokens, tok[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones(batch, 1, dtype=torch.bool)], dim=1)
    assert prompt_states is not None
    toks = torch.stack(out_tokens, 1).tolist()
    lps = torch.stack(out_lp, 1).tolist()
    decoded = torch.stack(states, 1) if states else None  # [B, steps-1, hidden]
    results = []
    for b, prompt in enumerate(prompts):
        n = int(n_out[b])
        parts = [prompt_states[b, width - len(prompt) :]]
        if n > 1 and decoded is not None:
            parts.append(decoded[b, : n - 1])
        results.append(
            Generation(
                prompt_tokens=list(prompt),
                output_tokens=toks[b][:n],
                logprobs=lps[b][:n],
                finish_reason="eos" if bool(stopped[b]) else "length",
                seed=int(seeds[b]),
                hidden_states=torch.cat(parts),
            )
        )
    return results


@dataclass
class Measurements:
    """Honest replay statistics, per chunk (the exponent and mantissa ones) and per sample (the
    sampling and log-prob ones)."""

    exp_mismatches: list[int] = field(default_factory=list)
    mant_err_mean: list[float] = field(default_factory=list)
    mant_err_median: list[float] = field(default_factory=list)
    sampling_margin: list[float] = field(default_factory=list)
    logprob_error: list[float] = field(default_factory=list)
    logprob_mean_error: list[float] = field(default_factory=list)  # per sample, over tokens
    exp_mismatch_share: list[float] = field(default_factory=list)  # per chunk, of k compared

    def extend(self, other: Measurements) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))

    def summary(self) -> dict[str, dict[str, float]]:
        """max, p99, mean of every quantity (what the calibration file records)."""
        out = {}
        for name in self.__dataclass_fields__:
            values = np.asarray(getattr(self, name), dtype=np.float64)
            if values.size == 0:
                continue
            out[name] = {
                "max": float(values.max()),
                "p99": float(np.quantile(values, 0.99)),
                "mean": float(values.mean()),
                "count": int(values.size),
            }
        return out


def measure(
    engine: Replayer, generations: Sequence[Generation], params: SamplingParams, cfg: ToplocConfig
) -> Measurements:
    """Replay honest generations (with hidden states) as the verifier would and record stats."""
    proofs = build_chunk_proofs(
        [g.hidden_states for g in generations],  # type: ignore[misc]
        [len(g.prompt_tokens) for g in generations],
        cfg.chunk_size,
        cfg.topk,
    )
    decoded = [decode_chunks(p, cfg.topk) for p in proofs]
    replays = prefill_many(
        engine, [(g.prompt_tokens, g.output_tokens) for g in generations], cfg.replay_batch_tokens
    )
    failed = [r for r in replays if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"honest replay failed: {failed[0]}")
    agreements = compare_chunks(
        [r.hidden_states for r in replays],  # type: ignore[union-attr]
        [len(g.prompt_tokens) for g in generations],
        [d[0] for d in decoded],
        [d[1] for d in decoded],
        cfg.chunk_size,
        cfg.topk,
    )
    out = Measurements()
    for generation, replay, chunks in zip(generations, replays, agreements, strict=True):
        assert not isinstance(replay, Exception)
        for chunk in chunks:
            out.exp_mismatches.append(chunk.exp_mismatches)
            out.mant_err_mean.append(chunk.mant_err_mean)
            out.mant_err_median.append(chunk.mant_err_median)
            out.exp_mismatch_share.append(chunk.exp_mismatches / max(1, chunk.k))
        sampled = replay_sampling(
            replay.logits, generation.output_tokens, params, generation.seed, math.inf, 0.0
        )
        out.sampling_margin.append(max(sampled.worst_margin, 0.0))
        reported = torch.tensor(generation.logprobs, dtype=torch.float64)
        errors = (reported - sampled.logprobs).abs()
        out.logprob_error.append(float(errors.max()))
        out.logprob_mean_error.append(float(errors.mean()))
    return out


def reference(measured: Measurements) -> dict[str, float]:
    """The honest mean of each evidence measure, in its own units (``swarmrl.toploc.evidence``,
    reference units): a token's |reported - replayed| log-prob (nats), a chunk's mantissa error
    mean (ulps) and a chunk's share of top-k exponents that differ. Means are what a node's
    record is compared with: unlike the worst value the thresholds come from, they hardly move
    with the number of samples measured."""
    out = {}
    for name, values in (
        ("logprobs", measured.logprob_mean_error),
        ("mantissa", measured.mant_err_mean),
        ("exponents", measured.exp_mismatch_share),
    ):
        if values:
            out[name] = float(np.mean(np.asarray(values, dtype=np.float64)))
    return out


def reference_across(pairings: Mapping[str, Measurements]) -> dict[str, float]:
    """The honest mean of each evidence measure in the pairing (worker engine -> validator
    engine) where it is highest: what a pool whose nodes run any of these engines measures
    evidence against, so that no honest pairing sits above one reference unit."""
    out: dict[str, float] = {}
    for measured in pairings.values():
        for name, mean in reference(measured).items():
            out[name] = max(out.get(name, 0.0), mean)
    return out


def recommend(
    measured: Measurements, topk: int, rel: float = 1.0, abs_ulps: float = 1.0
) -> dict[str, float | int]:
    """Thresholds from the worst honest values (formulas in the module docstring)."""
    worst = {k: v["max"] for k, v in measured.summary().items()}
    scale = 1.0 + rel
    return {
        "min_exponent_matches": int(max(0, topk - math.ceil(worst["exp_mismatches"] * scale) - 2)),
        "max_mantissa_mean": round(worst["mant_err_mean"] * scale + abs_ulps, 4),
        "max_mantissa_median": round(worst["mant_err_median"] * scale + abs_ulps, 4),
        "sampling_tolerance": float(f"{max(worst['sampling_margin'] * scale, 1e-4):.3g}"),
        "logprob_tolerance": float(f"{max(worst['logprob_error'] * scale, 1e-4):.3g}"),
    }
