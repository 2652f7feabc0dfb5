"""The validator's entry point: judge a sample's claim and proof bundle against its assignment.

``Verifier.check`` (one sample) and ``Verifier.check_many`` (a batch; hidden-state comparison
runs batched) return a :class:`~swarmrl.protocol.proofs.ProofVerdict` for any input and never
raise on peer data: null, truncated, oversized, mistyped or NaN-laden bundles are rejections
with a reason. Order of work, cheapest first, so junk costs the validator almost nothing:

1. parse and bound the bundle and claim                               -> "malformed"
2. compare with the assignment (prompt, version, model, sampling, seed, key) -> "assignment"
3. lengths, token ids, chunk count and chunk encodings                  -> "structure"
4. binding digest and the worker's signature                            -> "binding"
5. one prefill of prompt + output with the declared model, batched across samples
   (only for samples that passed 1-4)                                      -> "replay"
6. hidden-state chunks and sampling replay (each batched), termination, log-probs (isolated
   small misses pass: the rule and why are in ``toploc.replay``), reward (all reported)

A "replay" rejection means the validator itself failed (not the peer's fault): callers should
not penalise on it. The token count in the verdict is what was replayed, never a claim.

Knows nothing about HTTP, leases or ledgers; the caller maps verdicts onto those.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from swarmrl.config.toploc import ToplocConfig
from swarmrl.errors import BadProof, BadSignature
from swarmrl.identity import canonical_json, verify_signature
from swarmrl.inference.types import Prefill
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.proofs import (
    Assignment,
    ChunkReport,
    ProofBundle,
    ProofVerdict,
    Rejection,
    RejectionCode,
    SampleClaim,
)
from swarmrl.toploc.bundle import binding_digest
from swarmrl.toploc.encoding import chunk_count, decode_chunks
from swarmrl.toploc.evidence import units as evidence_units
from swarmrl.toploc.hidden import ChunkAgreement, compare_chunks
from swarmrl.toploc.prefill import Replayer, prefill_many
from swarmrl.toploc.replay import (
    SamplingReplay,
    check_logprobs,
    replay_sampling_many,
    termination_problems,
)
from swarmrl.toploc.thresholds import load_thresholds

log = logging.getLogger(__name__)

Scorer = Callable[[Sequence[int], Sequence[int]], float]
"""The environment's reward of (prompt tokens, output tokens); trusted code."""

# the largest mantissa error of one entry (7 bits of a bfloat16): what one top-k index ranked
# differently by prover and validator can add to a chunk's sum (``_chunk_passes``)
MAX_MANTISSA_ERROR = 127


@dataclass
class _Case:
    """One sample moving through the stages; ``reasons`` grows as checks fail."""

    bundle: ProofBundle | None = None
    claim: SampleClaim | None = None
    assignment: Assignment | None = None
    moduli: np.ndarray | None = None
    coeffs: np.ndarray | None = None
    prefill: Prefill | None = None
    scorer: Scorer | None = None
    reasons: list[Rejection] = field(default_factory=list)

    def reject(self, code: RejectionCode, detail: str) -> None:
        self.reasons.append(Rejection(code=code, detail=detail[:2000]))


