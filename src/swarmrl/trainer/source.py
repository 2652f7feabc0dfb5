"""Where a training step's rollouts come from: the rollout-source interface and scoring.

The training loop (:mod:`swarmrl.trainer.loop`) talks to its rollouts through two verbs::

    rollouts = source.next_batch(step, policy_version)   # take step's scored groups
    ...one optimizer step on rollouts.groups...
    source.commit(step, policy_version)                  # the step is trained: the policy is
                                                         # now policy_version (hand it on)

Two implementations: the in-process engine (:class:`swarmrl.trainer.rollout.EngineSource`,
which loads each new version into its engine) and the pool
(:class:`swarmrl.roles.trainer.source.PoolSource`, which takes accepted rollouts from the
orchestrator and publishes each new version through the trainer's origin).

Rewards are always computed here, on the trusted side, from the decoded completion
(:func:`scored_completion`); a worker's word about its reward is never used.

Knows nothing about the optimizer, engines' internals or the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from swarmrl.envs import Environment, Task
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.errors import ForgedEpisode, HarnessTimedOut
from swarmrl.model.prompts import decode_completion
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.batches import TrainableSubmission
from swarmrl.protocol.episodes import ModelCall, episode_from_calls
from swarmrl.protocol.pool import Sample
from swarmrl.trainer.batch import Completion, Group
from swarmrl.trainer.episode_check import replay_episode
from swarmrl.trainer.episodes import episode_completions
from swarmrl.trainer.harness_check import rerun_episodes


@dataclass
class StepRollouts:
    """What a source hands the loop for one step."""

    groups: list[Group]  # to train on: informative only when rl.online_filter is on
    seen: list[Group] = field(default_factory=list)  # every group drawn for the step, kept or not


# what a source hands the next leading groups of a batch to (``RolloutSource.next_batch``)
Feed = Callable[[list[Group]], None]


class RolloutSource(Protocol):
    """A supplier of scored groups for each step, told when each step is trained."""

    def next_batch(self, step: int, policy_version: int, early: Feed | None = None) -> StepRollouts:
        """Step ``step``'s groups; ``policy_version`` is the policy being trained (optimizer
        steps so far). May wait (bounded) and raise :class:`swarmrl.errors.WaitTimeout`.
        ``early``: a source that gathers a batch over time hands it the batch's leading groups,
        in order and each once, while it waits for the rest (the learner computes their
        gradients meanwhile); the groups returned start with every group it was handed."""
        ...

    def commit(self, step: int, policy_version: int) -> None:
        """Step ``step`` is trained (or skipped, when its batch was empty); the policy is now
        ``policy_version``. Called once per step, after :meth:`next_batch`."""
        ...


def scored_completion(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    behaviour_logprobs: Sequence[float],
    policy_version: int,
) -> Completion:
    """A completion with its reward recomputed from its text by the environment."""
    text = decode_completion(tokenizer, output_tokens)
    score = env.score(task, text, num_tokens=len(output_tokens))
    return Completion(
        prompt_tokens=list(prompt_tokens),
        output_tokens=list(output_tokens),
        behaviour_logprobs=list(behaviour_logprobs),
        reward=score.reward,
        policy_version=policy_version,
        correct=bool(score.details.get("correct", score.reward == 1.0)),
        text=text,
    )


def submission_groups(
    sub: TrainableSubmission,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    group_size: int,
    max_new_tokens: int,
) -> list[Group]:
    """One accepted pool submission as per-task groups (G completions each), rewards recomputed.

    Behaviour log-probs are the validator's replay of the generating version, or, for an
    unchecked submission that a later passed spot check released, the worker's declared ones
    (``swarmrl.pool.flow.spotcheck``); a submission served without any yields no groups.

    Episodes (a multi-turn ``env``) are recomputed here too, checked or not: the trainer trains
    on the environment turns it computes itself and scores the recomputed transcript, so a
    forged environment turn never trains even in work no validator replayed; an episode that
    differs from its recomputation raises :class:`ForgedEpisode` (``max_new_tokens``: the
    sampling limit per call the units were leased with). Harness episodes (a verifiers taskset,
    ``env.verifiers_reexecute``) are played again by the harness with their model turns
    (``swarmrl.trainer.harness_check``); a replay past its timeout raises
    :class:`~swarmrl.errors.HarnessTimedOut` (not trained either).
    """
    if sub.behaviour_logprobs is None:
        return []
    if isinstance(env, VerifiersV1Env):
        return _harness_groups(sub, env, tokenizer, group_size, max_new_tokens)
    groups = []
    for j, task_index in enumerate(sub.task_indices):
        group = Group(env.task("train", task_index))
        rows = slice(j * group_size, (j + 1) * group_size)
        for sample, behaviour in zip(
            sub.samples[rows], sub.behaviour_logprobs[rows], strict=True
        ):  # the orchestrator checked the shapes; a mismatch here is a bug, so it raises
            if isinstance(env, MultiTurnEnvironment):
                group.completions += trusted_episode(
                    env, tokenizer, group.task, sample, behaviour, max_new_tokens
                )
                continue
            group.completions.append(
                scored_completion(
                    env,
                    tokenizer,
                    group.task,
                    sample.prompt_tokens,
                    sample.output_tokens,
                    behaviour,
                    sample.policy_version,
                )
            )
        groups.append(group)
    return groups


def trusted_episode(
    env: MultiTurnEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    sample: Sample,
    behaviour: Sequence[float],
    max_new_tokens: int,
) -> list[Completion]:
    """The completions of an episode sample (one per segment) as the trusted side recomputes
    it from its model turns, with ``behaviour`` [model tokens] as its log-probs and the reward
    of the recomputed transcript; :class:`ForgedEpisode` where the claim differs."""
    if sample.episode is None:
        raise ForgedEpisode(f"task {task.problem_id}: a multi-turn task's sample has no episode")
    rejection, state = replay_episode(env, tokenizer, task, sample.episode, max_new_tokens)
    if rejection is not None or state is None:
        raise ForgedEpisode(f"task {task.problem_id}: {rejection}")
    score = env.score_episode(task, state.seed, state.transcript)
    episode = episode_from_calls(_with_behaviour(state.calls, behaviour), state.seed, score.reward)
    correct = bool(score.details.get("correct", score.reward == 1.0))
    return episode_completions(episode, sample.policy_version, correct)


def _with_behaviour(calls: Sequence[ModelCall], behaviour: Sequence[float]) -> list[ModelCall]:
    """``calls`` with ``behaviour`` [all their output tokens, in order] as their log-probs."""
    out, used = [], 0
    for call in calls:
        n = len(call.output_tokens)
        out.append(
            ModelCall(call.prompt_tokens, call.output_tokens, list(behaviour[used : used + n]))
        )
        used += n
    return out


def _harness_groups(
    sub: TrainableSubmission,
    env: VerifiersV1Env,
    tokenizer: PreTrainedTokenizerBase,
    group_size: int,
    max_new_tokens: int,
) -> list[Group]:
    """``submission_groups`` of a harness environment: every episode of ``sub`` replayed at
    once, trained with the replayed rewards and the trusted behaviour log-probs (the replay's
    model answers are scripted: of the sampling, only the token limit matters)."""
    assert sub.behaviour_logprobs is not None
    tasks = [env.task("train", t) for t in sub.task_indices for _ in range(group_size)]
    episodes = [s.episode for s in sub.samples]
    if any(e is None for e in episodes) or len(tasks) != len(episodes):
        raise ForgedEpisode(
            f"submission {sub.submission_id}: a harness task's sample has no episode"
        )
    limit = SamplingParams(max_new_tokens=max_new_tokens)
    reruns = rerun_episodes(env, tokenizer, tasks, episodes, limit)  # type: ignore[arg-type]
    groups = [Group(env.task("train", t)) for t in sub.task_indices]
    for i, (sample, rerun) in enumerate(zip(sub.samples, reruns, strict=True)):
        if rerun.own_failure:
            raise HarnessTimedOut(f"submission {sub.submission_id}: {rerun.own_failure}")
        if rerun.rejection:
            raise ForgedEpisode(f"task {tasks[i].problem_id}: {rerun.rejection}")
        calls = _with_behaviour(rerun.calls, sub.behaviour_logprobs[i])
        episode = episode_from_calls(calls, sample.episode.seed, rerun.reward)  # type: ignore[union-attr]
        groups[i // group_size].completions += episode_completions(
            episode, sample.policy_version, rerun.correct
        )
    return groups


def group_version(group: Group) -> int:
    """The oldest policy version among a group's completions."""
    return min(c.policy_version for c in group.completions)


def tasks_to_ask(short: int, informative: Sequence[bool]) -> int:
    """How many tasks to take for ``short`` more informative groups, given whether each
    recently drawn group was informative (``informative``; empty: assume all are): ``short``
    divided by that share, the share taken as at least 1/8 so one answer never asks for more
    than eight times what is short. A trainer that takes all there is holds work its next
    steps may not train while fresh, and takes it from where the pool counts it."""
    if short <= 0:
        return 0
    share = sum(informative) / len(informative) if informative else 1.0
    return math.ceil(short / max(share, 1 / 8))


def held_through(step: int, versions: list[int], need: int, async_level: int) -> int:
    """The highest step from ``step`` on whose batch held groups of ``versions`` (in the order
    they are held) fill with nothing more arriving, each step dropping the groups too old for
    it (version < its step − ``async_level``) and taking the first ``need`` of the rest, as a
    step's batch is taken; ``step − 1`` when not even ``step``'s is full."""
    held = list(versions)
    while True:
        held = [v for v in held if v >= step - async_level]
        if len(held) < need:
            return step - 1
        held = held[need:]
        step += 1
