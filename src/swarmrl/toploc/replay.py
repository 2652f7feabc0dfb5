"""Checks beyond hidden states, from the validator's own logits: sampling, termination, log-probs.

A worker could decode with a cheaper model and then prove with one prefill of the real one;
its hidden-state proofs would pass. These checks catch it, because sampling is a pure function
of (logits, seed, step) (``swarmrl.inference.sampling``):

* sampling replay: with s = logits/T (T = 1 when greedy), the validator's top-k/top-p mask
  A (``mask_logits``) and the regenerated Gumbel noise g, token y at step t must satisfy
      s_y + g_y >= max_{v in A} (s_v + g_v) - tol            (greedy: g = 0)
  and y must be allowed up to slack: s_y >= (k-th largest s) - tol for top-k, and the mass of
  tokens strictly more likely than y (after top-k) < top_p + tol_p for top-p. The slack makes
  honest near-ties (tiny numeric differences between machines) pass. Isolated misses: with
  m_t = max_{v in A}(s_v + g_v) - (s_y + g_y), a sample of n tokens passes when
      #{t : m_t > tol} <= max(1, floor(share * n))   and   max_t m_t <= factor * tol
  (share = ``sampling_outlier_share``, factor = ``sampling_outlier_factor``): at a near-tie
  between the seeded choice and the runner-up, the fp32 heavy tail described under log-probs
  below (a few 1e-4 at an isolated input) can flip which of the two an honest decode picks.
  Choosing the runner-up is only possible where m_t <= factor * tol, which happens with
  probability at most e^(factor * tol) - 1 per step whatever the policy (exponential-race form
  of Gumbel-max), and the chosen token's behaviour log-prob is the validator's replay.
* behaviour log-probs: log_softmax over A plus y itself, at y (the engine's rule; adding y
  only matters for a token allowed by slack alone).
* termination: no stop token before the last position; "eos"/"stop" ends on a stop token whose
  replay probability is at least ``eos_min_prob``; "length" has exactly max_new_tokens tokens.
* log-probs: with d_t = |reported_t - replayed_t| (nats), tol = ``logprob_tolerance``, a
  sample of n tokens passes when
      #{t : d_t > tol} <= max(1, floor(share * n))   and   max_t d_t <= factor * tol
  (share = ``logprob_outlier_share``, factor = ``logprob_outlier_factor``). Honest misses are
  isolated tokens where the policy is ill-conditioned in fp32 (decode and prefill then differ by
  a few 1e-4 nats at that one input while every other token agrees to ~1e-6); a cheat that
  decodes with other weights or another dtype moves nearly every token. The ceiling bounds
  what an isolated miss may hide: a declared log-prob that trains unchecked (spot-check
  skipped) moves the importance ratio of at most max(1, share * n) tokens of a sample by a
  factor of at most exp(factor * tol) (1.001 at the calibrated 1e-4), far inside the loss's
  clip range; every other token stays within exp(tol).

Knows nothing about proofs, signatures or rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmrl.inference.sampling import gumbel_noise, mask_logits
from swarmrl.protocol import SamplingParams


@dataclass(frozen=True)
class SamplingReplay:
    """Outcome of the sampling replay of one sample.

    bad_steps: decode steps that reject the sample: a token not allowed, m_t above the
        ceiling (or NaN), or every step with m_t > tolerance when there are more than allowed.
    near_ties: steps with tolerance < m_t <= ceiling that passed as isolated misses.
    logprobs: [n] float64 validator log-probs of the output tokens (the behaviour policy).
    worst_margin: max over steps of (best score - token score), <= 0 means exact winners;
        what ``calibrate`` measures to size ``sampling_tolerance``.
    """

    bad_steps: list[int]
    near_ties: list[int]
    logprobs: torch.Tensor
    worst_margin: float


def replay_sampling(
    logits: torch.Tensor,
    tokens: Sequence[int],
    params: SamplingParams,
    seed: int,
    tolerance: float,
    top_p_tolerance: float,
    outlier_share: float = 0.0,
    outlier_factor: float = 1.0,
) -> SamplingReplay:
    """Check every token against the replayed Gumbel-max rule.  logits: [n, vocab] float32.

    The defaults (share 0, factor 1) admit no isolated miss beyond ``tolerance``.
    """
    return replay_sampling_many(
        [logits],
        [tokens],
        params,
        [seed],
        tolerance,
        top_p_tolerance,
        outlier_share,
        outlier_factor,
    )[0]


def replay_sampling_many(
    logits: Sequence[torch.Tensor],
    tokens: Sequence[Sequence[int]],
    params: SamplingParams,
    seeds: Sequence[int],
    tolerance: float,
    top_p_tolerance: float,
    outlier_share: float = 0.0,
    outlier_factor: float = 1.0,
) -> list[SamplingReplay]:
    """``replay_sampling`` of many samples drawn with the same ``params``, in one pass.

    logits: per sample [n_i, vocab] float32 (one vocabulary); tokens and seeds: per sample.
    Every operation of the rule is row-wise, so the rows of all samples are stacked
    ([sum n_i, vocab], noise keyed by each row's own (seed, step)) and only the isolated-miss
    count is taken per sample: the same outcome as one call per sample, at the cost of one.
    """
    lengths = [len(t) for t in tokens]
    if not lengths:
        return []
    rows = sum(lengths)
    vocab = logits[0].shape[-1]
    stacked = torch.cat([x.float().reshape(-1, vocab) for x in logits])  # [rows, vocab]
    token = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64).view(rows, 1)
    scaled = stacked
    if not params.greedy and params.temperature != 1.0:
        scaled = scaled / params.temperature
    allowed = mask_logits(stacked, params)  # [rows, vocab], -inf outside A
    token_scaled = scaled.gather(1, token)  # [rows, 1]

    member = torch.ones(rows, dtype=torch.bool)
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [rows, 1]
        member &= (token_scaled >= kth - tolerance).view(rows)
        after_k = scaled.masked_fill(scaled < kth, float("-inf"))
    else:
        after_k = scaled
    if params.top_p < 1.0:
        probs = torch.softmax(after_k, dim=-1)  # [rows, vocab]
        mass_before = (probs * (after_k > token_scaled)).sum(dim=-1)  # [rows]
        member &= mass_before < params.top_p + top_p_tolerance

    if params.greedy:
        noise = torch.zeros(rows, vocab)
    else:
        counts = torch.tensor(lengths, dtype=torch.int64)
        row_seeds = torch.tensor([int(s) for s in seeds], dtype=torch.int64)
        steps = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])  # [rows]
        noise = gumbel_noise(row_seeds.repeat_interleave(counts), steps, vocab)  # [rows, vocab]
    best = (allowed + noise).max(dim=-1).values  # [rows]
    mine = (token_scaled + noise.gather(1, token)).view(rows)
    margin = best - mine  # [rows]; > 0: another token scored higher
    with_token = allowed.scatter(1, token, token_scaled)  # A plus y
    logprobs = torch.log_softmax(with_token.double(), dim=-1).gather(1, token).view(rows)

    margins, members = margin.tolist(), member.tolist()
    out: list[SamplingReplay] = []
    start = 0
    for n in lengths:
        out.append(
            _sample_outcome(
                margins[start : start + n],
                members[start : start + n],
                logprobs[start : start + n],
                tolerance,
                outlier_share,
                outlier_factor,
            )
        )
        start += n
    return out


def _sample_outcome(
    margins: list[float],
    members: list[bool],
    logprobs: torch.Tensor,
    tolerance: float,
    outlier_share: float,
    outlier_factor: float,
) -> SamplingReplay:
    """One sample's verdict from its per-step margins m_t and top-k/top-p membership."""
    n = len(margins)
    off = [not (m <= tolerance) for m in margins]  # NaN margins count as off and as over
    over = [not (m <= outlier_factor * tolerance) for m in margins]
    too_many = sum(off) > max(1, math.floor(outlier_share * n))
    bad = [not members[t] or over[t] or (too_many and off[t]) for t in range(n)]
    near = [t for t in range(n) if off[t] and not bad[t]]
    if not n:
        worst = 0.0
    elif any(math.isnan(m) for m in margins):
        worst = math.nan
    else:
        worst = max(margins)
    return SamplingReplay([t for t in range(n) if bad[t]], near, logprobs, worst)


def termination_problems(
    tokens: Sequence[int],
    finish_reason: str,
    replay_logprobs: torch.Tensor,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    eos_min_prob: float,
) -> list[str]:
    """Reasons the sequence's ending is implausible; empty when it is fine."""
    stops = set(eos_token_ids) | set(params.stop_token_ids)
    problems = []
    early = [i for i, t in enumerate(tokens[:-1]) if t in stops]
    if early:
        problems.append(f"stop token inside the output at position {early[0]}")
    last = tokens[-1]
    if finish_reason in ("eos", "stop"):
        if last not in stops:
            problems.append(f"finish_reason {finish_reason!r} but last token {last} is no stop")
        else:
            prob = float(torch.exp(replay_logprobs[-1]))
            if not prob >= eos_min_prob:
                problems.append(f"final stop token has replay probability {prob:.3g}")
    elif finish_reason == "length":
        if len(tokens) != params.max_new_tokens:
            problems.append(
                f"finish_reason 'length' after {len(tokens)} of {params.max_new_tokens} tokens"
            )
        if last in stops:
            problems.append("finish_reason 'length' but the last token is a stop token")
    else:
        problems.append(f"unknown finish_reason {finish_reason!r}")
    return problems


@dataclass(frozen=True)
class LogprobCheck:
    """Outcome of the log-prob comparison of one sample (rule in the module docstring).

    off: steps with d_t > tolerance (isolated honest misses when few and small).
    over_ceiling: steps with d_t > ceiling, or a non-finite d_t.
    allowed: how many steps may be off in a sample of this length.
    worst: max_t d_t in nats (inf when a reported value is not finite; 0 for no tokens).
    """

    off: list[int]
    over_ceiling: list[int]
    allowed: int
    worst: float

    @property
    def passed(self) -> bool:
        return not self.over_ceiling and len(self.off) <= self.allowed

    def problem(self, tolerance: float, ceiling: float) -> str | None:
        """Why the sample fails, in one line; None when it passes."""
        if self.over_ceiling:
            return (
                f"{len(self.over_ceiling)} log-probs more than {ceiling:.3g} nats off the "
                f"replay, first at step {self.over_ceiling[0]} (worst {self.worst:.3g})"
            )
        if len(self.off) > self.allowed:
            return (
                f"{len(self.off)} log-probs more than {tolerance:.3g} nats off the replay "
                f"(at most {self.allowed} isolated ones pass), first at step {self.off[0]}"
            )
        return None


def check_logprobs(
    reported: Sequence[float],
    replayed: torch.Tensor,
    tolerance: float,
    outlier_share: float,
    outlier_factor: float,
) -> LogprobCheck:
    """Compare reported with replayed log-probs ([n] each) by the rule of the module docstring."""
    claimed = torch.tensor(list(reported), dtype=torch.float64)
    gap = (claimed - replayed.double()).abs()  # [n]; NaN where either side is NaN
    finite = torch.isfinite(gap)
    ceiling = outlier_factor * tolerance
    off = ~(gap <= tolerance)  # NaN compares False: counted as off
    over = ~finite | (gap > ceiling)
    n = int(gap.numel())
    worst = float(gap.max()) if n and bool(finite.all()) else (math.inf if n else 0.0)
    return LogprobCheck(
        off=off.nonzero().flatten().tolist(),
        over_ceiling=over.nonzero().flatten().tolist(),
        allowed=max(1, math.floor(outlier_share * n)),
        worst=worst,
    )