class Verifier:
    """Judges samples by replaying them with ``engine`` (loaded with the declared version).

    eos_token_ids: the model's end-of-sequence ids (stop tokens besides the sampling's own).
    vocab_size: token ids must lie in [0, vocab_size); None skips that check (the replay
        then rejects out-of-range ids as a replay failure).
    scorer: recomputes the reward from the tokens; None skips reward checks.
    """

    def __init__(
        self,
        engine: Replayer,
        config: ToplocConfig | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
        scorer: Scorer | None = None,
    ) -> None:
        self.engine = engine
        self.config = load_thresholds(config or ToplocConfig())
        evidence_units(self.config)  # a scale without the calibration's reference is refused here
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.scorer = scorer

    def check(self, bundle: Any, claim: Any, assignment: Any) -> ProofVerdict:
        """The verdict on one sample; never raises on peer input."""
        return self.check_many([(bundle, claim, assignment)])[0]

    def check_many(
        self,
        items: Sequence[tuple[Any, Any, Any]],
        shared: Sequence[Hashable | None] | None = None,
        scorers: Sequence[Scorer | None] | None = None,
    ) -> list[ProofVerdict]:
        """Verdicts for many samples; the hidden-state comparison runs as one batch.

        ``shared``: one key per item; items with the same key whose sequences extend one
        another (an episode segment's model calls) are replayed by one prefill
        (``swarmrl.toploc.prefill.prefill_many``). ``scorers``: one per item, in place of the
        verifier's own (items of several submissions, each scored by its own tasks).

        Input that slips past every specific check and still breaks a stage becomes a
        "replay" rejection (the validator's own failure, logged with its traceback) rather
        than an exception: one bad sample must not take the validator down.
        """
        try:
            return self._check_many(items, shared, scorers)
        except Exception as exc:  # recovery intended: see docstring
            log.exception("verifier failed on a batch of %d samples", len(items))
            detail = f"validator error: {type(exc).__name__}: {exc}"[:2000]
            return [
                ProofVerdict(accepted=False, reasons=[Rejection(code="replay", detail=detail)])
                for _ in items
            ]

    def _check_many(
        self,
        items: Sequence[tuple[Any, Any, Any]],
        shared: Sequence[Hashable | None] | None,
        scorers: Sequence[Scorer | None] | None,
    ) -> list[ProofVerdict]:
        cases = [self._screen(b, c, a) for b, c, a in items]
        for case, scorer in zip(cases, scorers or [self.scorer] * len(cases), strict=True):
            case.scorer = scorer
        keys = [None] * len(cases) if shared is None else list(shared)
        todo = [c for c in cases if not c.reasons]
        todo_keys = [k for c, k in zip(cases, keys, strict=True) if not c.reasons]
        pairs = [(c.claim.prompt_tokens, c.claim.output_tokens) for c in todo]  # type: ignore[union-attr]
        replays = prefill_many(self.engine, pairs, self.config.replay_batch_tokens, todo_keys)
        for case, replay in zip(todo, replays, strict=True):
            self._take_replay(case, replay)
        live = [c for c in cases if not c.reasons and c.prefill is not None]
        agreements = self._compare(live)
        sampling = self._replay_sampling(live)
        return [
            self._judge(case, agreements.get(id(case)), sampling.get(id(case))) for case in cases
        ]

    # -- stages 1-4: no model work --------------------------------------------------------

    def _screen(self, raw_bundle: Any, raw_claim: Any, raw_assignment: Any) -> _Case:
        case = _Case()
        try:
            case.assignment = _parse(Assignment, raw_assignment, self.config.max_bundle_bytes)
        except BadProof as exc:
            case.reject("malformed", f"assignment: {exc}")
            return case
        try:
            case.claim = _parse(SampleClaim, raw_claim, self.config.max_bundle_bytes)
            case.bundle = _parse(ProofBundle, raw_bundle, self.config.max_bundle_bytes)
        except BadProof as exc:
            case.reject("malformed", str(exc))
            return case
        self._check_assignment(case)
        if not case.reasons:
            self._check_structure(case)
        if not case.reasons:
            self._check_binding(case)
        return case

    def _check_assignment(self, case: _Case) -> None:
        bundle, claim, want = case.bundle, case.claim, case.assignment
        assert bundle is not None and claim is not None and want is not None
        pairs = [
            ("prompt tokens", claim.prompt_tokens, want.prompt_tokens),
            ("policy version", bundle.policy_version, want.policy_version),
            ("model digest", bundle.model_digest, want.model_digest),
            ("sampling parameters", bundle.sampling, want.sampling),
            ("seed", bundle.seed, want.seed),
            ("worker key", bundle.worker_key, want.worker_key),
        ]
        for name, got, expected in pairs:
            if got != expected:
                case.reject("assignment", f"{name} differ from the assignment")

    def _check_structure(self, case: _Case) -> None:
        bundle, claim, cfg = case.bundle, case.claim, self.config
        assert bundle is not None and claim is not None
        n, p = len(claim.output_tokens), len(claim.prompt_tokens)
        limit = bundle.sampling.max_new_tokens
        problems = []
        if not 1 <= n <= limit:
            problems.append(f"{n} output tokens, want 1..{limit}")
        if not 1 <= p <= cfg.max_prompt_tokens:
            problems.append(f"{p} prompt tokens, want 1..{cfg.max_prompt_tokens}")
        if len(claim.logprobs) != n:
            problems.append(f"{len(claim.logprobs)} log-probs for {n} tokens")
        if (bundle.chunk_size, bundle.topk) != (cfg.chunk_size, cfg.topk):
            problems.append(
                f"proof shape chunk_size={bundle.chunk_size} topk={bundle.topk}, "
                f"want {cfg.chunk_size}/{cfg.topk}"
            )
        ids = claim.prompt_tokens + claim.output_tokens
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            problems.append(f"token ids outside [0, {self.vocab_size})")
        if problems:
            for problem in problems:
                case.reject("structure", problem)
            return
        want = chunk_count(p, n, cfg.chunk_size)
        if len(bundle.chunks) != want:
            case.reject("structure", f"{len(bundle.chunks)} proof chunks, want {want}")
            return
        try:
            raw = [base64.b64decode(c, validate=True) for c in bundle.chunks]
            case.moduli, case.coeffs = decode_chunks(raw, cfg.topk)
        except (binascii.Error, ValueError) as exc:
            case.reject("structure", f"chunk is not base64: {exc}")
        except BadProof as exc:
            case.reject("structure", str(exc))

    def _check_binding(self, case: _Case) -> None:
        bundle, claim = case.bundle, case.claim
        assert bundle is not None and claim is not None
        if binding_digest(bundle, claim) != bundle.digest:
            case.reject("binding", "digest does not match the claim and proofs")
            return
        try:
            verify_signature(bundle.worker_key, bytes.fromhex(bundle.digest), bundle.signature)
        except BadSignature as exc:
            case.reject("binding", f"signature: {exc}")

    # -- stage 5: the replay ---------------------------------------------------------------

    def _take_replay(self, case: _Case, prefill: Prefill | Exception) -> None:
        claim = case.claim
        assert claim is not None
        if isinstance(prefill, Exception):
            case.reject("replay", f"prefill failed: {type(prefill).__name__}: {prefill}")
            return
        n, p = len(claim.output_tokens), len(claim.prompt_tokens)
        if prefill.logits.shape[0] != n or prefill.hidden_states.shape[0] != p + n - 1:
            case.reject("replay", "prefill returned unexpected shapes")
        elif not (
            bool(torch.isfinite(prefill.hidden_states).all())
            and bool(torch.isfinite(prefill.logits).all())
        ):
            case.reject("replay", "replayed hidden states or logits are not finite")
        else:
            case.prefill = prefill

    # -- stage 6: comparisons --------------------------------------------------------------

    def _compare(self, live: list[_Case]) -> dict[int, list[ChunkAgreement]]:
        if not live:
            return {}
        results = compare_chunks(
            [c.prefill.hidden_states for c in live],  # type: ignore[union-attr]
            [len(c.claim.prompt_tokens) for c in live],  # type: ignore[union-attr]
            [c.moduli for c in live],  # type: ignore[misc]
            [c.coeffs for c in live],  # type: ignore[misc]
            self.config.chunk_size,
            self.config.topk,
        )
        return {id(c): r for c, r in zip(live, results, strict=True)}

    def _replay_sampling(self, live: list[_Case]) -> dict[int, SamplingReplay]:
        """The sampling replay of every live case, one vectorised pass per sampling-parameter
        set (a work unit has one)."""
        cfg = self.config
        groups: list[tuple[SamplingParams, list[_Case]]] = []
        for case in live:
            params = case.bundle.sampling  # type: ignore[union-attr]  # the assignment's
            for known, members in groups:
                if known == params:
                    members.append(case)
                    break
            else:
                groups.append((params, [case]))
        out: dict[int, SamplingReplay] = {}
        for params, members in groups:
            replays = replay_sampling_many(
                [c.prefill.logits for c in members],  # type: ignore[union-attr]
                [c.claim.output_tokens for c in members],  # type: ignore[union-attr]
                params,
                [c.bundle.seed for c in members],  # type: ignore[union-attr]
                cfg.sampling_tolerance,
                cfg.top_p_tolerance,
                cfg.sampling_outlier_share,
                cfg.sampling_outlier_factor,
            )
            out.update((id(c), r) for c, r in zip(members, replays, strict=True))
        return out

    def _chunk_passes(self, chunk: ChunkAgreement) -> bool:
        """The thresholds are for chunks of ``topk`` entries; a chunk of fewer (k: a model whose
        hidden size is below top-k) needs proportionally fewer exponent matches, and its mean
        mantissa error may exceed the limit by what one index ranked differently (a near-tie at
        the top-k boundary, mantissa error up to 127) weighs more in k entries than in top-k:
        127 / k − 127 / topk (3 ulps for k = 32; none for a full chunk)."""
        cfg = self.config
        need = math.ceil(cfg.min_exponent_matches * chunk.k / cfg.topk)
        one_index = MAX_MANTISSA_ERROR * (1 / max(1, chunk.k) - 1 / cfg.topk)
        return (
            chunk.k - chunk.exp_mismatches >= need
            and chunk.mant_err_mean <= cfg.max_mantissa_mean + max(0.0, one_index)
            and chunk.mant_err_median <= cfg.max_mantissa_median
        )

    def _judge(
        self,
        case: _Case,
        agreements: list[ChunkAgreement] | None,
        replay: SamplingReplay | None,
    ) -> ProofVerdict:
        if case.prefill is None or agreements is None or replay is None:
            return ProofVerdict(accepted=False, reasons=case.reasons or _no_replay())
        claim, bundle, cfg = case.claim, case.bundle, self.config
        assert claim is not None and bundle is not None
        reports, failing = [], []
        for index, chunk in enumerate(agreements):
            passed = self._chunk_passes(chunk)
            if not passed:
                failing.append(index)
            reports.append(_report(index, chunk, passed))
        if failing:
            first = agreements[failing[0]]
            case.reject(
                "hidden_states",
                f"{len(failing)} of {len(agreements)} chunks disagree; chunk {failing[0]}: "
                f"{first.k - first.exp_mismatches}/{first.k} exponents match, mantissa error "
                f"mean {first.mant_err_mean:.3g} median {first.mant_err_median:.3g}",
            )

        params = bundle.sampling  # the assignment's, checked equal above
        if replay.bad_steps:
            case.reject(
                "sampling",
                f"{len(replay.bad_steps)} tokens are not the seeded choice, "
                f"first at step {replay.bad_steps[0]}",
            )
        elif replay.near_ties:  # the honest tail at near-ties, worth watching
            log.info(
                "isolated sampling near-tie passed: %d of %d tokens trail the seeded choice "
                "by up to %.3g (tolerance %.3g), first at step %d",
                len(replay.near_ties),
                len(claim.output_tokens),
                replay.worst_margin,
                cfg.sampling_tolerance,
                replay.near_ties[0],
            )
        for problem in termination_problems(
            claim.output_tokens,
            claim.finish_reason,
            replay.logprobs,
            params,
            self.eos_token_ids,
            cfg.eos_min_prob,
        ):
            case.reject("termination", problem)
        self._check_logprobs(case, replay.logprobs)
        behaviour = replay.logprobs.tolist()
        if not all(math.isfinite(x) for x in behaviour):
            behaviour = None
        reward = self._reward(case)
        return ProofVerdict(
            accepted=not case.reasons,
            reasons=case.reasons,
            failing_chunks=failing,
            tokens_replayed=len(claim.prompt_tokens) + len(claim.output_tokens),
            behaviour_logprobs=behaviour,
            reward=reward,
            chunks=reports,
        )

    def _check_logprobs(self, case: _Case, replayed: torch.Tensor) -> None:
        """Reported vs replayed log-probs; isolated small misses pass (``toploc.replay``)."""
        claim, cfg = case.claim, self.config
        assert claim is not None
        checked = check_logprobs(
            claim.logprobs,
            replayed,
            cfg.logprob_tolerance,
            cfg.logprob_outlier_share,
            cfg.logprob_outlier_factor,
        )
        problem = checked.problem(
            cfg.logprob_tolerance, cfg.logprob_outlier_factor * cfg.logprob_tolerance
        )
        if problem is not None:
            case.reject("logprobs", problem)
        elif checked.off:  # the honest tail, worth watching: how often, how far
            log.info(
                "isolated log-prob miss passed: %d of %d tokens off by up to %.3g nats "
                "(tolerance %.3g), first at step %d",
                len(checked.off),
                len(claim.logprobs),
                checked.worst,
                cfg.logprob_tolerance,
                checked.off[0],
            )

    def _reward(self, case: _Case) -> float | None:
        claim = case.claim
        assert claim is not None
        if case.scorer is None:
            return None
        try:
            reward = float(case.scorer(claim.prompt_tokens, claim.output_tokens))
        except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as exc:
            case.reject("reward", f"scorer failed on this completion: {exc}")
            return None
        if not math.isfinite(reward):
            case.reject("reward", "scorer returned a non-finite reward")
            return None
        if claim.reward is not None and abs(claim.reward - reward) > self.config.reward_tolerance:
            case.reject("reward", f"reported reward {claim.reward} but recomputed {reward}")
        return reward


