"""Judge one pending submission: rebuild each sample's assignment, replay it, decide.

For sample ``i`` of a work unit (tasks in lease order, G samples each) the trusted side knows
the task (``task_indices[i // G]``), hence the prompt tokens, the seed (``sample_seed``), the
sampling parameters and the leaseholder's key. The claimed policy version is replayed with
that version's weights (fetched through shardcast) by ``swarmrl.toploc.Verifier``, which checks
hidden-state proofs, the Gumbel-max sampling, termination and log-probs, and recomputes the
reward with the environment.

A submission is accepted only if every sample is; the validator's replayed log-probs become the
trusted behaviour log-probs the trainer's importance ratio uses. A rejection is hard (the node
is banned) unless the validator itself failed ("replay" only), in which case no verdict is
given and the submission is judged again later. A submission whose policy version every weight
source has pruned cannot be replayed by anyone, ever: it is dropped with a soft rejection
(late, not proven dishonest) instead of being claimed again and again.

Knows nothing about HTTP; the caller fetches versions and posts verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from swarmrl.config.toploc import ToplocConfig
from swarmrl.envs import Environment, Task
from swarmrl.errors import VersionGone
from swarmrl.model.prompts import decode_completion, encode_prompt
from swarmrl.protocol.pool import PendingSubmission, Severity, Verdict
from swarmrl.protocol.proofs import Assignment, ProofVerdict, SampleClaim, proof_from_wire
from swarmrl.protocol.seeds import sample_seed
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.toploc.evidence import NodeEvidence, unit_measures
from swarmrl.toploc.verify import Verifier

MAX_REASONS = 8


@dataclass
class Judgement:
    """A verdict to post (None: the validator could not judge now) and what it learned."""

    verdict: Verdict | None
    rewards: list[float]
    failure: str = ""


def _reject(
    pending: PendingSubmission, reasons: list[str], severity: Severity = "hard"
) -> Judgement:
    verdict = Verdict(
        submission_id=pending.submission_id,
        accept=False,
        severity=severity,
        reasons=reasons[:MAX_REASONS],
        measured_tokens=0,
    )
    return Judgement(verdict, [])


def _scorer(
    env: Environment, tokenizer: PreTrainedTokenizerBase, by_prompt: dict[tuple[int, ...], Task]
) -> Callable[[Sequence[int], Sequence[int]], float]:
    """The environment's reward of (prompt tokens, output tokens) for this submission's tasks."""

    def score(prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> float:
        task = by_prompt[tuple(prompt_tokens)]
        text = decode_completion(tokenizer, output_tokens)
        return env.score(task, text, len(output_tokens)).reward

    return score


def judge(
    pending: PendingSubmission,
    env: Environment,
    version_of: Callable[[int], LoadedVersion],
    toploc: ToplocConfig,
    evidence: NodeEvidence | None = None,
) -> Judgement:
    """The verdict on ``pending``; ``version_of(v)`` returns version ``v`` loaded.

    An accepting verdict carries the unit's measurements (``swarmrl.toploc.evidence``) for the
    pool's record of the node. ``evidence``: records kept in this process instead (a judge
    without a pool); the unit that makes its node's exceed the limit is rejected hard with the
    evidence as its reason."""
    work = pending.work
    g = work.samples_per_task
    tasks: list[Task] = []
    by_index: dict[int, Task] = {}
    for i, sample in enumerate(pending.samples):
        expected = work.task_indices[i // g] if i // g < len(work.task_indices) else None
        if sample.task_index != expected:
            return _reject(
                pending,
                [f"sample {i}: task {sample.task_index} where the lease assigned {expected}"],
            )
        if sample.task_index not in by_index:  # a task's G samples share it
            by_index[sample.task_index] = env.task("train", sample.task_index)
        tasks.append(by_index[sample.task_index])
    by_version: dict[int, list[int]] = {}
    for i, sample in enumerate(pending.samples):
        by_version.setdefault(sample.policy_version, []).append(i)
    verdicts: dict[int, ProofVerdict] = {}
    thresholds = toploc  # as the verifier applies them (a calibration file's, where set)
    for version, indices in by_version.items():
        try:
            loaded = version_of(version)
        except VersionGone as exc:
            return _reject(pending, [f"cannot be replayed: {exc}"], severity="soft")
        tokenizer = loaded.tokenizer

        items = []
        prompts: dict[int, list[int]] = {}  # by task index: a task's G samples share a prompt
        for i in indices:
            sample = pending.samples[i]
            if sample.task_index not in prompts:
                prompts[sample.task_index] = encode_prompt(tokenizer, tasks[i])
            assignment = Assignment(
                policy_version=version,
                model_digest=loaded.root_digest,
                prompt_tokens=list(prompts[sample.task_index]),
                sampling=work.sampling,
                seed=sample_seed(work.seed, i),
                worker_key=pending.node_key,
            )
            claim = SampleClaim(
                prompt_tokens=sample.prompt_tokens,
                output_tokens=sample.output_tokens,
                logprobs=sample.logprobs,
                finish_reason=sample.finish_reason,
            )
            items.append((proof_from_wire(sample.proof), claim, assignment))  # either wire form
        # the verifier scores (prompt, output) token pairs; prompts identify tasks here
        by_prompt = {
            tuple(a.prompt_tokens): tasks[i] for i, (_, _, a) in zip(indices, items, strict=True)
        }

        verifier = Verifier(
            loaded.engine,
            toploc,
            eos_token_ids=[tokenizer.eos_token_id],
            vocab_size=len(tokenizer),
            scorer=_scorer(env, tokenizer, by_prompt),
        )
        thresholds = verifier.config
        for i, verdict in zip(indices, verifier.check_many(items), strict=True):
            verdicts[i] = verdict
    ordered = [verdicts[i] for i in range(len(pending.samples))]
    own_failures = [v for v in ordered if not v.accepted and v.codes == {"replay"}]
    if own_failures:
        return Judgement(None, [], failure=own_failures[0].reasons[0].detail)
    reasons = [
        f"sample {i}: {r.code}: {r.detail}" for i, v in enumerate(ordered) for r in v.reasons
    ]
    if reasons:
        return _reject(pending, reasons)
    reported = [s.logprobs for s in pending.samples]
    measures = unit_measures(ordered, reported, thresholds)  # the pool adds them to the node's
    if evidence is not None:
        flagged = evidence.add(pending.node_id, measures)
        if flagged is not None:
            return _reject(pending, [flagged])
    behaviour = [list(v.behaviour_logprobs or []) for v in ordered]
    verdict = Verdict(
        submission_id=pending.submission_id,
        accept=True,
        measured_tokens=sum(len(b) for b in behaviour),
        behaviour_logprobs=behaviour,
        evidence=measures or None,
    )
    return Judgement(verdict, [v.reward or 0.0 for v in ordered])
