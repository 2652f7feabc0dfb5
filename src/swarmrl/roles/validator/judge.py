"""Judge pending submissions: rebuild each sample's assignment, replay it, decide.

For sample ``i`` of a work unit (tasks in lease order, G samples each) the trusted side knows
the task (``task_indices[i // G]``), hence the prompt tokens, the seed (``sample_seed``), the
sampling parameters and the leaseholder's key. The claimed policy version is replayed with
that version's weights (fetched through shardcast) by ``swarmrl.toploc.Verifier``, which checks
hidden-state proofs, the Gumbel-max sampling, termination and log-probs, and recomputes the
reward with the environment.

An episode of a multi-turn task (``swarmrl.protocol.pool.Sample``'s episode form) is first
recomputed from the task, its seed (``sample_seed``, the same rule) and its model turns
(``swarmrl.trainer.episode_check``): an environment turn that differs (a forged tool result),
environment tokens claimed as sampled, reordered, dropped or extra turns, or an episode past
its turn or token budget is a rejection with its reason. Then each model call is one item for
the verifier, against the recomputed prompt (the whole sequence before it, environment turns
included), the recomputed token limit and the call's seed ``derive_seed("turn", seed, k)``: the
proofs cover the whole sequence, the sampling and termination checks the model tokens only.
The episode's reward is the environment's score of the recomputed transcript.

An episode of a verifiers taskset (``swarmrl.envs.vf1`` under ``env.verifiers_reexecute``) is
recomputed by playing its harness again with the claimed model turns as the model's answers
(``swarmrl.trainer.harness_check``); then each call is checked the same way, against the prompt
and sampling the trusted side's harness produced, and the reward is the replayed trace's.

A submission is accepted only if every sample is; the validator's replayed log-probs become the
trusted behaviour log-probs the trainer's importance ratio uses. A rejection is hard (the node
is banned) unless the validator itself failed ("replay" only), in which case no verdict is
given and the submission is judged again later; so is one whose policy version cannot be
fetched now (the sources away longer than the fetch's retries), without holding up the units
of other versions. A submission whose policy version every weight source has pruned cannot be
replayed by anyone, ever: it is dropped with a soft rejection (late, not proven dishonest)
instead of being claimed again and again.

Knows nothing about HTTP; the caller fetches versions and posts verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from swarmrl.config.toploc import ToplocConfig
from swarmrl.envs import Environment, Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.errors import InfraError, VersionGone
from swarmrl.model.prompts import decode_completion, encode_prompt
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.episodes import Episode, ModelCall
from swarmrl.protocol.pool import Sample, Severity
from swarmrl.protocol.proofs import Assignment, ProofVerdict, SampleClaim, proof_from_wire
from swarmrl.protocol.seeds import derive_seed, sample_seed
from swarmrl.protocol.verdicts import PendingSubmission, Verdict
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.toploc.evidence import NodeEvidence, unit_measures
from swarmrl.toploc.verify import Scorer, Verifier
from swarmrl.trainer.episode_check import replay_episode
from swarmrl.trainer.harness_check import rerun_episodes

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


# (sample index, what the verifier checks, replay-sharing key: an episode segment's calls share)
Item = tuple[int, tuple[Any, SampleClaim, Assignment], Hashable | None]


def _sample_items(
    pending: PendingSubmission,
    loaded: LoadedVersion,
    tasks: list[Task],
    indices: list[int],
    env: Environment,
) -> tuple[list[Item], Callable[[Sequence[int], Sequence[int]], float]]:
    """One verifier item per single-turn sample of ``indices``, and the scorer of their tasks."""
    work, tokenizer = pending.work, loaded.tokenizer
    items: list[Item] = []
    prompts: dict[int, list[int]] = {}  # by task index: a task's G samples share a prompt
    for i in indices:
        sample = pending.samples[i]
        if sample.task_index not in prompts:
            prompts[sample.task_index] = encode_prompt(tokenizer, tasks[i])
        assignment = Assignment(
            policy_version=loaded.version,
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
        items.append((i, (proof_from_wire(sample.proof), claim, assignment), None))  # either form
    # the verifier scores (prompt, output) token pairs; prompts identify tasks here
    by_prompt = {tuple(a.prompt_tokens): tasks[i] for i, (_, _, a), _ in items}
    return items, _scorer(env, tokenizer, by_prompt)


def _claimed_episodes(pending: PendingSubmission, indices: list[int]) -> list[Episode] | Judgement:
    """The episodes of samples ``indices``, each with the seed its lease gives it, or the
    rejection of the first that has none or another seed."""
    episodes = []
    for i in indices:
        episode = pending.samples[i].episode
        if episode is None:
            return _reject(pending, [f"sample {i}: the task is multi-turn; no episode was sent"])
        seed = sample_seed(pending.work.seed, i)
        if episode.seed != seed:
            return _reject(
                pending, [f"sample {i}: episode seed {episode.seed} where the lease gives {seed}"]
            )
        episodes.append(episode)
    return episodes


def _call_items(
    pending: PendingSubmission,
    loaded: LoadedVersion,
    i: int,
    episode: Episode,
    calls: Sequence[ModelCall],
    sampling: Sequence[SamplingParams],
) -> list[Item]:
    """One verifier item per model call of sample ``i``'s episode, against the calls as the
    trusted side recomputed them: each call's prompt and sampling are the recomputed ones,
    its seed ``derive_seed("turn", episode seed, k)``."""
    tokenizer = loaded.tokenizer
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    proofs = pending.samples[i].turn_proofs or [None] * len(calls)
    segment_of = [
        s for s, seg in enumerate(episode.segments) for t in seg.turns if t.role == "model"
    ]
    items: list[Item] = []
    for k, (call, params) in enumerate(zip(calls, sampling, strict=True)):
        assignment = Assignment(
            policy_version=loaded.version,
            model_digest=loaded.root_digest,
            prompt_tokens=call.prompt_tokens,
            sampling=params,
            seed=derive_seed("turn", episode.seed, k),
            worker_key=pending.node_key,
        )
        ended = bool(call.output_tokens) and call.output_tokens[-1] in stops | set(
            params.stop_token_ids
        )
        claim = SampleClaim(
            prompt_tokens=call.prompt_tokens,
            output_tokens=call.output_tokens,
            logprobs=call.logprobs,
            finish_reason="eos" if ended else "length",
        )
        # one replay per segment: its calls' sequences extend one another
        items.append((i, (proof_from_wire(proofs[k]), claim, assignment), (i, segment_of[k])))
    return items


def _episode_items(
    pending: PendingSubmission,
    env: MultiTurnEnvironment,
    loaded: LoadedVersion,
    tasks: list[Task],
    indices: list[int],
    rewards: dict[int, float],
) -> list[Item] | Judgement:
    """The verifier items of each episode of ``indices``, checked against the episode the
    trusted side recomputes (``swarmrl.trainer.episode_check``). Fills ``rewards`` from the
    recomputed transcripts. A rejection (a forged environment turn, a wrong seed, a missing
    episode) is returned as the judgement."""
    episodes = _claimed_episodes(pending, indices)
    if isinstance(episodes, Judgement):
        return episodes
    items: list[Item] = []
    for i, episode in zip(indices, episodes, strict=True):
        rejection, state = replay_episode(
            env, loaded.tokenizer, tasks[i], episode, pending.work.sampling.max_new_tokens
        )
        if rejection is not None or state is None:
            return _reject(pending, [f"sample {i}: episode: {rejection}"])
        lease = pending.work.sampling
        sampling = [lease.model_copy(update={"max_new_tokens": n}) for n in state.limits]
        items += _call_items(pending, loaded, i, episode, state.calls, sampling)
        rewards[i] = env.score_episode(tasks[i], episode.seed, state.transcript).reward
    return items


def _harness_items(
    pending: PendingSubmission,
    env: VerifiersV1Env,
    loaded: LoadedVersion,
    tasks: list[Task],
    indices: list[int],
    rewards: dict[int, float],
) -> list[Item] | Judgement:
    """The verifier items of each harness episode of ``indices``, checked against the harness
    played again with the episode's model turns (``swarmrl.trainer.harness_check``), all at
    once. Fills ``rewards`` with the replayed traces' rewards. A replay past its timeout is a
    soft rejection: the unit is dropped, its node not banned."""
    episodes = _claimed_episodes(pending, indices)
    if isinstance(episodes, Judgement):
        return episodes
    reruns = rerun_episodes(
        env, loaded.tokenizer, [tasks[i] for i in indices], episodes, pending.work.sampling
    )
    items: list[Item] = []
    for i, episode, rerun in zip(indices, episodes, reruns, strict=True):
        if rerun.own_failure:  # not proven dishonest, but never judged again: a harness a
            # crafted episode makes hang would cost a timeout at every claim
            return _reject(pending, [f"sample {i}: episode: {rerun.own_failure}"], "soft")
        if rerun.rejection:
            return _reject(pending, [f"sample {i}: episode: {rerun.rejection}"])
        items += _call_items(pending, loaded, i, episode, rerun.calls, rerun.sampling)
        rewards[i] = rerun.reward
    return items


def _call_logprobs(sample: Sample) -> list[list[float]]:
    """The log-probs a worker reported, one list per model call (one call for a single turn)."""
    if sample.episode is None:
        return [sample.logprobs]
    return [c.logprobs for c in sample.episode.calls()]


def judge(
    pending: PendingSubmission,
    env: Environment,
    version_of: Callable[[int], LoadedVersion],
    toploc: ToplocConfig,
    evidence: NodeEvidence | None = None,
    engine: str | None = None,
) -> Judgement:
    """The verdict on ``pending``; ``version_of(v)`` returns version ``v`` loaded.

    An accepting verdict carries the unit's measurements (``swarmrl.toploc.evidence``) for the
    pool's record of the node, measured against the honest means of the pairing of the engine
    the node declared (``PendingSubmission.engine``) and ``engine``, the one this validator
    replays on, where the calibration recorded them (else the loosest pairing's).
    ``evidence``: records kept in this process instead (a judge without a pool); the unit that
    makes its node's exceed the limit is rejected hard with the evidence as its reason."""
    return judge_many([pending], env, version_of, toploc, evidence, engine)[0]


@dataclass
class _Unit:
    """One submission on its way through ``judge_many``."""

    pending: PendingSubmission
    tasks: list[Task]
    verdicts: dict[int, list[ProofVerdict]] = field(default_factory=dict)  # one per model call
    rewards: dict[int, float] = field(default_factory=dict)  # episodes', recomputed
    thresholds: ToplocConfig | None = None  # as the verifier applied them
    done: Judgement | None = None


def judge_many(
    pendings: Sequence[PendingSubmission],
    env: Environment,
    version_of: Callable[[int], LoadedVersion],
    toploc: ToplocConfig,
    evidence: NodeEvidence | None = None,
    engine: str | None = None,
) -> list[Judgement]:
    """``judge`` on each of ``pendings``, in order. The samples of every submission at one
    policy version are replayed together, in batched prefills, rather than submission by
    submission; what that saves depends on the engine and the units (``bench/replay_batch.py``:
    on a CPU nothing for the demo's 64-sample units, 11–20 % for 8-sample ones; a GPU's small
    batches are memory-bound, not measured). Each submission is judged on its own
    samples alone: a rejected one leaves the others' verdicts as they would be alone, and a
    failure of the validator's own replay defers only the submissions it touched."""
    units = [_Unit(p, []) for p in pendings]
    by_version: dict[int, list[tuple[_Unit, list[int]]]] = {}
    for unit in units:
        unit.done = _assigned_tasks(unit, env)
        if unit.done is not None:
            continue
        indices: dict[int, list[int]] = {}
        for i, sample in enumerate(unit.pending.samples):
            indices.setdefault(sample.policy_version, []).append(i)
        for version, idx in indices.items():
            by_version.setdefault(version, []).append((unit, idx))
    for version, parts in by_version.items():
        try:
            loaded = version_of(version)
        except VersionGone as exc:
            for unit, _ in parts:
                if unit.done is None:
                    unit.done = _reject(unit.pending, [f"cannot be replayed: {exc}"], "soft")
            continue
        except InfraError as exc:  # the weights cannot be had now: judged once they can
            for unit, _ in parts:
                if unit.done is None:
                    unit.done = Judgement(None, [], failure=f"policy v{version}: {exc}")
            continue
        batch: list[tuple[_Unit, Item, Scorer | None]] = []
        for unit, idx in parts:
            if unit.done is not None:
                continue
            if isinstance(env, (MultiTurnEnvironment, VerifiersV1Env)):
                item_maker = (
                    _episode_items if isinstance(env, MultiTurnEnvironment) else _harness_items
                )
                checked = item_maker(unit.pending, env, loaded, unit.tasks, idx, unit.rewards)  # type: ignore[arg-type]
                if isinstance(checked, Judgement):
                    unit.done = checked
                    continue
                items, scorer = checked, None  # an episode's reward is its whole transcript's
            else:
                items, scorer = _sample_items(unit.pending, loaded, unit.tasks, idx, env)
            batch += [(unit, item, scorer) for item in items]
        verifier = Verifier(
            loaded.engine,
            toploc,
            eos_token_ids=[loaded.tokenizer.eos_token_id],
            vocab_size=len(loaded.tokenizer),
        )
        checked_items = verifier.check_many(
            [x for _, (_, x, _), _ in batch],
            [(id(unit), k) if k is not None else None for unit, (_, _, k), _ in batch],
            [scorer for _, _, scorer in batch],
        )
        for (unit, (i, _, _), _), verdict in zip(batch, checked_items, strict=True):
            unit.verdicts.setdefault(i, []).append(verdict)
        for unit, _ in parts:
            unit.thresholds = verifier.config  # as the verifier applied them
    return [unit.done or _decide(unit, env, toploc, evidence, engine) for unit in units]


def _assigned_tasks(unit: _Unit, env: Environment) -> Judgement | None:
    """Fills ``unit.tasks`` with each sample's task as the lease assigned it; a sample on
    another task is the unit's rejection."""
    pending = unit.pending
    g = pending.work.samples_per_task
    by_index: dict[int, Task] = {}
    for i, sample in enumerate(pending.samples):
        indices = pending.work.task_indices
        expected = indices[i // g] if i // g < len(indices) else None
        if sample.task_index != expected:
            return _reject(
                pending,
                [f"sample {i}: task {sample.task_index} where the lease assigned {expected}"],
            )
        if sample.task_index not in by_index:  # a task's G samples share it
            by_index[sample.task_index] = env.task("train", sample.task_index)
        unit.tasks.append(by_index[sample.task_index])
    return None


def _decide(
    unit: _Unit,
    env: Environment,
    toploc: ToplocConfig,
    evidence: NodeEvidence | None,
    engine: str | None,
) -> Judgement:
    """The verdict on a replayed unit from its samples' verdicts; ``engine``: the validator's."""
    pending, verdicts = unit.pending, unit.verdicts
    thresholds = unit.thresholds or toploc
    calls = [v for i in range(len(pending.samples)) for v in verdicts[i]]
    own_failures = [v for v in calls if not v.accepted and v.codes == {"replay"}]
    if own_failures:
        return Judgement(None, [], failure=own_failures[0].reasons[0].detail)
    episodes = isinstance(env, (MultiTurnEnvironment, VerifiersV1Env))
    reasons = [
        f"sample {i}" + (f" turn {k}" if episodes else "") + f": {r.code}: {r.detail}"
        for i in range(len(pending.samples))
        for k, v in enumerate(verdicts[i])
        for r in v.reasons
    ]
    if reasons:
        return _reject(pending, reasons)
    reported = [lp for s in pending.samples for lp in _call_logprobs(s)]  # one per model call
    declared = pending.engine
    pairing = f"{declared}->{engine}" if declared and engine else None
    # the pool adds the measurements to the node's record
    measures = unit_measures(calls, reported, thresholds, pairing)
    if evidence is not None:
        flagged = evidence.add(pending.node_id, measures)
        if flagged is not None:
            return _reject(pending, [flagged])
    behaviour = [
        [x for v in verdicts[i] for x in (v.behaviour_logprobs or [])]
        for i in range(len(pending.samples))
    ]
    verdict = Verdict(
        submission_id=pending.submission_id,
        accept=True,
        measured_tokens=sum(len(b) for b in behaviour),
        behaviour_logprobs=behaviour,
        evidence=measures or None,
    )
    scored = [
        unit.rewards[i] if episodes else (verdicts[i][0].reward or 0.0)
        for i in range(len(pending.samples))
    ]
    return Judgement(verdict, scored)