def _no_replay() -> list[Rejection]:
    return [Rejection(code="replay", detail="no replay ran")]


def _report(index: int, chunk: ChunkAgreement, passed: bool) -> ChunkReport:
    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return ChunkReport(
        index=index,
        compared=chunk.k,
        exp_mismatches=chunk.exp_mismatches,
        mant_err_mean=finite(chunk.mant_err_mean),
        mant_err_median=finite(chunk.mant_err_median),
        passed=passed,
    )


def _parse(model: type, raw: Any, max_bytes: int) -> Any:
    """``raw`` (model instance, dict, JSON str/bytes) as ``model``; BadProof when it is not."""
    if raw is None:
        raise BadProof(f"{model.__name__} is missing (null)")
    if isinstance(raw, model):
        return raw
    try:
        if isinstance(raw, bytes | bytearray | str):
            if len(raw) > max_bytes:
                raise BadProof(f"{model.__name__} is {len(raw)} bytes, limit {max_bytes}")
            return model.model_validate_json(raw)  # type: ignore[attr-defined]
        if isinstance(raw, dict):
            size = len(canonical_json(raw))
            if size > max_bytes:
                raise BadProof(f"{model.__name__} is {size} bytes, limit {max_bytes}")
            return model.model_validate(raw)  # type: ignore[attr-defined]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadProof(f"{model.__name__} invalid at {where or '(root)'}: {first['msg']}") from exc
    except (ValueError, TypeError, RecursionError) as exc:  # unserialisable or absurdly deep
        raise BadProof(f"{model.__name__} cannot be read: {exc}") from exc
    raise BadProof(f"{model.__name__} has type {type(raw).__name__}")
