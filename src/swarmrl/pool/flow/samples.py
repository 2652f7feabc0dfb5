"""What a submission's samples must be to be taken in: one answer per leased sample, within the
pool's limits, and (for an episode) fields that agree with each other.

:func:`check_samples` is the pool's whole check of sample contents on arrival (docs/pool.md,
"Submissions, verdicts, batches"); it refuses with :class:`Invalid`, :class:`Conflict` or
:class:`StaleWork` naming the sample and the rule. What a proof proves, and whether an episode's
environment turns are the environment's, are the validator's checks, not this module's.
Knows nothing about the database or HTTP.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from swarmrl.identity.keys import canonical_json
from swarmrl.pool.rejections import Conflict, Invalid, StaleWork
from swarmrl.protocol.pool import PoolSpec, Sample, WorkUnit
from swarmrl.protocol.proofs import proof_from_wire

MAX_TOKEN_ID = 2**31 - 1
MAX_PROMPT_TOKENS = 1 << 17


def check_samples(
    spec: PoolSpec, work: WorkUnit, samples: list[Sample], version: int, max_proof_bytes: int
) -> int:
    """Refuse samples that do not answer ``work`` within limits; returns output tokens."""
    expected = Counter(
        {t: c * work.samples_per_task for t, c in Counter(work.task_indices).items()}
    )
    got = Counter(s.task_index for s in samples)
    if got != expected:
        missing = sorted((expected - got).elements())[:5]
        extra = sorted((got - expected).elements())[:5]
        raise Invalid(
            f"samples do not match the lease: want {work.samples_per_task} per leased task; "
            f"missing {missing}, unexpected {extra}"
        )
    oldest = version - spec.async_level
    tokens = 0
    for i, s in enumerate(samples):
        where = f"sample {i} (task {s.task_index})"
        if len(s.output_tokens) != len(s.logprobs):
            raise Invalid(f"{where}: {len(s.output_tokens)} tokens but {len(s.logprobs)} logprobs")
        if s.episode is not None:
            _check_episode(where, s, spec.sampling.max_new_tokens, max_proof_bytes)
        elif s.turn_proofs is not None:
            raise Invalid(f"{where}: turn_proofs belong to an episode; this sample has none")
        elif len(s.output_tokens) > spec.sampling.max_new_tokens:
            raise Invalid(f"{where}: {len(s.output_tokens)} tokens > max_new_tokens")
        if len(s.prompt_tokens) > MAX_PROMPT_TOKENS:
            raise Invalid(f"{where}: prompt longer than {MAX_PROMPT_TOKENS} tokens")
        if not (_in_range(s.prompt_tokens) and _in_range(s.output_tokens)):
            raise Invalid(f"{where}: token ids must lie in [0, 2^31)")
        if not _finite_non_positive(s.logprobs):
            raise Invalid(f"{where}: logprobs must be finite and ≤ 0")
        if s.policy_version > version:
            raise Conflict(f"{where}: policy version {s.policy_version} > current {version}")
        if s.policy_version < max(oldest, work.min_version):
            why = (
                "the lease's min_version"
                if work.min_version > oldest
                else f"current {version} − async_level {spec.async_level}"
            )
            raise StaleWork(
                f"{where}: policy version {s.policy_version} is stale "
                f"(need ≥ {max(oldest, work.min_version)}: {why})"
            )
        proof_bytes = _proof_bytes(s.proof)
        if proof_bytes > max_proof_bytes:
            raise Invalid(f"{where}: proof of {proof_bytes} bytes > {max_proof_bytes}")
        tokens += len(s.output_tokens)
    return tokens


def _proof_bytes(proof: Any) -> int:
    """A wire proof's size as validators read it (hex counts the bytes it spells)."""
    document = proof_from_wire(proof)
    if document is None:
        return 0
    return len(document if isinstance(document, bytes) else canonical_json(document))


def _check_episode(where: str, s: Sample, max_new_tokens: int, max_proof_bytes: int) -> None:
    """An episode's fields agree with each other (``swarmrl.protocol.pool.Sample``): its
    model turns are the sample's output tokens and log-probs, its first context the prompt,
    one proof per model call; each call within ``max_new_tokens``. Whether its environment
    turns are the environment's is the validator's and the trainer's check."""
    episode = s.episode
    assert episode is not None
    if episode.reward is not None:
        raise Invalid(f"{where}: an episode's reward is the trusted side's; send none")
    if s.proof is not None:
        raise Invalid(f"{where}: an episode's proofs go in turn_proofs, one per model call")
    calls = episode.calls()
    for k, call in enumerate(calls):
        if len(call.output_tokens) > max_new_tokens:
            raise Invalid(
                f"{where}: model turn {k} has {len(call.output_tokens)} tokens > max_new_tokens"
            )
    if [t for c in calls for t in c.output_tokens] != s.output_tokens:
        raise Invalid(f"{where}: output_tokens are not the episode's model turns in order")
    if [x for c in calls for x in c.logprobs] != s.logprobs:
        raise Invalid(f"{where}: logprobs are not the episode's model-turn log-probs in order")
    first = episode.segments[0]
    if first.tokens[: first.turns[0].end] != s.prompt_tokens:
        raise Invalid(f"{where}: prompt_tokens are not the episode's first context")
    if not all(_in_range(seg.tokens) for seg in episode.segments):
        raise Invalid(f"{where}: episode token ids must lie in [0, 2^31)")
    if s.turn_proofs is not None:
        if len(s.turn_proofs) != len(calls):
            raise Invalid(f"{where}: {len(s.turn_proofs)} turn proofs for {len(calls)} model calls")
        for k, proof in enumerate(s.turn_proofs):
            size = _proof_bytes(proof)
            if size > max_proof_bytes:
                raise Invalid(f"{where}: proof of model turn {k}: {size} bytes > {max_proof_bytes}")


def _in_range(tokens: list[int]) -> bool:
    """Every token id lies in [0, MAX_TOKEN_ID] (``min``/``max`` loop in C, not per token)."""
    return not tokens or (min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID)


def _finite_non_positive(logprobs: list[float]) -> bool:
    """Every value is finite and ≤ 0. A sum is NaN or infinite where any value is, so a finite
    sum with a maximum ≤ 0 settles it in C; otherwise (some value is bad, or a sum of huge
    finite values overflowed) each value is looked at."""
    if not logprobs or (math.isfinite(sum(logprobs)) and max(logprobs) <= 0):
        return True
    return all(math.isfinite(x) and x <= 0 for x in logprobs)
